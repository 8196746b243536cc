"""A `.map` under leases through real processes: its calls spread over the devices, each
lease holding a few of them by their run time, and each is metered once."""

from __future__ import annotations

import os
import time

import pytest

import gpufn

from ..conftest import cluster_with
from ._waits import wait_for

pytestmark = pytest.mark.timeout(120)


@gpufn.gpu(memory="1MiB")
def nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _usage_calls(c: gpufn.Client, fn: str) -> int:
    rows = c.query("usage", {"since": 3600.0, "by": "function"})["rows"]
    return sum(int(r["calls"]) for r in rows if r["function"] == fn)


@pytest.mark.parametrize("lease_seconds", [30.0, 0.3])
def test_a_leased_map_spreads_over_the_devices_and_is_metered_once(lease_seconds: float) -> None:
    """A .map takes leases: its calls go to every device (a lease holds a few of them by
    their run time, the rest wait in the client or at the scheduler for the other
    device), none waits for a lease's end (30 s), few are refused at one's end (0.3 s:
    64 calls queued under a lease came back refused and were sent again), and each is
    metered once."""
    with cluster_with(GPUFN_CPU_DEVICES=2, GPUFN_LEASE_SECONDS=lease_seconds) as c:
        nap.remote(0.0)
        before, direct = _usage_calls(c, "nap"), c.leases.direct_calls
        t0 = time.monotonic()
        pids = list(nap.map([0.01] * 400))
        assert time.monotonic() - t0 < 20  # 2 s of calls over two devices, not a lease's 30 s
        counts = sorted(pids.count(pid) for pid in set(pids))
        assert len(counts) == 2 and counts[0] >= 100, counts  # both devices took a share
        sent = c.leases.direct_calls - direct  # under a lease, counted each time one is sent
        assert 200 <= sent <= 440, sent  # most went straight to the workers, few twice
        wait_for(lambda: _usage_calls(c, "nap") - before == 400, timeout=30,
                 what="every call of the map metered once")
        time.sleep(0.5)
        assert _usage_calls(c, "nap") - before == 400
