"""The values of one streamed call as they arrive: the client's I/O thread puts each `Item`
into the call's `ItemQueue` and ends it when the Result arrives; the reader takes them one
value at a time (an Item of several values is split by the reader, not the I/O thread)."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from gpufn.exceptions import GpufnError
from gpufn.wire import protocol as p

Value = tuple[int, tuple[Any, ...]]  # (seq, the value's frames)


def split(item: p.Item) -> list[Value]:
    """The values an Item holds, in order (a burst's are views of its one frame)."""
    if not item.sizes:
        return [(item.seq, item.frames)]
    frame = item.frames[0] if len(item.frames) == 1 else b""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    out, i = [], 0
    for k, n in enumerate(item.sizes):
        if type(n) is not int or n <= 0:
            break  # refused below
        out.append((item.seq + k, (buf[i:i + n],)))
        i += n
    if i != buf.nbytes or len(out) != len(item.sizes):
        raise GpufnError(f"call {item.invocation_id}: a malformed Item (value sizes "
                         f"{item.sizes[:8]}{'...' if len(item.sizes) > 8 else ''} for "
                         f"{len(item.frames)} frames of {buf.nbytes} bytes)")
    return out


class ItemQueue:
    """Values of one call, filled by the client's I/O thread, read by one consumer. The
    consumer splits each Item it takes and reads the rest of it without the lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[p.Item] = deque()
        self._values: deque[Value] = deque()  # the rest of the Item taken last (consumer's)
        self._ended = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.received = 0  # values put so far (a stream cannot resume after a restart)
        self.taken = 0  # values taken (the consumer's count; `received` is the I/O thread's)

    def put(self, item: p.Item) -> None:
        with self._cond:
            self._items.append(item)
            self.received += item.values()
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
        """Values here, not taken yet."""
        return self.received - self.taken

    def _first(self, item: p.Item) -> Value:
        """The first value of an Item just taken; the others wait in `_values`."""
        values = split(item)
        self._values.extend(values[1:])
        self.taken += 1
        return values[0]

    def take(self) -> Value | None:
        """The next value, or None once the call ended and every value was taken."""
        if self._values:
            self.taken += 1
            return self._values.popleft()
        with self._cond:
            while not self._items and not self._ended:
                self._cond.wait(0.5)
            if not self._items:
                return None
            item = self._items.popleft()
        return self._first(item)

    async def take_aio(self) -> Value | None:
        if self._values:
            self.taken += 1
            return self._values.popleft()
        while True:
            with self._cond:
                if self._items:
                    item = self._items.popleft()
                    break
                if self._ended:
                    return None
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            await fut
        return self._first(item)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def make_queue(future: Future[p.Result]) -> ItemQueue:
    q = ItemQueue()
    future.add_done_callback(q.end)
    return q
