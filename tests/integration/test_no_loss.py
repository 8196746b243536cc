"""No silent loss: tiny high-water marks force every socket to push back, and every
one of 20,000 pipelined calls (times GPUFN_TEST_SCALE) still gets exactly one result."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

import gpufn

from .funcs import echo

pytestmark = pytest.mark.timeout(180)
# The load run's size: .ci/run uses a reduced one; 1 (20,000 calls) by default.
SCALE = float(os.environ.get("GPUFN_TEST_SCALE", "1"))


@pytest.mark.slow
def test_20k_pipelined_calls_with_tiny_hwm(fresh_cluster: Callable[..., gpufn.Client]) -> None:
    client = fresh_cluster(GPUFN_HWM=20)
    n = max(1000, int(20_000 * SCALE))
    t0 = time.monotonic()
    calls = [echo.spawn(i) for i in range(n)]
    results = [c.get(timeout=120) for c in calls]
    elapsed = time.monotonic() - t0
    assert results == list(range(n))
    st = client.status()
    assert st["counters"]["succeeded"] == n and st["queued"] == 0 and st["running"] == 0
    assert len({c.id for c in calls}) == n
    print(f"{n} pipelined calls with HWM=20: {elapsed:.1f}s ({n / elapsed:.0f} calls/s)")


def test_calls_submitted_before_workers_start_are_not_lost(
    fresh_cluster: Callable[..., gpufn.Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first call of a new cluster reaches a worker in the same batch as its Welcome."""
    from ..conftest import shutdown_default

    shutdown_default()
    monkeypatch.setenv("GPUFN_CPU_DEVICES", "1")
    gpufn.connect()  # does not wait for workers
    calls = [echo.spawn(i) for i in range(5)]
    assert echo.remote("direct") == "direct"
    assert [c.get(timeout=60) for c in calls] == list(range(5))
