from __future__ import annotations

import math

import pytest

from gpufn.scheduler.books.queues import ReadyQueue, queue_key
from gpufn.scheduler.nouns.records import FunctionRecord, Invocation
from gpufn.scheduler.nouns.states import InvState
from gpufn.scheduler.placement.device_fit import type_rank
from gpufn.wire.spec import make_spec


def _inv(n: int, fn: FunctionRecord, priority: int, t: float) -> Invocation:
    return Invocation(f"i{n}", fn, b"c", make_spec(priority=priority), (), t, n)


def _fn(name: str) -> FunctionRecord:
    return FunctionRecord(name, name, name, make_spec(), ())


def test_priority_then_fifo() -> None:
    q = ReadyQueue(aging_seconds=math.inf)
    f = _fn("f")
    a, b, c = _inv(1, f, 0, 0.0), _inv(2, f, 5, 1.0), _inv(3, f, 0, 2.0)
    g = _fn("g")
    d = _inv(0, g, 5, 0.5)  # submitted before b
    for x in (a, b, c, d):
        q.push(x)
    assert len(q) == 4 and q.depth("f") == 3
    assert [fid for _, _, fid in q.heads()] == ["g", "f"]  # g's head (p5, t0.5) beats f's head
    # within f, the heap orders by key too: b (p5) before a and c
    assert q.head("f") is b
    q.pop("f")
    assert q.head("f") is a


def test_aging_bounds_the_wait_of_low_priority_calls() -> None:
    # one level per 10 s: a p0 call waiting 25 s beats a p2 call that just arrived
    assert queue_key(0, 0.0, 10.0) < queue_key(2, 25.0, 10.0)
    assert queue_key(0, 0.0, 10.0) > queue_key(2, 15.0, 10.0)


def test_lazy_removal() -> None:
    q = ReadyQueue()
    f = _fn("f")
    a, b = _inv(1, f, 0, 0.0), _inv(2, f, 0, 1.0)
    q.push(a)
    q.push(b)
    a.state = InvState.CANCELLED
    q.discard(a)
    assert len(q) == 1 and q.head("f") is b and list(q) == [b]
    q.pop("f")
    assert len(q) == 0 and q.heads() == [] and q.functions() == []


@pytest.mark.parametrize(
    ("types", "name", "rank"),
    [((), "anything", 0), (("H100",), "NVIDIA H100 80GB HBM3", 0), (("A100-80GB",), "NVIDIA A100-SXM4-80GB", 0),
     (("A10",), "NVIDIA A100-SXM4-80GB", None), (("H100", "A100"), "NVIDIA A100 40GB", 1),
     (("h200",), "NVIDIA H200", 0), (("L4",), "NVIDIA L40S", None)],
)
def test_type_matching(types: tuple[str, ...], name: str, rank: int | None) -> None:
    assert type_rank(types, name) == rank
