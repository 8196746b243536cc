"""Priority, deadlines, cancellation, preemption, batching and concurrency through real
processes on one simulated device."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

import gpufn

from ..conftest import cluster_with, wait_ready
from ._waits import running_ids, settled_counters, wait_for, wait_idle

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def one() -> Iterator[gpufn.Client]:
    with cluster_with(GPUFN_CPU_DEVICES=1, GPUFN_STOP_GRACE_SECONDS=1) as c:
        yield c


@gpufn.gpu
def stamp(tag: str, seconds: float = 0.05) -> tuple[str, float]:
    time.sleep(seconds)
    return tag, time.monotonic()


def test_higher_priority_runs_first(one: gpufn.Client) -> None:
    blocker = stamp.spawn("blocker", 0.5)
    wait_for(lambda: blocker.id in running_ids(one), 20, "the blocker to run")
    low = [stamp.spawn(f"low{i}") for i in range(4)]
    high = [stamp.with_options(priority=10).spawn(f"high{i}") for i in range(4)]
    blocker.get(timeout=30)
    done_low = [c.get(timeout=30)[1] for c in low]
    done_high = [c.get(timeout=30)[1] for c in high]
    assert max(done_high) < min(done_low)


def test_deadline_drops_a_call_that_cannot_start_in_time(one: gpufn.Client) -> None:
    blocker = stamp.spawn("blocker", 1.0)
    wait_for(lambda: blocker.id in running_ids(one), 20, "the blocker to run")
    late = stamp.with_options(deadline=0.3).spawn("late")
    with pytest.raises(gpufn.Timeout, match="deadline"):
        late.get(timeout=30)
    blocker.get(timeout=30)


def test_cancel_stops_running_work_and_kills_a_stuck_worker(one: gpufn.Client) -> None:
    @gpufn.gpu
    def stuck_in_c() -> None:
        time.sleep(60)  # C code: the interrupt only lands when it returns

    pid = one.status()["devices"][0]["pid"]
    call = stuck_in_c.spawn()
    wait_for(lambda: call.id in running_ids(one), 20, "the call to run")
    t0 = time.monotonic()
    assert call.cancel()
    with pytest.raises(gpufn.Cancelled):
        call.get(timeout=10)
    assert time.monotonic() - t0 < 1
    deadline = time.monotonic() + 20  # killed after the 1 s grace, and restarted
    while one.status()["devices"][0]["pid"] in (pid, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    st = wait_ready(one)
    assert st["devices"][0]["pid"] != pid and st["devices"][0]["restarts"] >= 1
    assert stamp.remote("after")[0] == "after"


def test_closing_a_map_cancels_what_is_left(one: gpufn.Client) -> None:
    before = settled_counters(one)
    it = stamp.map([f"m{i}" for i in range(30)], [0.1] * 30)
    next(it)
    it.close()
    wait_idle(one)
    after = settled_counters(one)
    # The calls not started are dropped where they wait: at the scheduler (counted
    # cancelled there), under a lease at the worker, or in the client (never sent).
    ran = after["succeeded"] - before["succeeded"]
    assert 1 <= ran <= 5, f"{ran} of the 30 calls ran after the map was closed"


def test_preemptible_low_priority_call_yields_and_reruns(one: gpufn.Client) -> None:
    @gpufn.gpu(preemptible=True, priority=0)
    def background(steps: int) -> int:
        for _ in range(steps):
            time.sleep(0.01)  # Python code between sleeps: interruptible
        return steps

    bg = background.spawn(150)
    wait_for(lambda: bg.id in running_ids(one), 20, "the background call to run")
    # the same function at a higher priority: it cannot run beside bg (concurrency=1)
    urgent = background.with_options(priority=5, preemptible=False).spawn(1)
    t0 = time.monotonic()
    assert urgent.get(timeout=30) == 1
    assert time.monotonic() - t0 < 1.0  # it did not wait for bg's remaining second
    assert bg.get(timeout=60) == 150
    meta = bg.result_meta()
    assert meta["attempts"] >= 2 and one.status()["counters"]["preempted"] >= 1


def test_dynamic_batching_groups_calls_and_keeps_per_item_errors(one: gpufn.Client) -> None:
    @gpufn.gpu(batch_size=8, batch_wait_ms=100)
    def double(xs: list[int]) -> list[object]:
        return [ValueError(f"bad {x}") if x == 13 else (x * 2, len(xs)) for x in xs]

    calls = [double.spawn(x) for x in range(20)]
    out = []
    for x, c in zip(range(20), calls, strict=True):
        if x == 13:
            with pytest.raises(ValueError, match="bad 13"):
                c.get(timeout=30)
        else:
            out.append(c.get(timeout=30))
    assert [v for v, _ in out] == [x * 2 for x in range(20) if x != 13]
    assert max(size for _, size in out) == 8 and sum(1 for _, s in out if s > 1) >= 16
    assert double.remote(3) == (6, 1)  # alone: the batch goes out after batch_wait_ms


def test_concurrency_runs_calls_of_a_function_in_parallel(one: gpufn.Client) -> None:
    @gpufn.gpu(concurrency=4)
    def io_bound() -> int:
        time.sleep(0.5)
        return os.getpid()

    t0 = time.monotonic()
    pids = [c.get(timeout=30) for c in [io_bound.spawn() for _ in range(4)]]
    assert time.monotonic() - t0 < 1.5 and len(set(pids)) == 1


def test_a_short_function_with_concurrency_still_runs_its_calls_at_once(
        one: gpufn.Client) -> None:
    """A function measured short (under GPUFN's short-call threshold) may run inline on the
    worker's main thread, one at a time; one declared with concurrency > 1 never does."""
    @gpufn.gpu(concurrency=4)
    def mostly_short(wait: float) -> float:
        time.sleep(wait)
        return time.monotonic()

    for _ in range(30):  # measured: far under 5 ms a call
        mostly_short.remote(0.0)
    calls = [mostly_short.spawn(1.0) for _ in range(4)]
    ends = [c.get(timeout=30) for c in calls]
    # Together: the four end within one sleep of each other; inline: 1 s apart each.
    assert max(ends) - min(ends) < 0.9, ends
