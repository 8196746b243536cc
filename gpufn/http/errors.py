"""Errors as HTTP answers. The native routes answer `{"error": {"type": KIND, "message"}}`
with the status that fits the gpufn error kind (a remote exception is a 500 that names its
type); the OpenAI routes answer OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}` with OpenAI's types. No answer ever carries a traceback or a server path: a remote
traceback (and a model loader's, inside a `ModelLoadError`) goes to the gateway's log with
the request's id (`x-request-id`, set on every answer by `RequestIds`)."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpufn.exceptions import GpufnError, kind_of
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.http")

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

# HTTP status -> OpenAI's error type (what the official clients map to their exceptions);
# any other 4xx (400, 405, 408, 413, 422, ...) is "invalid_request_error", a 5xx "server_error".
OPENAI_TYPES: dict[int, str] = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    429: "rate_limit_error",
}

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("gpufn_request_id", default="")

_TRACEBACK = "Traceback (most recent call last)"
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')


class HTTPError(Exception):
    """An answer that is an error: raised anywhere in a route, rendered by the app.
    `param` and `code` are OpenAI's fields (the request parameter at fault; a short
    machine-readable reason); the native shape leaves them out."""

    def __init__(self, status: int, type_: str, message: str,
                 headers: dict[str, str] | None = None, *, param: str | None = None,
                 code: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or {}  # of the answer (Retry-After, Connection: close)
        self.param = param
        self.code = code
        self.extra = extra

    def body(self) -> bytes:
        return error_body(self.type, self.message, **self.extra)

    def event(self) -> bytes:
        """The same error as the `event: error` of a Server-Sent Event stream."""
        return b"event: error\ndata: " + self.body_inner() + b"\n\n"

    def body_inner(self) -> bytes:
        return json.dumps({"type": self.type, "message": self.message, **self.extra},
                          ensure_ascii=False, default=str).encode()

    def openai(self) -> dict[str, Any]:
        """`{"message", "type", "param", "code"}`: the error in OpenAI's shape."""
        kind = OPENAI_TYPES.get(self.status, "server_error" if self.status >= 500
                                else "invalid_request_error")
        code = self.code or _snake(self.type)
        message = self.message
        if self.extra.get("remote"):  # the remote exception's type leads its message
            message = f"{self.type}: {self.message}"
        return {"message": message, "type": kind, "param": self.param, "code": code}

    def openai_body(self) -> bytes:
        return json.dumps({"error": self.openai()}, ensure_ascii=False, default=str).encode()


def _snake(kind: str) -> str:
    """`QueueFull` -> `queue_full`; an OpenAI code is snake case."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", kind).lower() if kind else "error"


def error_body(type_: str, message: str, **extra: Any) -> bytes:
    return json.dumps({"error": {"type": type_, "message": message, **extra}},
                      ensure_ascii=False, default=str).encode()


def public(message: str) -> str:
    """`message` without any traceback or stack frame in it (they name server paths)."""
    cut = message.find(_TRACEBACK)
    if cut >= 0:
        message = message[:cut]
    return "\n".join(x for x in message.splitlines() if not _FRAME.match(x)).strip()


def _logged(kind: str, message: str, traceback: str = "") -> str:
    """The public part of a message; the whole of it (and a traceback) to the log, with
    the request's id."""
    shown = public(message)
    if traceback or shown != message.strip():
        log.warning("request %s: %s: %s\n%s", request_id.get() or "-", kind, message,
                    traceback)
    return shown


def from_gpufn(e: GpufnError) -> HTTPError:
    kind = kind_of(e)
    return HTTPError(STATUS.get(kind, 500), kind, _logged(kind, str(e)))


def from_result(res: p.Result) -> HTTPError:
    """The error a failed call's Result stands for (never unpickling its frames)."""
    if res.error_kind:
        return HTTPError(STATUS.get(res.error_kind, 500), res.error_kind,
                         _logged(res.error_kind, res.message))
    kind = res.meta.error_type or "Exception"
    return HTTPError(500, kind, _logged(kind, res.message, res.meta.traceback or ""),
                     remote=True)


def bad_request(message: str, type_: str = "BadRequest", *, param: str | None = None,
                code: str | None = None) -> HTTPError:
    return HTTPError(400, type_, message, param=param, code=code)


class RequestIds:
    """ASGI middleware: every request gets an id (`x-request-id` on its answer, and in the
    log lines about it); a caller's own `x-request-id` (up to 64 of `[A-Za-z0-9._-]`) is
    kept."""

    _OK = re.compile(rb"[A-Za-z0-9._-]{1,64}")  # whole: `$` would pass a final newline

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = given.decode() if self._OK.fullmatch(given) else f"req_{secrets.token_hex(12)}"
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id.set(rid)

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, with_id)
        finally:
            request_id.reset(token)
