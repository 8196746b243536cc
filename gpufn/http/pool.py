"""One scheduler connection per distinct Bearer token: made on the token's first request
(the scheduler checks the token in its handshake, so a wrong one is refused there and
nothing runs), shared by that token's requests, closed once idle with no call in flight."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gpufn.client.client import Client
from gpufn.exceptions import AuthenticationError, ConnectionLost, GpufnError
from gpufn.http.errors import HTTPError
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.http")

REAP_EVERY = 5.0


async def ask(client: Client, make: Callable[[int], p.Message], timeout: float = 30.0) -> Any:
    """A request's reply data, awaited without blocking the event loop (a refusal's gpufn
    error is raised: NotFound, AppStopped, ...)."""
    rid, fut = client.request(make)
    try:
        reply = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
    except asyncio.TimeoutError:
        raise ConnectionLost(f"the scheduler at {client.address} did not answer within "
                             f"{timeout:.0f}s") from None
    finally:
        client.forget(rid)
    return reply


@dataclass
class Entry:
    """A token's connection and what the gateway keeps for it."""

    client: Client
    owner: str  # whose calls these are: the user the scheduler names, else the token's digest
    admin: bool = False  # the cluster's (admin) token: it sees every user's errors
    last_used: float = field(default_factory=time.monotonic)
    inflight: int = 0  # requests and spawned calls not finished
    cache: dict[Any, Any] = field(default_factory=dict)  # the directory's, per token

    def hold(self) -> None:
        self.inflight += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.inflight -= 1
        self.last_used = time.monotonic()


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


class ClientPool:
    def __init__(self, address: str, idle_s: float, connect_timeout: float = 15.0,
                 make_client: Callable[[str, str, float], Client] | None = None) -> None:
        self.address = address
        self.idle_s = idle_s
        self.connect_timeout = connect_timeout
        self._make = make_client or (lambda a, t, s: Client(a, t, connect_timeout=s))
        self._entries: dict[str, Entry] = {}
        self._connecting: dict[str, asyncio.Future[Entry]] = {}
        self._reaper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    async def entry(self, token: str) -> Entry:
        """The token's connection (made now if it has none): HTTPError 401 if refused."""
        e = self._entries.get(token)
        if e is not None and not e.client.closed:
            e.last_used = time.monotonic()
            return e
        pending = self._connecting.get(token)
        if pending is None:
            pending = self._connecting[token] = asyncio.ensure_future(self._connect(token))
            pending.add_done_callback(lambda _: self._connecting.pop(token, None))
        return await asyncio.shield(pending)

    async def _connect(self, token: str) -> Entry:
        try:
            client = await asyncio.to_thread(self._make, self.address, token, self.connect_timeout)
        except AuthenticationError:
            raise HTTPError(401, "AuthenticationError", "the scheduler refused this token: send "
                            "the cluster's token as 'Authorization: Bearer TOKEN'") from None
        except GpufnError as e:
            raise HTTPError(503, type(e).__name__, f"the scheduler at {self.address} cannot be "
                            f"reached: {e}") from None
        user = getattr(client.info, "user", None)  # once the scheduler names its users
        entry = Entry(client, str(user) if user else digest(token),
                      bool(getattr(client.info, "admin", False)))
        old = self._entries.pop(token, None)
        self._entries[token] = entry
        if old is not None:
            await asyncio.to_thread(old.client.close)
        return entry

    def start(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap_loop())

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(min(REAP_EVERY, self.idle_s))
            try:
                await self.reap()
            except Exception:  # the reaper must outlive a failing close
                log.exception("closing idle scheduler connections failed")

    async def reap(self, now: float | None = None) -> int:
        """Close the connections idle for `idle_s` with nothing in flight; how many."""
        now = time.monotonic() if now is None else now
        idle = [t for t, e in self._entries.items()
                if e.inflight <= 0 and now - e.last_used >= self.idle_s]
        for t in idle:
            e = self._entries.pop(t)
            await asyncio.to_thread(e.client.close)
        return len(idle)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        entries, self._entries = list(self._entries.values()), {}
        for e in entries:
            await asyncio.to_thread(e.client.close)


async def guarded(entry: Entry, work: Callable[[], Awaitable[Any]]) -> Any:
    """Run `work` with the entry held (its connection is not closed meanwhile)."""
    entry.hold()
    try:
        return await work()
    finally:
        entry.release()
