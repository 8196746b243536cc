"""Warm gangs through real processes: a measured-short gang whose group is formed runs
its ranks on the workers' main threads (no executor hand-off), and keeps every gang
rule there: a failing rank's error wins, a cancel or timeout stops the ranks without
restarting a worker, and the group is formed again afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import gpufn

from ..conftest import cluster_with, wait_ready

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def two() -> Iterator[gpufn.Client]:
    with cluster_with(GPUFN_CPU_DEVICES=2) as c:
        yield c


@gpufn.gpu(count=2, gather=True, timeout=20)
def step(mode: str = "ok") -> bool:
    """One all_reduce; says whether this rank ran on its worker's main thread."""
    import threading

    import torch
    import torch.distributed as dist

    if gpufn.context().rank == 1:
        if mode == "fail":
            raise ValueError("rank one failed inline")
        if mode == "stall":  # Python-level sleeps: a cancel lands between them
            for _ in range(600):
                time.sleep(0.05)
    dist.all_reduce(torch.ones(1))
    return threading.current_thread() is threading.main_thread()


def warm_up() -> None:
    """Calls until the gang runs inline (short measured run time, group formed)."""
    for _ in range(30):
        if step.remote() == [True, True]:
            return
    raise AssertionError("a warm, short gang never ran on its workers' main threads")


def pids(c: gpufn.Client) -> dict[str, int]:
    return {d["key"]: d["pid"] for d in c.status()["devices"]}


def test_a_cold_gang_runs_in_threads_and_a_warm_short_one_inline(two: gpufn.Client) -> None:
    assert step.remote() == [False, False]  # first call: a group to join, no run time known
    warm_up()


def test_a_failing_inline_rank_fails_the_gang_with_its_error(two: gpufn.Client) -> None:
    warm_up()
    before = pids(two)
    with pytest.raises(ValueError, match=r"\[rank 1 of 2\] rank one failed inline"):
        step.remote("fail")
    assert step.remote() == [False, False]  # the group is formed again (in threads)
    assert pids(two) == before  # nobody was restarted
    warm_up()


def test_a_cancelled_inline_gang_stops_without_a_restart(two: gpufn.Client) -> None:
    warm_up()
    before = pids(two)
    call = step.spawn("stall")
    time.sleep(1.0)  # rank 0 waits in the collective on its main thread, rank 1 sleeps
    call.cancel()
    with pytest.raises(gpufn.Cancelled):
        call.get(timeout=30)
    t0 = time.monotonic()
    assert step.remote() == [False, False]
    assert time.monotonic() - t0 < 10  # the ranks stopped: their devices were freed at once
    assert pids(two) == before


def test_an_inline_gang_past_its_timeout_ends_and_the_gang_serves_on(two: gpufn.Client) -> None:
    warm_up()
    t0 = time.monotonic()
    with pytest.raises(gpufn.Timeout, match="timeout of 2s"):
        step.with_options(timeout=2).remote("stall")
    assert time.monotonic() - t0 < 15
    wait_ready(two)  # a call past its timeout has its workers replaced, as in a thread
    assert step.remote() == [False, False]
