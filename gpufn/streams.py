"""The caller's end of a streamed call: `for v in f.remote_gen(...)`, `async for v in
f.remote_gen.aio(...)`, `f.spawn(...).stream()`.

The client's I/O thread puts each `Item` into the call's `ItemQueue` and ends it when the
Result arrives (always after the last item). The consumer unpickles values as it takes
them and grants the producer more room (`Credit`) every few items, so at most
`STREAM_WINDOW` values are in flight or waiting here: a slow consumer slows the producer.
Closing the stream early (break, `close()`, garbage collection) cancels the call.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gpufn import protocol as p
from gpufn import serialization as ser
from gpufn.exceptions import GpufnError

if TYPE_CHECKING:
    from gpufn.function import FunctionCall

T = TypeVar("T")

CREDIT_EVERY = max(1, p.STREAM_WINDOW // 4)  # items read between two Credits


class ItemQueue:
    """Items of one call, filled by the client's I/O thread, read by the consumer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[p.Item] = deque()
        self._ended = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def put(self, item: p.Item) -> None:
        with self._cond:
            self._items.append(item)
            self._wake()

    def end(self, _fut: Any = None) -> None:
        with self._cond:
            self._ended = True
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    def __len__(self) -> int:
        return len(self._items)

    def take(self) -> p.Item | None:
        """The next item, or None once the call ended and every item was taken."""
        with self._cond:
            while not self._items and not self._ended:
                self._cond.wait(0.5)
            return self._items.popleft() if self._items else None

    async def take_aio(self) -> p.Item | None:
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                if self._ended:
                    return None
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            await fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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

    def _value(self, item: p.Item | None) -> T:
        if item is None:
            self._finished = True
            self._call._get_end()  # raises the call's error (a mid-stream exception)
            raise StopIteration
        if item.seq != self._read:
            self.close()
            raise GpufnError(f"{self._call._name} call {self._call.id}: value {item.seq} arrived "
                             f"where value {self._read} was expected")
        self._read += 1
        if self._read - self._credited >= CREDIT_EVERY:
            self._credited = self._read
            self._call._client.credit(self._call.id, self._read + p.STREAM_WINDOW)
        value: T = ser.loads(item.frames)
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


def make_queue(future: Future[p.Result]) -> ItemQueue:
    q = ItemQueue()
    future.add_done_callback(q.end)
    return q
