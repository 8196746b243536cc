"""Handles on calls already made: `FunctionCall` (`.get()`, `.cancel()`, `.from_id()`,
`gpufn.gather`) and `CallStream`, the caller's end of a streamed call (`for v in
f.remote_gen(...)`, `async for v in f.remote_gen.aio(...)`, `f.spawn(...).stream()`).

The client's I/O thread puts each `Item` (one value, or a burst of them) into the call's
`ItemQueue` and ends it when the Result arrives (always after the last item). The consumer
unpickles values as it takes them and grants the producer more room (`Credit`) once it
read a burst (or half the window), so at most `STREAM_WINDOW` values are in flight or
waiting here: a slow consumer slows the producer.
Closing the stream early (break, `close()`, garbage collection) cancels the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Generic, TypeVar, overload

from gpufn.client.client import Client
from gpufn.client.default import get_client
from gpufn.client.items import ItemQueue, Value
from gpufn.exceptions import GpufnError, InvalidSpec, Timeout, from_wire
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser

T = TypeVar("T")
R = TypeVar("R")
R2 = TypeVar("R2")

CREDIT_EVERY = max(1, p.STREAM_WINDOW // 4)  # values read between two Credits, at least
CREDIT_MOST = max(CREDIT_EVERY, p.STREAM_WINDOW // 2)  # and at most


class CallStream(Generic[T]):
    """The values a generator call yields, in order; iterate it once (sync or async)."""

    def __init__(self, call: FunctionCall[Any], items: ItemQueue) -> None:
        self._call = call
        self._items = items
        self._read = 0
        self._credited = 0
        self._finished = False  # every value and the call's end were read
        self._closed = False

    @property
    def call(self) -> FunctionCall[Any]:
        return self._call

    def __repr__(self) -> str:
        return f"<CallStream of {self._call!r}, {self._read} read>"

    def _value(self, item: Value | None) -> T:
        if item is None:
            self._finished = True
            self._call._get_end()  # raises the call's error (a mid-stream exception)
            raise StopIteration
        seq, frames = item
        if seq != self._read:
            self.close()
            raise GpufnError(f"{self._call._name} call {self._call.id}: value {seq} arrived "
                             f"where value {self._read} was expected")
        self._read += 1
        unread = self._read - self._credited
        # Values come in bursts (one Item each): credit once the burst is read, or every
        # half window while more wait here, not every few values.
        if unread >= CREDIT_EVERY and (not self._items or unread >= CREDIT_MOST):
            self._credited = self._read
            self._call._client.credit(self._call.id, self._read + p.STREAM_WINDOW)
        value: T = ser.loads(frames)
        return value

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._finished or self._closed:
            raise StopIteration
        try:
            return self._value(self._items.take())
        except BaseException as e:
            if not isinstance(e, StopIteration):
                self.close()  # Ctrl-C while waiting, a bad value: stop the producer
            raise

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._items.take_aio()
        except BaseException:  # the awaiting task was cancelled
            self.close()
            raise
        try:
            return self._value(item)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Stop reading: the remote generator is cancelled (its finally blocks run)."""
        if not self._finished and not self._closed:
            self._closed = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> CallStream[T]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter exit: the client may be gone
            pass


# --------------------------------------------------------------------------- results


def decode_result(res: p.Result, name: str) -> Any:
    """The value of a finished call, or raise its error (user exceptions keep their type)."""
    if res.ok:
        counts = res.meta.gather
        if counts is not None:  # every rank's value, in rank order
            out, i = [], 0
            for n in counts:
                out.append(ser.loads(res.frames[i:i + n]))
                i += n
            return out
        return ser.loads(res.frames)
    if res.error_kind == "":
        where = f"remote traceback of {name} call {res.invocation_id} on {','.join(res.meta.devices) or 'a worker'}:"
        raise ser.load_exception(res.frames, res.meta.error_type or "Exception", res.message,
                                 res.meta.traceback, where)
    raise from_wire(res.error_kind, res.message)


def gather(*calls: FunctionCall[Any]) -> list[Any]:
    """The results of several spawned calls, in order. If one fails, the calls not done
    yet are cancelled and its error is raised."""
    out = []
    try:
        for call in calls:
            out.append(call.get())
    except BaseException:
        for call in calls:
            call.cancel()  # a finished call ignores it
        raise
    return out


class _Get(Generic[R]):
    """`call.get(timeout=None)`: wait for the result; `await call.get.aio()` awaits it."""

    __slots__ = ("_call",)

    def __init__(self, call: FunctionCall[R]) -> None:
        self._call = call

    def __call__(self, timeout: float | None = None) -> R:
        return self._call._get(timeout)

    def aio(self, timeout: float | None = None) -> Coroutine[Any, Any, R]:
        return self._call._get_aio(timeout)


class _GetAttr:
    @overload
    def __get__(self, obj: None, cls: Any = None) -> _GetAttr: ...
    @overload
    def __get__(self, obj: FunctionCall[R2], cls: Any = None) -> _Get[R2]: ...
    def __get__(self, obj: FunctionCall[Any] | None, cls: Any = None) -> Any:
        return self if obj is None else _Get(obj)


class FunctionCall(Generic[R]):
    """A handle on one spawned call."""

    def __init__(self, invocation_id: str, future: Future[p.Result], name: str, client: Client,
                 items: ItemQueue | None = None) -> None:
        self._id = invocation_id
        self._future = future
        self._name = name
        self._client = client
        self._items = items  # a generator call's values, read through .stream()
        self._stream: CallStream[Any] | None = None
        self._attached = False  # made elsewhere (from_id): a cancel waits for the answer
        self._shm_value: tuple[Any] | None = None  # a value read from shared memory, once

    @classmethod
    def from_id(cls, invocation_id: str) -> FunctionCall[Any]:
        """A handle on a call spawned elsewhere (another process, `call.id`) by the same
        user (the user whose token made it, or an admin; another user's id fails like an
        unknown one): `.get()` waits for its result. A spawned call of a deployed function
        (`gpufn.lookup(...).spawn()`) runs on when its spawner exits, and its result is kept
        on disk for a day (GPUFN_RESULT_RETENTION), across scheduler restarts; `.cancel()`
        here stops it once its spawner is gone. A spawned call of a function defined in
        the spawner's process is cancelled when the spawner exits; while it lives, and
        for the last 4,096 such calls after they ended, it is found too. Not for a
        generator's values, which only its spawner streams."""
        client = get_client()
        call: FunctionCall[Any] = cls(invocation_id, client.attach(invocation_id), "call", client)
        call._attached = True
        return call

    gather = staticmethod(gather)  # FunctionCall.gather(*calls), as in Modal: gpufn.gather

    def stream(self) -> CallStream[Any]:
        """The values of a spawned generator call, as they are produced (iterate once)."""
        if self._items is None:
            raise InvalidSpec(f"{self._name} is not a generator function: use .get()")
        if self._stream is None:
            self._stream = CallStream(self, self._items)
        return self._stream

    def _get_end(self) -> None:
        """Wait for the end of a generator call; raise its error if it failed."""
        decode_result(self._future.result(), self._name)

    @property
    def id(self) -> str:
        return self._id

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<FunctionCall {self._name} {self._id} {state}>"

    def _wait_check(self, timeout: float | None) -> None:
        if self._items is not None:
            raise InvalidSpec(f"{self._name} is a generator function: iterate call.stream()")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not timeout >= 0):
            raise InvalidSpec(f"get(timeout={timeout!r}): give seconds >= 0 (0: only look), "
                              "or None to wait for the result")

    def _get(self, timeout: float | None = None) -> R:
        self._wait_check(timeout)
        try:
            res = self._future.result(timeout)
        except FutureTimeout:
            raise Timeout(
                f"{self._name} call {self._id} has no result after {timeout}s; it is still "
                "queued or running. Call .get() again to keep waiting, or .cancel() it."
            ) from None
        return self._decoded(res)

    def _decoded(self, res: p.Result) -> R:
        """The value; one whose big parts came through shared memory is read once and the
        same value returned again (its files are gone, or reused, once read)."""
        if self._shm_value is not None:
            return self._shm_value[0]
        value = decode_result(res, self._name)
        if res.ok and res.meta.shm:
            self._shm_value = (value,)
        return value

    async def _get_aio(self, timeout: float | None = None) -> R:
        self._wait_check(timeout)
        try:
            # Shielded: an await that times out or is cancelled leaves the call's own
            # future alone (else asyncio cancels it too: a later get() raised
            # CancelledError, and cancel() took the call for finished and left it running).
            res = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future)),
                                         timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"{self._name} call {self._id} has no result after {timeout}s") from None
        return self._decoded(res)

    get = _GetAttr()

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel the call: removed at once if queued, stopped if running. Returns False
        if it had already finished; for a call from `from_id`, also if the scheduler
        refused (it ended, or it is another user's call), after asking it."""
        if self._future.done():
            return False
        if self._attached:
            return self._client.cancel_checked(self._id, "cancelled by the caller")
        self._client.cancel(self._id, "cancelled by the caller")  # our own: no round trip
        return True

    def result_meta(self) -> dict[str, Any]:
        """Scheduler metadata of a finished call (devices, attempts, queued_s, duration, ...)."""
        return self._future.result().meta.to_dict()
