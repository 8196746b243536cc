"""JSON calls through a token's connection: one call answered when done (cancelled if the
HTTP client leaves first), a generator's values as they come under the stream's credit
window (closing cancels the remote generator), and spawned calls kept for their caller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.types import Receive

from gpufn.exceptions import ConnectionLost, GpufnError, kind_of
from gpufn.http.directory import Target
from gpufn.http.errors import HTTPError, from_result
from gpufn.http.events import wait_disconnect
from gpufn.http.pool import Entry
from gpufn.wire import jsonwire
from gpufn.wire import protocol as p

T = TypeVar("T")

CREDIT_EVERY = max(1, p.STREAM_WINDOW // 4)
KEEP_CALLS = 4096  # finished spawned calls kept for GET /v1/calls/{id}
KEEP_BYTES = 256 * 2**20
# How the scheduler answers an Attach of a call it does not know (or another user's):
# scheduler/streams.py, StreamDesk._on_attach (a plain GpufnError kind, so matched here).
UNKNOWN_CALL = "the scheduler knows no call"


class ClientGone(Exception):
    """The HTTP client disconnected before the answer (the call was cancelled)."""


def submit(entry: Entry, target: Target, args: list[Any], kwargs: dict[str, Any],
           options: dict[str, Any], keep: bool = False) -> p.Submit:
    """The Submit of a JSON call; `keep` for a spawned one (its Result kept, and it
    outlives its connection: see `FunctionCall.from_id`)."""
    frames = jsonwire.dump_call(args, kwargs)
    return p.Submit(entry.client.new_id(), target.function_id(), options, keep,
                    frames=tuple(frames))


async def call(entry: Entry, sub: p.Submit, name: str, receive: Receive | None) -> p.Result:
    """Run one call and wait for its Result; if the client disconnects first, cancel it
    (its worker stops it) and raise ClientGone."""
    # Shielded: cancelling a wrapper would cancel the client's own future under its I/O thread.
    fut = asyncio.wrap_future(entry.client.submit(sub, name))
    if receive is None:
        return await asyncio.shield(fut)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    both: set[asyncio.Future[Any]] = {fut, gone}
    try:
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gone.done():
            gone.cancel()
    if not fut.done():
        entry.client.cancel(sub.invocation_id, "the HTTP client disconnected")
        raise ClientGone()
    return fut.result()


async def until_gone(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    both: set[asyncio.Future[Any]] = {task, gone}
    try:
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


def answer(res: p.Result) -> bytes:
    """`{"result": ..., "call_id": ...}` for a finished call, the value spliced in as the
    worker wrote it; HTTPError for a failed one."""
    return b'{"result":' + value(res) + b',"call_id":"' + res.invocation_id.encode() + b'"}'


def value(res: p.Result) -> bytes:
    """A finished call's value as JSON text; HTTPError if it failed."""
    if not res.ok:
        raise from_result(res)
    counts = res.meta.gather
    try:
        if counts is None:
            return jsonwire.value_text(res.frames)
        parts, i = [], 0  # gather=True: every rank's value, in rank order
        for n in counts:
            parts.append(jsonwire.value_text(res.frames[i:i + n]))
            i += n
        return b"[" + b",".join(parts) + b"]"
    except Exception as e:  # never unpickled: a non-JSON payload is refused
        raise HTTPError(500, "SerializationError", f"the call's value is not JSON: {e}") from None


class Stream:
    """A generator call's values as JSON texts, in order; iterate once. Leaving early
    (`aclose`, a cancelled task) cancels the remote generator."""

    def __init__(self, entry: Entry, sub: p.Submit, name: str) -> None:
        self.entry = entry
        self.id = sub.invocation_id
        self.fut, self.items = entry.client.submit_stream(sub, name)
        self.read = 0
        self.result: p.Result | None = None

    async def values(self) -> AsyncGenerator[bytes, None]:
        credited = 0
        try:
            while True:
                item = await self.items.take_aio()
                if item is None:
                    break
                seq, frames = item
                if seq != self.read:
                    raise HTTPError(500, "GpufnError", f"value {seq} of call {self.id} "
                                    f"arrived where value {self.read} was expected")
                self.read += 1
                if self.read - credited >= CREDIT_EVERY:
                    credited = self.read
                    self.entry.client.credit(self.id, self.read + p.STREAM_WINDOW)
                yield jsonwire.value_text(frames)
            exc = self.fut.exception()  # the items end with the call's future
            self.result = self.fut.result() if exc is None else p.Result(
                self.id, False, kind_of(exc) if isinstance(exc, GpufnError) else "GpufnError",
                str(exc))
        finally:
            if self.result is None:
                self.entry.client.cancel(self.id, "the HTTP client closed the stream")

    def error(self) -> HTTPError | None:
        """Once the values are read: the call's error, or None if it ended well."""
        assert self.result is not None
        return None if self.result.ok else from_result(self.result)


# --------------------------------------------------------------------------- spawned calls


@dataclass
class Spawned:
    call_id: str
    owner: str
    name: str
    future: Future[p.Result]
    entry: Entry  # the connection it was made (or found) on
    created: float = field(default_factory=time.time)
    nbytes: int = 0  # its Result's payload, counted in its book once it ended

    def lost(self) -> bool:
        """Its connection closed before its answer (not an answer about the call)."""
        return self.future.done() and isinstance(self.future.exception(), ConnectionLost)

    def unknown(self) -> bool:
        """The scheduler answered an attach: it knows no such call of this caller."""
        if not self.future.done() or self.future.exception() is not None:
            return False
        res = self.future.result()
        return (not res.ok and res.error_kind == kind_of(GpufnError())
                and UNKNOWN_CALL in res.message)

    def view(self, running: bool | None = None) -> tuple[int, bytes]:
        """(HTTP status, body) of GET /v1/calls/{id}."""
        head = {"call_id": self.call_id, "function": self.name, "created": self.created}
        if not self.future.done():
            state = "queued" if running is False else "running" if running else "pending"
            return 200, json.dumps({**head, "state": state}).encode()
        res = self.future.result() if self.future.exception() is None else None
        if res is None:
            err = self.future.exception()
            return 200, json.dumps({**head, "state": "failed", "error": {
                "type": type(err).__name__, "message": str(err)}}).encode()
        if res.ok:
            body = json.dumps({**head, "state": "done"}).encode()
            try:
                return 200, body[:-1] + b',"result":' + value(res) + b"}"
            except HTTPError as e:
                return 200, body[:-1] + b',"error":' + e.body_inner() + b"}"
        err = from_result(res)
        state = "cancelled" if res.error_kind == "Cancelled" else "failed"
        return 200, json.dumps({**head, "state": state}).encode()[:-1] + (
            b',"error":' + err.body_inner() + b"}")


class SpawnBook:
    """Spawned calls by id: pending ones, and the last finished ones (bounded)."""

    def __init__(self) -> None:
        self.calls: OrderedDict[str, Spawned] = OrderedDict()
        self.finished_bytes = 0

    def add(self, spawned: Spawned, loop: asyncio.AbstractEventLoop) -> None:
        self.calls[spawned.call_id] = spawned
        entry = spawned.entry
        entry.hold()  # its connection stays open while the call is out

        def done(_: Any) -> None:
            loop.call_soon_threadsafe(self._finished, spawned, entry)

        spawned.future.add_done_callback(done)

    def _finished(self, spawned: Spawned, entry: Entry) -> None:
        entry.release()
        if self.calls.get(spawned.call_id) is spawned:
            with contextlib.suppress(Exception):
                spawned.nbytes = sum(len(f) for f in spawned.future.result().frames)
            self.finished_bytes += spawned.nbytes
        self._trim()

    def _trim(self) -> None:
        done = [k for k, s in self.calls.items() if s.future.done()]
        while done and (len(done) > KEEP_CALLS or self.finished_bytes > KEEP_BYTES):
            old = self.calls.pop(done.pop(0))
            self.finished_bytes -= old.nbytes

    def find(self, call_id: str, owner: str) -> Spawned | None:
        """The caller's own call if this book has it (None if not); 403 if it is another
        caller's."""
        s = self.calls.get(call_id)
        if s is not None and s.owner != owner:
            raise HTTPError(403, "Forbidden", f"call {call_id} belongs to another caller")
        return s

    def forget(self, call_id: str) -> None:
        s = self.calls.pop(call_id, None)
        if s is not None:
            self.finished_bytes -= s.nbytes
