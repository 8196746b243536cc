"""The values of one streamed call as they arrive: the client's I/O thread puts each `Item`
into the call's `ItemQueue` and ends it when the Result arrives; the reader takes them."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from gpufn.wire import protocol as p


class ItemQueue:
    """Items of one call, filled by the client's I/O thread, read by the consumer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[p.Item] = deque()
        self._ended = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.received = 0  # items put so far (a stream cannot resume after a restart)

    def put(self, item: p.Item) -> None:
        with self._cond:
            self._items.append(item)
            self.received += 1
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


def make_queue(future: Future[p.Result]) -> ItemQueue:
    q = ItemQueue()
    future.add_done_callback(q.end)
    return q
