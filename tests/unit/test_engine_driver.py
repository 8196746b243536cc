"""The worker's engine driver: one thread steps an engine for every call that submits to
it; engines on one device take turns by priority (`Arbiter`)."""

from __future__ import annotations

import threading
import time

import pytest

from gpufn.engines import SamplingParams
from gpufn.engines.base import RequestOutput
from gpufn.engines.driver import Arbiter, RequestFailed, driver_for, generate

pytestmark = pytest.mark.timeout(60)


class Counting:
    """An engine whose requests produce one token per step, `n` of them."""

    max_batch = 8

    def __init__(self) -> None:
        self.reqs: dict[str, list[int]] = {}
        self.batches: list[int] = []

    def add_request(self, request_id: str, prompt: object, params: SamplingParams,
                    priority: int = 0) -> None:
        if prompt == "refuse":
            raise ValueError("refused")
        self.reqs[request_id] = [0, params.max_tokens]

    def step(self) -> list[RequestOutput]:
        self.batches.append(len(self.reqs))
        time.sleep(0.002)
        out = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            done = st[0] >= st[1]
            out.append(RequestOutput(rid, (st[0],), f"t{st[0]} ", done,
                                     completion_tokens=st[0]))
            if done:
                del self.reqs[rid]
        return out

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.reqs)


def test_the_arbiter_gives_the_turn_to_the_highest_priority_first() -> None:
    arb = Arbiter()
    arb.acquire(0)  # someone is stepping
    order: list[str] = []

    def wait(name: str, prio: int) -> None:
        arb.acquire(prio)
        order.append(name)
        arb.release()

    low = threading.Thread(target=wait, args=("low", 0))
    low.start()
    time.sleep(0.05)  # low waits first
    high = threading.Thread(target=wait, args=("high", 5))
    high.start()
    time.sleep(0.05)
    arb.release()
    low.join(5)
    high.join(5)
    assert order == ["high", "low"]


def test_concurrent_requests_share_steps_and_each_gets_its_own_outputs() -> None:
    engine = Counting()
    driver = driver_for(engine)
    results: dict[int, list[str]] = {}

    def one(i: int) -> None:
        params = SamplingParams(max_tokens=5 + i)
        results[i] = [o.text for o in generate(engine, "p", params, request_id=f"r{i}")]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for i in range(6):
        assert results[i] == [f"t{k} " for k in range(1, 6 + i)]
    assert max(engine.batches) > 1 and driver.steps < sum(5 + i for i in range(6))


def test_a_refused_request_raises_in_its_caller_alone() -> None:
    engine = Counting()
    with pytest.raises(RequestFailed, match="refused"):
        list(generate(engine, "refuse", SamplingParams(max_tokens=3), request_id="x"))
    assert [o.text for o in generate(engine, "ok", SamplingParams(max_tokens=2),
                                     request_id="y")] == ["t1 ", "t2 "]


def test_closing_the_iterator_leaves_the_batch() -> None:
    engine = Counting()
    it = generate(engine, "long", SamplingParams(max_tokens=1000), request_id="long")
    next(it)
    it.close()
    deadline = time.monotonic() + 5
    while engine.reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.reqs, "the closed request stayed in the engine"
    # This engine never says 'abort' for it: the loop ends the request itself, so the
    # driver thread goes idle instead of stepping an empty engine for ever.
    loop = driver_for(engine).loop
    while loop.has_work() and time.monotonic() < deadline + 5:
        time.sleep(0.01)
    assert not loop.has_work(), "the driver spins on a request its engine forgot"




def test_an_engine_stepping_again_keeps_its_turn_from_a_lower_priority_one() -> None:
    """An engine that will step again right after its step holds a claim at its
    priority: a lower-priority engine woken by the release waits for it (the GIL may
    wake that one first), until the claim's owner steps without one or withdraws; an
    abandoned claim lapses after `CLAIM_SECONDS`."""
    arb = Arbiter()
    high, low = object(), object()
    got = threading.Event()

    def low_step() -> None:
        arb.acquire(0, low)
        got.set()
        arb.release(low)

    arb.acquire(10, high)
    t = threading.Thread(target=low_step)
    t.start()
    time.sleep(0.05)
    arb.release(high, again=10)  # it steps again: the low engine must not slip in
    assert not got.wait(0.2), "a lower-priority engine stepped between a busy engine's steps"
    arb.acquire(10, high)
    arb.release(high)  # no more work: the low engine's turn
    assert got.wait(5)
    t.join(5)
    got.clear()
    arb.acquire(10, high)
    t = threading.Thread(target=low_step)
    t.start()
    t0 = time.monotonic()
    arb.release(high, again=10)  # and never comes back
    assert got.wait(5) and time.monotonic() - t0 >= Arbiter.CLAIM_SECONDS * 0.9
    t.join(5)
