"""Request bodies, bounded: each one by the size limit while it streams in (a body without
Content-Length, chunked, is counted as it comes: 413 as soon as it passes the limit, never
buffered past it), all of them together by a budget of bytes being read and parsed at once
(past it: 503 with Retry-After; the client sends it again), each by a read timeout between
its pieces (408), and as JSON: NaN and infinities, and nesting too deep to parse, are the client's error (400)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gpufn.http.errors import HTTPError, bad_request

# A stalled body's answer ends its connection. A refused one's (413, 503) does not: the
# rest of its body is read and dropped as it comes (nothing kept), so that the client reads
# the answer rather than a reset; the connection is closed at most the read timeout after
# the first dropped byte, unless a new request starts on it (gpufn/http/server.py).
CLOSE = {"Connection": "close"}
RETRY_AFTER_S = 1


class BodyBudget:
    """The bytes of request bodies read and not yet parsed and encoded, all together.
    One event loop owns it: no lock."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def lease(self) -> Lease:
        return Lease(self)


class Lease:
    """One request's share of the budget: grown as its body arrives, given back once the
    call's payload is encoded (or the request ends)."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0

    def grow(self, n: int) -> None:
        b = self.budget
        if n > 0 and b.used + n > b.total:
            raise HTTPError(503, "Busy", (
                f"the gateway is reading {b.used:,} bytes of other request bodies; {n:,} more "
                f"would pass its budget of {b.total:,} (GPUFN_HTTP_BODY_BUDGET): send this "
                f"again in {RETRY_AFTER_S}s"),
                headers={"Retry-After": str(RETRY_AFTER_S)})
        b.used += n
        self.held += n

    def release(self) -> None:
        self.budget.used -= self.held
        self.held = 0


async def read(request: Request, limit: int, lease: Lease, idle_s: float) -> bytearray:
    """The whole body, at most `limit` bytes (HTTPError 413 as soon as it is passed), each
    piece awaited at most `idle_s` (408), counted in `lease` as it arrives (503 past the
    budget; a declared Content-Length is counted whole, before anything is read)."""
    declared = request.headers.get("content-length")
    size: int | None = None
    if declared is not None:
        if not declared.strip().isdigit():
            raise HTTPError(400, "BadRequest", f"Content-Length {declared!r} is not a number",
                            headers=CLOSE)
        size = int(declared)
        if size > limit:
            raise too_large(f"the body has {size:,} bytes")
        lease.grow(size)
    buf = bytearray()
    while True:
        try:
            msg = await asyncio.wait_for(request.receive(), idle_s)
        except asyncio.TimeoutError:
            raise HTTPError(408, "RequestTimeout", (
                f"no part of the body arrived for {idle_s:g}s after {len(buf):,} bytes "
                "(GPUFN_HTTP_READ_TIMEOUT)"), headers=CLOSE) from None
        if msg["type"] == "http.disconnect":
            raise HTTPError(400, "BadRequest", "the client left before its body ended",
                            headers=CLOSE)
        chunk = msg.get("body", b"")
        if len(buf) + len(chunk) > limit:
            raise too_large(f"the body passed {limit:,} bytes")
        if size is None:
            lease.grow(len(chunk))
        buf += chunk
        if not msg.get("more_body", False):
            return buf


def too_large(what: str) -> HTTPError:
    from gpufn.wire import config

    return HTTPError(413, "PayloadTooLarge", f"{what}; at most {config.max_payload():,} are "
                     "accepted (GPUFN_MAX_PAYLOAD)")


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (send null, or a string)")


def parse(raw: bytes | bytearray) -> Any:
    """The body as JSON (an empty one is `{}`); 400 if it is not JSON, holds NaN or an
    infinity, or is nested too deeply to parse."""
    if not raw.strip():
        return {}
    try:
        return json.loads(raw, parse_constant=_constant)
    except RecursionError:
        raise bad_request("the body is nested too deeply (a few hundred levels at most)") from None
    except ValueError as e:
        raise bad_request(f"the body is not JSON: {e}") from None


class ReleaseLeases:
    """ASGI wrapper: whatever a request still holds of the body budget is given back
    when it ends (a route that read a body and never said it was done, an error)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            lease = (scope.get("state") or {}).get("lease")
            if isinstance(lease, Lease):
                lease.release()
