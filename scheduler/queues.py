"""Ready queues: one heap per function, ordered by effective priority with aging.

A call's effective priority is `priority + wait / aging_seconds`, so a waiting
low-priority call climbs one level every `aging_seconds` and cannot starve. Because
every call ages at the same rate, the order between two calls never changes with
time: the key `submitted / aging_seconds - priority` is fixed at push, and a heap works.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpufn.scheduler.records import Invocation
from gpufn.scheduler.states import InvState


def queue_key(priority: int, submitted: float, aging_seconds: float) -> float:
    aging = submitted / aging_seconds if math.isfinite(aging_seconds) and aging_seconds > 0 else 0.0
    return aging - priority


@dataclass(slots=True)
class _FunctionQueue:
    heap: list[tuple[float, int, Invocation]] = field(default_factory=list)
    live: int = 0

    def head(self) -> Invocation | None:
        h = self.heap
        while h and h[0][2].state is not InvState.QUEUED:
            heapq.heappop(h)
        return h[0][2] if h else None


class ReadyQueue:
    """Queued invocations of every function; removal is lazy (state leaves QUEUED)."""

    def __init__(self, aging_seconds: float = 30.0) -> None:
        self.aging_seconds = aging_seconds
        self._by_fn: dict[str, _FunctionQueue] = {}
        self._len = 0
        self._later: list[tuple[float, int, Invocation]] = []  # (not_before, seq, call)

    def __len__(self) -> int:
        return self._len

    def depth(self, function_id: str) -> int:
        q = self._by_fn.get(function_id)
        return q.live if q else 0

    def key(self, inv: Invocation) -> float:
        return queue_key(inv.spec.priority, inv.submitted, self.aging_seconds)

    def push(self, inv: Invocation, now: float | None = None) -> None:
        """Queue a call; with `now` given and `inv.not_before` later, it waits until then."""
        q = self._by_fn.get(inv.function.function_id)
        if q is None:
            q = self._by_fn[inv.function.function_id] = _FunctionQueue()
        if now is not None and inv.not_before > now:
            heapq.heappush(self._later, (inv.not_before, inv.seq, inv))
        else:
            heapq.heappush(q.heap, (self.key(inv), inv.seq, inv))
        q.live += 1
        self._len += 1

    def release(self, now: float) -> float | None:
        """Make the calls whose backoff ended eligible; return when the next one ends."""
        later = self._later
        while later and later[0][0] <= now:
            _, _, inv = heapq.heappop(later)
            q = self._by_fn.get(inv.function.function_id)
            if inv.state is InvState.QUEUED and q is not None:  # else: cancelled meanwhile
                heapq.heappush(q.heap, (self.key(inv), inv.seq, inv))
        while later and later[0][2].state is not InvState.QUEUED:
            heapq.heappop(later)
        return later[0][0] if later else None

    def discard(self, inv: Invocation) -> None:
        """Account for an invocation that left QUEUED without being popped (cancel, expiry)."""
        q = self._by_fn[inv.function.function_id]
        q.live -= 1
        self._len -= 1
        if q.live == 0:
            del self._by_fn[inv.function.function_id]

    def head(self, function_id: str) -> Invocation | None:
        q = self._by_fn.get(function_id)
        return q.head() if q else None

    def pop(self, function_id: str) -> Invocation:
        q = self._by_fn[function_id]
        inv = q.head()
        assert inv is not None
        heapq.heappop(q.heap)
        q.live -= 1
        self._len -= 1
        if q.live == 0:
            del self._by_fn[function_id]
        return inv

    def heads(self) -> list[tuple[float, int, str]]:
        """(key, seq, function id) of each function's first call, best first."""
        out = []
        for fid, q in self._by_fn.items():
            inv = q.head()
            if inv is not None:
                out.append((self.key(inv), inv.seq, fid))
        out.sort()
        return out

    def functions(self) -> list[str]:
        return list(self._by_fn)

    def __iter__(self) -> Iterator[Invocation]:
        for q in self._by_fn.values():
            for _, _, inv in q.heap:
                if inv.state is InvState.QUEUED:
                    yield inv
        for _, _, inv in self._later:
            if inv.state is InvState.QUEUED:
                yield inv
