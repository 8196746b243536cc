"""The gateway's uvicorn server: its config, and the HTTP protocol with a header timeout.

uvicorn times out a connection only while it is idle between requests
(`timeout_keep_alive`); a connection that never sends a whole request head (half-open,
or a slow client sending a byte at a time) would be kept forever. Here a request's head
must arrive within the read timeout of its first byte (or of the connection being made),
and bytes that trickle in after an answer (the rest of a refused body) no longer keep the
connection open. The body is timed by the routes (gpufn/http/bodies.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gpufn.wire import config


def with_head_timeout(base: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """`base` (uvicorn's httptools or h11 protocol) closing a connection whose request head
    does not arrive within `timeout_s`."""

    class HeadTimeoutProtocol(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_cycle: Any = None
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if cycle is not self._head_cycle:  # a request's head is in: it runs
                self._head_cycle = cycle
                self._disarm_head()
            elif cycle is None or cycle.response_complete:  # a new head (or leftovers) arrive
                self._arm_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head()
            super().connection_lost(exc)

        def _arm_head(self) -> None:
            if self._head_timer is None:
                self._head_timer = asyncio.get_running_loop().call_later(timeout_s, self._head_late)

        def _disarm_head(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    HeadTimeoutProtocol.__name__ = f"HeadTimeout{base.__name__}"
    return HeadTimeoutProtocol


def make_config(app: Any, host: str, port: int, cert: str | None, key: str | None) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, lifespan="on", log_level="warning",
                          access_log=False, server_header=False, ssl_certfile=cert,
                          ssl_keyfile=key, timeout_graceful_shutdown=5, timeout_keep_alive=5,
                          http=with_head_timeout(AutoHTTPProtocol, config.http_read_timeout()))
