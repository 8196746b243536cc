"""Errors as HTTP answers: `{"error": {"type": ..., "message": ...}}` with the status that fits
the gpufn error kind (a remote exception is a 500 that names its type)."""

from __future__ import annotations

import json
from typing import Any

from gpufn.exceptions import GpufnError, kind_of
from gpufn.wire import protocol as p

# gpufn error kind -> HTTP status; any other kind (and a remote exception) is a 500.
STATUS: dict[str, int] = {
    "InvalidSpec": 400,
    "AuthenticationError": 401,
    "NotFound": 404,
    "RequestTimeout": 408,
    "PayloadTooLarge": 413,
    "QueueFull": 429,
    "ConnectionLost": 503,  # draining, or the scheduler is gone
    "AppStopped": 503,
    "Cancelled": 503,  # dropped from the queue while the scheduler drains
    "Timeout": 504,
}


class HTTPError(Exception):
    """An answer that is an error: raised anywhere in a route, rendered by the app."""

    def __init__(self, status: int, type_: str, message: str,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or {}  # of the answer (Retry-After, Connection: close)
        self.extra = extra

    def body(self) -> bytes:
        return error_body(self.type, self.message, **self.extra)

    def event(self) -> bytes:
        """The same error as the `event: error` of a Server-Sent Event stream."""
        return b"event: error\ndata: " + self.body_inner() + b"\n\n"

    def body_inner(self) -> bytes:
        return json.dumps({"type": self.type, "message": self.message, **self.extra},
                          ensure_ascii=False, default=str).encode()


def error_body(type_: str, message: str, **extra: Any) -> bytes:
    return json.dumps({"error": {"type": type_, "message": message, **extra}},
                      ensure_ascii=False, default=str).encode()


def from_gpufn(e: GpufnError) -> HTTPError:
    kind = kind_of(e)
    return HTTPError(STATUS.get(kind, 500), kind, str(e))


def from_result(res: p.Result) -> HTTPError:
    """The error a failed call's Result stands for (never unpickling its frames)."""
    if res.error_kind:
        return HTTPError(STATUS.get(res.error_kind, 500), res.error_kind, res.message)
    kind = res.meta.error_type or "Exception"
    if res.meta.traceback:
        return HTTPError(500, kind, res.message, remote=True, traceback=res.meta.traceback)
    return HTTPError(500, kind, res.message, remote=True)


def bad_request(message: str, type_: str = "BadRequest") -> HTTPError:
    return HTTPError(400, type_, message)
