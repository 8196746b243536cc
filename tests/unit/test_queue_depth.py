"""The scheduler's per-call costs do not grow with the queue: the head-of-function heap
(`ReadyQueue.ordered`) and a placement pass that stops once nothing can start."""

from __future__ import annotations

import math

from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.nouns.records import FunctionRecord, Invocation
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec
from tests.unit.core_harness import Harness


def _fn(name: str) -> FunctionRecord:
    return FunctionRecord(name, name, name, make_spec(), ())


def _inv(n: int, fn: FunctionRecord, priority: int = 0, t: float = 0.0) -> Invocation:
    return Invocation(f"i{n}", fn, b"c", make_spec(priority=priority), (), t, n)


def test_ordered_is_best_head_first_and_follows_pops() -> None:
    q = ReadyQueue(aging_seconds=math.inf)
    f, g, h = _fn("f"), _fn("g"), _fn("h")
    a1, a2, b1, c1 = _inv(1, f), _inv(4, f), _inv(2, g), _inv(3, h, priority=-1)
    for x in (a1, a2, b1, c1):
        q.push(x)
    seen = []
    for fid in q.ordered():
        seen.append(fid)
        if fid == "f":
            q.pop("f")  # placed: its next head comes again, in order
    assert seen == ["f", "g", "f", "h"]


def test_a_blocked_function_is_visited_once_per_pass_and_kept() -> None:
    q = ReadyQueue(aging_seconds=math.inf)
    f, g = _fn("f"), _fn("g")
    for n, fn in ((1, f), (2, g), (3, f)):
        q.push(_inv(n, fn))
    assert list(q.ordered()) == ["f", "g"]  # nothing popped: each once
    assert list(q.ordered()) == ["f", "g"]  # and still there for the next pass


def test_stale_heads_after_lazy_removal() -> None:
    q = ReadyQueue(aging_seconds=math.inf)
    f, g = _fn("f"), _fn("g")
    a, b, c = _inv(1, f), _inv(2, f), _inv(3, g)
    for x in (a, b, c):
        q.push(x)
    a.state = InvState.CANCELLED  # left QUEUED without a pop (cancel, deadline)
    q.discard(a)
    assert list(q.ordered()) == ["f", "g"] and q.head("f") is b
    b.state = InvState.CANCELLED
    q.discard(b)
    assert list(q.ordered()) == ["g"]


def test_the_heads_heap_stays_bounded() -> None:
    q = ReadyQueue(aging_seconds=math.inf)
    f = _fn("f")
    for n in range(10_000):  # each push is a new head (higher priority): a stale entry each
        q.push(_inv(n, f, priority=n))
    assert len(q._heads) <= 2 * 1 + 64


def test_a_pass_visits_only_what_it_places_not_every_function() -> None:
    """1,000 functions with queued calls and one free slot: the pass places one call and
    stops, instead of asking every function's head (what made placement O(functions))."""
    h = Harness(devices=1, slots_per_device=4)
    h.start_worker(0)
    fids = [h.register(f"f{i}", concurrency=4) for i in range(1000)]
    for _ in range(3):
        for fid in fids:
            h.submit(fid)
    assert len(h.runs()) == 4 and len(h.core.queue) == 2996
    visited = []
    real = h.core.queue.ordered

    def counting() -> object:
        for fid in real():
            visited.append(fid)
            yield fid

    h.core.queue.ordered = counting  # type: ignore[method-assign]
    first = h.runs()[0]
    h.finish(b"w0", first.invocation_id)
    assert len(h.runs()) == 5
    assert len(visited) == 1, len(visited)
    assert isinstance(h.results()[first.invocation_id], p.Result)
