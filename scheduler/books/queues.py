"""Ready queues: one heap per function, ordered by effective priority with aging.

A call's effective priority is `priority + wait / aging_seconds`, so a waiting
low-priority call climbs one level every `aging_seconds` and cannot starve. Because
every call ages at the same rate, the order between two calls never changes with
time: the key `submitted / aging_seconds - priority` is fixed at push, and a heap works.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpufn.scheduler.nouns.records import Invocation
from gpufn.scheduler.nouns.states import InvState


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
    """Queued invocations of every function; removal is lazy (state leaves QUEUED).

    Besides one heap per function, a heap of function heads (key, seq, function id) says
    which function goes first, so a placement pass visits only the functions it places
    or finds blocked, not every function with queued calls. Its entries go stale when a
    head leaves lazily; they are checked when they surface.
    """

    def __init__(self, aging_seconds: float = 30.0) -> None:
        self.aging_seconds = aging_seconds
        self._by_fn: dict[str, _FunctionQueue] = {}
        self._len = 0
        # Queued calls per (function id, priority): `gpufn status` and the metrics read it.
        self._by_priority: Counter[tuple[str, int]] = Counter()
        self._heads: list[tuple[float, int, str]] = []  # function heads, best first (lazy)
        self._later: list[tuple[float, int, Invocation]] = []  # (not_before, seq, call)
        # Calls set aside while their user is at their device cap (users.DeviceCaps),
        # best first per user: still queued and counted, but not a function's head, so
        # the calls of other users behind them are not blocked.
        self._held: dict[str, list[tuple[float, int, Invocation]]] = {}

    def __len__(self) -> int:
        return self._len

    def depth(self, function_id: str) -> int:
        q = self._by_fn.get(function_id)
        return q.live if q else 0

    def depth_by_priority(self) -> dict[tuple[str, int], int]:
        return {k: n for k, n in self._by_priority.items() if n > 0}

    def _count(self, inv: Invocation, n: int) -> None:
        key = (inv.function.function_id, inv.spec.priority)
        left = self._by_priority[key] + n
        if left:
            self._by_priority[key] = left
        else:
            del self._by_priority[key]

    def key(self, inv: Invocation) -> float:
        return queue_key(inv.spec.priority, inv.submitted, self.aging_seconds)

    def push(self, inv: Invocation, now: float | None = None) -> None:
        """Queue a call; with `now` given and `inv.not_before` later, it waits until then."""
        q = self._by_fn.get(inv.function.function_id)
        if q is None:
            q = self._by_fn[inv.function.function_id] = _FunctionQueue()
        entry: tuple[float, int, Invocation] | None = None
        if now is not None and inv.not_before > now:
            heapq.heappush(self._later, (inv.not_before, inv.seq, inv))
        else:
            entry = (self.key(inv), inv.seq, inv)
            heapq.heappush(q.heap, entry)
        q.live += 1
        self._len += 1
        self._count(inv, 1)
        if entry is not None and q.heap[0] is entry:  # a new head for its function
            self._note(entry[0], inv.seq, inv.function.function_id)

    def release(self, now: float) -> float | None:
        """Make the calls whose backoff ended eligible; return when the next one ends."""
        later = self._later
        while later and later[0][0] <= now:
            _, _, inv = heapq.heappop(later)
            q = self._by_fn.get(inv.function.function_id)
            if inv.state is InvState.QUEUED and q is not None:  # else: cancelled meanwhile
                entry = (self.key(inv), inv.seq, inv)
                heapq.heappush(q.heap, entry)
                if q.heap[0] is entry:  # a new head for its function
                    self._note(entry[0], inv.seq, inv.function.function_id)
        while later and later[0][2].state is not InvState.QUEUED:
            heapq.heappop(later)
        return later[0][0] if later else None

    def expedite(self, until: float, now: float) -> None:
        """Calls waiting until `until` (a restart's hold, ended early) may start now."""
        later = self._later
        if not any(t == until for t, _, _ in later):
            return
        for i, (t, seq, inv) in enumerate(later):
            if t == until:
                inv.not_before = now
                later[i] = (now, seq, inv)
        heapq.heapify(later)

    def discard(self, inv: Invocation) -> None:
        """Account for an invocation that left QUEUED without being popped (cancel, expiry)."""
        q = self._by_fn[inv.function.function_id]
        q.live -= 1
        self._len -= 1
        self._count(inv, -1)
        if q.live == 0:
            del self._by_fn[inv.function.function_id]

    def only_of(self, function_id: str, client: bytes) -> list[Invocation] | None:
        """The queued calls, if every one is of this function and this client (a lease
        may take them over: scheduler/desks/lease_desk.py); None if anything else waits."""
        if not self._len:
            return []
        q = self._by_fn.get(function_id)
        if q is None or q.live != self._len:
            return None
        mine = [e[2] for e in q.heap if e[2].state is InvState.QUEUED]
        if len(mine) != q.live or any(i.client != client for i in mine):
            return None
        return mine

    def hold(self, inv: Invocation) -> None:
        """Set the head `inv` aside until `unhold` (its user is at their device cap)."""
        fid = inv.function.function_id
        q = self._by_fn[fid]
        head = q.head()
        assert head is not None and head.seq == inv.seq, "only a function's head is held"
        heapq.heappop(q.heap)
        heapq.heappush(self._held.setdefault(inv.user, []), (self.key(inv), inv.seq, inv))
        nxt = q.head()
        if nxt is not None:
            self._note(self.key(nxt), nxt.seq, fid)

    def held_users(self) -> list[str]:
        """Users with calls set aside (some may have left the queue lazily)."""
        return list(self._held)

    def held(self, user: str) -> int:
        """How many of `user`'s calls are set aside."""
        return sum(1 for _, _, inv in self._held.get(user, ()) if inv.state is InvState.QUEUED)

    def unhold(self, user: str, room: float) -> int:
        """Put `user`'s set-aside calls back in their places, best first, while their
        devices fit in `room`; returns how many went back."""
        h = self._held.get(user)
        n = 0
        while h:
            inv = h[0][2]
            if inv.state is not InvState.QUEUED:
                heapq.heappop(h)
                continue
            if inv.spec.count > room:
                break
            heapq.heappop(h)
            room -= inv.spec.count
            q = self._by_fn[inv.function.function_id]  # it is still counted there
            entry = (self.key(inv), inv.seq, inv)
            heapq.heappush(q.heap, entry)
            if q.heap[0] is entry:
                self._note(entry[0], inv.seq, inv.function.function_id)
            n += 1
        if not h:
            self._held.pop(user, None)
        return n

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
        self._count(inv, -1)
        if q.live == 0:
            del self._by_fn[function_id]
        else:
            nxt = q.head()
            if nxt is not None:
                self._note(self.key(nxt), nxt.seq, function_id)
        return inv

    def _note(self, key: float, seq: int, function_id: str) -> None:
        heapq.heappush(self._heads, (key, seq, function_id))
        if len(self._heads) > 2 * len(self._by_fn) + 64:  # many stale entries: rebuild
            self._heads[:] = self.heads()  # in place: an ordered() may be iterating it

    def ordered(self) -> Iterator[str]:
        """Function ids, best head first, each head once. A function whose head the
        caller pops meanwhile comes again with its next head, in order; one whose head
        stays (blocked) does not come again in this iteration. O(log F) per function
        visited, not O(F) per pass."""
        visited: list[tuple[float, int, str]] = []
        seen: set[tuple[str, int]] = set()
        heads = self._heads
        try:
            while heads:
                entry = heapq.heappop(heads)
                _, seq, fid = entry
                q = self._by_fn.get(fid)
                inv = q.head() if q else None
                if inv is None:
                    continue  # the function has nothing queued any more
                if inv.seq != seq:  # stale: its head left lazily; the real head goes in
                    if (fid, inv.seq) not in seen:
                        heapq.heappush(heads, (self.key(inv), inv.seq, fid))
                    continue
                if (fid, seq) in seen:
                    continue  # a duplicate entry of a head already visited
                seen.add((fid, seq))
                visited.append(entry)
                yield fid
        finally:
            for entry in visited:  # heads left in place (blocked) keep their entry
                q = self._by_fn.get(entry[2])
                inv = q.head() if q else None
                if inv is not None and inv.seq == entry[1]:
                    heapq.heappush(heads, entry)

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
        for held in self._held.values():
            for _, _, inv in held:
                if inv.state is InvState.QUEUED:
                    yield inv
