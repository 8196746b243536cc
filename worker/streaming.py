"""Runs what a plain call cannot: generators (their values streamed as `Item`s under a
credit window), coroutines and async generators (on the worker's one event loop).

A generator's values wait in the `ItemOutbox` for the main loop's next send, which takes
all those a call yielded since the last one as one `Item`: a burst costs a message per
send, not per value, and the first value after a send wakes the main loop at once.

The executor thread of the call drives it: it steps a generator itself, and waits on
the event loop for each step of a coroutine or async generator, so k calls with
concurrency=k interleave on the one loop while each keeps its own executor thread.
A cancel sets the call's flow cancelled: a step waiting for credit stops at once, and
the loop's task is cancelled (the user's `finally` blocks run either way).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from gpufn.exceptions import Cancelled
from gpufn.runtime import context as ctxmod
from gpufn.runtime import models as runtime_models
from gpufn.wire import config, jsonwire
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.worker.output import set_current_async

_DRIVEN = frozenset((types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType))


def needs_driving(value: Any) -> bool:
    """The function returned something to run or iterate, not a value (a generator, a
    coroutine or an async generator: types that cannot be subclassed)."""
    return type(value) in _DRIVEN


def is_special(fn: Any) -> bool:
    """Generator and async functions never run inline on the worker's main thread."""
    f = getattr(fn, "__wrapped__", fn)
    return (inspect.isgeneratorfunction(f) or inspect.iscoroutinefunction(f)
            or inspect.isasyncgenfunction(f))


class _Flow:
    """One driven call: its credit window and how to stop it."""

    def __init__(self, dispatch_token: int) -> None:
        self.dispatch_token = dispatch_token
        self.allowed = p.STREAM_WINDOW
        self.cancelled = False
        self.step: concurrent.futures.Future[Any] | None = None  # the loop step it waits on
        self.is_async = False
        self.cond = threading.Condition()
        # The sizes of the values sent and not read yet (from value `read` on). Each count
        # has one writer: the producer `sent_bytes`, `grant` (the control thread) the rest.
        self.unread: deque[int] = deque()
        self.sent_bytes = 0
        self.read_bytes = 0
        self.read = 0  # the consumer read this many (it grants what it read + the window)

    def grant(self, allowed: int) -> None:
        with self.cond:
            if allowed > self.allowed:
                self.allowed = allowed
                read = allowed - p.STREAM_WINDOW
                while self.read < read and self.unread:
                    self.read_bytes += self.unread.popleft()
                    self.read += 1
                self.cond.notify_all()

    def sent(self, nbytes: int) -> None:
        """The producer sent a value of `nbytes` (its thread only)."""
        self.unread.append(nbytes)
        self.sent_bytes += nbytes

    def _over_bytes(self) -> bool:
        """The values unread hold STREAM_BYTES or more (one may always be in flight)."""
        return self.sent_bytes - self.read_bytes >= p.STREAM_BYTES and bool(self.unread)

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            step = self.step
            self.cond.notify_all()
        if step is not None:
            step.cancel()  # cancels the task on the loop (thread-safe)

    def wait_credit(self, seq: int) -> None:
        """Block until item `seq` may be sent (the consumer read enough), or cancelled."""
        if not self.cancelled and seq < self.allowed and not self._over_bytes():
            return  # room already (read without the lock: each grant only adds room)
        with self.cond:
            while not self.cancelled and seq >= self.allowed:
                self.cond.wait(0.5)
            while not self.cancelled and self._over_bytes():
                self.cond.wait(0.5)  # big values: a few in flight, not a window of them
            if self.cancelled:
                raise Cancelled("the stream was closed by its consumer")


class EventLoop:
    """The worker's event loop, on its own thread, started on first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="gpufn-event-loop",
                                 daemon=True).start()
                self._loop = loop
            return self._loop


PACK_MAX = 64 * 1024  # a one-frame value under this joins its call's burst (one frame)
ITEM_BYTES = 1 << 20  # and a burst stops growing at this size


class _Batch:
    """Values of one call waiting for the main loop, consecutive from `seq`: a burst of
    small one-frame values (packed into one frame when sent), or a single value."""

    __slots__ = ("dispatch_token", "frames", "invocation_id", "nbytes", "seq", "sizes")

    def __init__(self, invocation_id: str, dispatch_token: int, seq: int) -> None:
        self.invocation_id = invocation_id
        self.dispatch_token = dispatch_token
        self.seq = seq
        self.sizes: list[int] = []  # of the packed values
        self.frames: list[Any] = []
        self.nbytes = 0

    def item(self) -> p.Item:
        if len(self.sizes) < 2:  # a value alone goes as it is
            return p.Item(self.invocation_id, self.dispatch_token, self.seq, [],
                          tuple(self.frames))
        return p.Item(self.invocation_id, self.dispatch_token, self.seq, self.sizes,
                      (b"".join(self.frames),))


class ItemOutbox:
    """Values yielded by the calls' threads, taken by the main loop as few `Item`s, in
    order per call. `ready` is called once when the outbox fills after a full `drain`
    (the main loop then sends whatever has come by then, never waiting to fill a batch)."""

    def __init__(self, ready: Callable[[], None]) -> None:
        self._ready = ready
        self._lock = threading.Lock()
        self._batches: list[_Batch] = []  # in the order they were opened
        self._open: dict[tuple[str, int], _Batch] = {}  # the burst a call's next value joins
        self._told = False  # `ready` was called and no full drain followed yet

    def add(self, invocation_id: str, dispatch_token: int, seq: int,
            frames: Sequence[Any], nbytes: int) -> None:
        key = (invocation_id, dispatch_token)
        packs = len(frames) == 1 and nbytes < PACK_MAX
        with self._lock:
            b = self._open.get(key) if packs else None
            if b is None or b.nbytes + nbytes > ITEM_BYTES:
                b = _Batch(invocation_id, dispatch_token, seq)
                self._batches.append(b)
                if packs:
                    self._open[key] = b
                else:  # a big or many-frame value goes alone; the next small one starts anew
                    self._open.pop(key, None)
            if packs:
                b.sizes.append(nbytes)
            b.frames.extend(frames)
            b.nbytes += nbytes
            tell, self._told = not self._told, True
        if tell:
            self._ready()

    def drain(self, invocation_id: str | None = None) -> list[p.Item]:
        """The Items waiting (of one call, or of all), oldest first."""
        if not self._batches and not (invocation_id is None and self._told):
            return []  # nothing (a value being added now calls `ready` after): no lock
        with self._lock:
            if invocation_id is None:
                self._told = False  # the next value tells again
                if not self._batches:
                    return []
                batches, self._batches = self._batches, []
                self._open.clear()
            else:  # before that call's Result; the others go at the next full drain
                batches = [b for b in self._batches if b.invocation_id == invocation_id]
                if not batches:
                    return []
                self._batches = [b for b in self._batches if b.invocation_id != invocation_id]
                for b in batches:
                    self._open.pop((b.invocation_id, b.dispatch_token), None)
        return [b.item() for b in batches]


class Driver:
    """Drives generator and async calls for the executor; thread-safe. With `ready`, a
    stream's values wait in `items` for the caller (the worker's main loop) to drain;
    without, each is sent at once as its own Item."""

    def __init__(self, send: Callable[[p.Message], None],
                 ready: Callable[[], None] | None = None) -> None:
        self.send = send
        self.items = ItemOutbox(ready if ready is not None else self._send_now)
        self.events = EventLoop()
        self._flows: dict[str, _Flow] = {}
        self._lock = threading.Lock()

    def grant(self, invocation_id: str, dispatch_token: int, allowed: int) -> None:
        with self._lock:
            flow = self._flows.get(invocation_id)
        if flow is not None and dispatch_token in (0, flow.dispatch_token):
            flow.grant(allowed)

    def _send_now(self) -> None:
        for item in self.items.drain():
            self.send(item)

    def is_async(self, invocation_id: str) -> bool:
        with self._lock:
            flow = self._flows.get(invocation_id)
        return flow is not None and flow.is_async

    def interrupt(self, invocation_id: str, dispatch_token: int = 0) -> bool:
        """Stop a driven call; True if it was one (then no async exception is needed)."""
        with self._lock:
            flow = self._flows.get(invocation_id)
        if flow is None or (dispatch_token and dispatch_token != flow.dispatch_token):
            return False
        flow.cancel()
        return True

    def drive(self, call: Any, value: Any) -> Any:
        """Run `value` (what the call's function returned) to its end, in this thread."""
        flow = _Flow(call.dispatch_token)
        flow.is_async = not inspect.isgenerator(value)
        with self._lock:
            self._flows[call.invocation_id] = flow
        try:
            if inspect.iscoroutine(value):
                return self._await(call, flow, value)
            if inspect.isasyncgen(value):
                agen = value

                def step() -> tuple[bool, Any]:
                    try:
                        return True, self._await(call, flow, agen.__anext__())
                    except StopAsyncIteration:
                        return False, None

                def close() -> None:
                    self._await(call, None, agen.aclose())

                self._stream(call, flow, step, close)
                return None
            gen = value

            def sync_step() -> tuple[bool, Any]:
                try:
                    return True, next(gen)
                except StopIteration:
                    return False, None

            self._stream(call, flow, sync_step, gen.close)
            return None
        finally:
            with self._lock:
                self._flows.pop(call.invocation_id, None)

    def _stream(self, call: Any, flow: _Flow, step: Callable[[], tuple[bool, Any]],
                close: Callable[[], None]) -> None:
        """Step the generator, sending rank 0's values as Items under the credit window;
        other ranks of a gang step in lockstep and send nothing."""
        sends = call.context.rank == 0
        what, limit = f"a value yielded by {call.name}", config.max_payload()
        t0 = time.perf_counter()
        n, first = 0, None
        try:
            while True:
                if sends:
                    flow.wait_credit(n)
                elif flow.cancelled:
                    raise Cancelled("the stream was closed by its consumer")
                more, value = step()
                if not more:
                    break
                if first is None:
                    first = time.perf_counter() - t0
                if sends:
                    frames = jsonwire.dump_value(value, what) if call.json else ser.dumps(value)
                    nbytes = ser.payload_bytes(frames)
                    if nbytes > limit:
                        ser.check_payload(frames, what)  # raises PayloadTooLarge
                    flow.sent(nbytes)
                    self.items.add(call.invocation_id, call.dispatch_token, n, frames, nbytes)
                n += 1
        finally:
            try:
                close()  # runs the generator's finally blocks when it stopped early
            except BaseException:
                pass
            took = time.perf_counter() - t0
            call.meta["items"] = n
            call.meta["first_item_s"] = first
            call.meta["items_per_s"] = n / took if took > 0 and n else None

    def _await(self, call: Any, flow: _Flow | None, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the event loop and wait for it in this thread."""
        if flow is not None and flow.cancelled:
            coro.close()
            raise Cancelled("cancelled")
        ctx, inv = call.context, call.invocation_id

        models = call.models

        async def in_context() -> Any:
            ctxmod._set_async(ctx)  # this task's copy of the context only
            set_current_async(inv)
            if models:  # Model.get() inside the coroutine
                runtime_models.set_async_call_models(models)
            return await coro

        fut = asyncio.run_coroutine_threadsafe(in_context(), self.events.loop())
        if flow is not None:
            with flow.cond:
                flow.step = fut
                cancelled = flow.cancelled
            if cancelled:
                fut.cancel()
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise Cancelled(f"{call.name} call {inv} was cancelled") from None
        finally:
            if flow is not None:
                with flow.cond:
                    flow.step = None
