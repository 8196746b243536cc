"""Routes what user code prints or logs to the invocation that printed it.

`sys.stdout`/`sys.stderr` are replaced by proxies that look up the current invocation
(thread-local, set by the executor; or the only running one, for threads user code
starts) and buffer its text; the worker's I/O loop ships the buffers as `Output`.
"""

from __future__ import annotations

import io
import sys
import threading
from contextvars import ContextVar
from typing import Any, TextIO

from gpufn.wire import protocol as p

_current = threading.local()
_current_async: ContextVar[str | None] = ContextVar("gpufn_invocation", default=None)


def set_current(invocation_id: str | None) -> None:
    _current.inv = invocation_id


def set_current_async(invocation_id: str) -> None:
    """The invocation of the async call whose task runs this (on the worker's loop)."""
    _current_async.set(invocation_id)


class OutputRouter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: dict[tuple[str, str], list[str]] = {}
        self._running: set[str] = set()
        self.original_stdout: TextIO = sys.stdout
        self.original_stderr: TextIO = sys.stderr

    def install(self) -> None:
        sys.stdout = _Proxy(self, "stdout", self.original_stdout)
        sys.stderr = _Proxy(self, "stderr", self.original_stderr)

    def started(self, inv: str) -> None:
        with self._lock:
            self._running.add(inv)

    def finished(self, inv: str) -> None:
        with self._lock:
            self._running.discard(inv)

    def write(self, stream: str, text: str, fallback: TextIO) -> None:
        inv = _current_async.get() or getattr(_current, "inv", None)
        with self._lock:
            if inv is None and len(self._running) == 1:
                inv = next(iter(self._running))
            if inv is None:
                fallback.write(text)
                return
            self._buf.setdefault((inv, stream), []).append(text)

    def pending(self) -> bool:
        return bool(self._buf)

    def drain(self, invocation_id: str | None = None) -> list[p.Output]:
        """Output messages for buffered text (of one invocation, or of all)."""
        with self._lock:
            if invocation_id is None:
                items = list(self._buf.items())
                self._buf.clear()
            else:
                items = [(k, self._buf.pop(k)) for k in list(self._buf) if k[0] == invocation_id]
        return [p.Output(inv, stream, "".join(parts)) for (inv, stream), parts in items]


class _Proxy(io.TextIOBase):
    def __init__(self, router: OutputRouter, name: str, fallback: TextIO) -> None:
        self._router = router
        self._name = name
        self._fallback = fallback

    def write(self, s: str) -> int:
        if s:
            self._router.write(self._name, s, self._fallback)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fallback.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fallback, name)
