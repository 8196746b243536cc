"""A Server-Sent Events response that notices the client leaving: the stream runs in its
own task while this one waits for `http.disconnect`, which cancels the stream at once
(its `finally` cancels the remote call), even while it waits for the next value.

Starlette's StreamingResponse only notices a gone client when a write fails, and uvicorn
drops writes to a closed connection silently, so a producer that yields slowly would
otherwise run to its end for no one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(events, status_code, {**HEADERS, **(headers or {})})
        self.events = events

    async def _stream(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose: Callable[[], Awaitable[Any]] | None = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()  # a stream stopped at a yield runs its finally now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, gone):
                if not task.done():
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream  # its finally blocks have run when this returns
            with contextlib.suppress(asyncio.CancelledError):
                await gone


def event(data: bytes, name: str = "") -> bytes:
    """One event: `data` must hold no raw newline (compact JSON does not)."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + data + b"\n\n"
