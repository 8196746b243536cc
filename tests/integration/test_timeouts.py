"""Timeouts of scheduled calls through real processes: the call past its timeout is the
one that fails, and the calls around it answer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import gpufn

from ..conftest import cluster_with

pytestmark = pytest.mark.timeout(120)


@gpufn.gpu(memory="1MiB", timeout=1.5)
def spin(seconds: float) -> float:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return seconds


@pytest.fixture(scope="module")
def scheduled() -> Iterator[gpufn.Client]:
    """One device, leases off: every call goes through the scheduler."""
    with cluster_with(GPUFN_CPU_DEVICES=1, GPUFN_LEASES=0) as c:
        yield c


def test_the_call_past_its_timeout_fails_and_the_calls_pipelined_around_it_answer(
        scheduled: gpufn.Client) -> None:
    """A short function's calls are pipelined to its worker, which runs them inline one
    after another. It held the Results of the quick ones while a long one ran after
    them, so the scheduler, timing the first call it had no Result for, failed that
    quick call with Timeout and the rest with WorkerLost (the worker killed for it)."""
    assert list(spin.map([0.0] * 30)) == [0.0] * 30  # measured short: pipelined
    inputs = [0.0] * 5 + [4.0] + [0.0] * 5
    t0 = time.monotonic()
    out = list(spin.map(inputs, return_exceptions=True))
    assert time.monotonic() - t0 < 3.5  # stopped at its timeout, not at its end
    assert [type(o).__name__ for o in out] == ["float"] * 5 + ["Timeout"] + ["float"] * 5
    assert "ran longer than its timeout of 1.5s" in str(out[5])
