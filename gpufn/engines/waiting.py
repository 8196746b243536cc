"""Requests waiting for a slot: highest priority first, first come first within a
priority (a preempted request keeps its place from when it first arrived)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    key: tuple[int, int]
    request_id: str = field(compare=False)
    item: T = field(compare=False)


class WaitingQueue(Generic[T]):
    """A priority queue of items by request id; removal by id is O(1) (lazy deletion)."""

    def __init__(self) -> None:
        self._heap: list[_Entry[T]] = []
        self._live: dict[str, _Entry[T]] = {}
        self._counter = itertools.count()

    def next_order(self) -> int:
        """An arrival number: pass it back to `push` to keep a request's place."""
        return next(self._counter)

    def push(self, request_id: str, item: T, priority: int, order: int | None = None) -> None:
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already waiting")
        entry = _Entry((-priority, self.next_order() if order is None else order), request_id, item)
        self._live[request_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, request_id: str) -> T | None:
        entry = self._live.pop(request_id, None)
        return None if entry is None else entry.item

    def peek(self) -> T | None:
        self._drop_dead()
        return self._heap[0].item if self._heap else None

    def pop(self) -> T | None:
        self._drop_dead()
        if not self._heap:
            return None
        entry = heapq.heappop(self._heap)
        del self._live[entry.request_id]
        return entry.item

    def _drop_dead(self) -> None:
        while self._heap and self._live.get(self._heap[0].request_id) is not self._heap[0]:
            heapq.heappop(self._heap)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[T]:
        """Items in join order."""
        return (e.item for e in sorted(self._live.values()))
