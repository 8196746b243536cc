"""A `.map` under leases through real processes: its calls spread over the devices, each
lease holding a few of them by their run time, and each is metered once."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

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


@gpufn.gpu(memory="1MiB")
def nap_too(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_a_finished_maps_idle_leases_give_way_to_its_clients_next_function() -> None:
    """After one function's .map its client's leases stay open, idle, on both devices (30 s
    here). The next function's calls, awaited one at a time, never wait at the scheduler
    (the devices have room beside the leases), so nothing revoked those: none of them
    went under a lease until those ended. Now each such call asks them to end once idle,
    and the next ones take a lease of their own."""
    async def one_by_one(n: int) -> list[int]:
        return [await nap_too.remote.aio(0.0) for _ in range(n)]

    with cluster_with(GPUFN_CPU_DEVICES=2, GPUFN_LEASE_SECONDS=30) as c:
        assert len(set(nap.map([0.002] * 200))) == 2  # leases on both devices
        direct = c.leases.direct_calls
        assert len(asyncio.run(one_by_one(300))) == 300
        assert c.leases.direct_calls - direct >= 200, c.leases.direct_calls - direct


@gpufn.gpu(memory="1MiB")
def mark_after(path: str, seconds: float) -> str:
    time.sleep(seconds)
    Path(path).write_text("ran to the end")
    return path


def test_awaited_calls_go_under_a_lease_and_a_cancelled_await_stops_its_call(
        tmp_path: Path) -> None:
    """Its own cluster: another function's idle lease of the same client would keep this
    one's calls off leases until it ended (30 s here; see docs/performance.md)."""
    with cluster_with(GPUFN_CPU_DEVICES=1, GPUFN_LEASE_SECONDS=30) as leasing:
        _awaited(leasing, tmp_path)


def _awaited(leasing: gpufn.Client, tmp_path: Path) -> None:
    async def some() -> list[str]:
        return await asyncio.gather(*[mark_after.remote.aio(str(tmp_path / f"w{i}"), 0.0)
                                      for i in range(40)])

    assert len(asyncio.run(some())) == 40  # the first ones bring the lease
    direct = leasing.leases.direct_calls
    assert len(asyncio.run(some())) == 40
    assert leasing.leases.direct_calls - direct >= 20  # awaited calls take leases too
    late = tmp_path / "late"
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(mark_after.remote.aio(str(late), 3.0), timeout=0.5))
    time.sleep(4.0)
    assert not late.exists()  # the call was stopped on its worker, not left to run
    assert asyncio.run(some())  # and the function still answers
    # an await that times out leaves the call itself alone: it can be awaited again
    call = mark_after.spawn(str(tmp_path / "spawned"), 1.0)
    with pytest.raises(gpufn.Timeout):
        asyncio.run(call.get.aio(timeout=0.1))
    assert call.get(timeout=30) == str(tmp_path / "spawned")


@gpufn.gpu(memory="1MiB")
def step(i: int, where: str = "") -> int:
    """i < 0: a 50 ms warm-up (measured long: never inline). Else it runs 1.5 s (item 0
    raises after 0.5 s), in 10 ms steps an interrupt lands between, and writes how it
    ended into `where`/i."""
    if i < 0:
        time.sleep(0.05)
        return i
    path = Path(where) / str(i)
    path.write_text("started")
    try:
        end = time.monotonic() + (0.5 if i == 0 else 1.5)
        while time.monotonic() < end:
            time.sleep(0.01)
    except BaseException as e:
        path.write_text(type(e).__name__)
        raise
    if i == 0:
        path.write_text("raised")
        raise ValueError("item 0 fails")
    path.write_text("finished")
    return i


def test_a_maps_first_failure_drops_its_waiting_calls_and_lets_running_ones_finish(
        tmp_path: Path) -> None:
    """A .map that raises its first failure cancels the calls still out "unless running"
    (as a scheduled map does): a leased call that runs on its worker finishes, the ones
    waiting under a lease or in the client never start."""
    with cluster_with(GPUFN_CPU_DEVICES=2, GPUFN_LEASE_SECONDS=30) as c:
        assert list(step.map(range(-40, 0))) == list(range(-40, 0))  # leases on both devices
        direct = c.leases.direct_calls
        with pytest.raises(ValueError, match="item 0 fails"):
            list(step.map(range(8), kwargs={"where": str(tmp_path)}))
        assert c.leases.direct_calls > direct

        def states() -> dict[str, str]:
            return {f.name: f.read_text() for f in tmp_path.iterdir()}

        wait_for(lambda: all(v in ("raised", "finished", "Cancelled")
                             for v in states().values()), timeout=20,
                 what="every started call to end")
        time.sleep(0.5)
        got = states()
        assert got["0"] == "raised"
        assert "Cancelled" not in got.values(), got  # running ones were left to finish
        assert "finished" in got.values(), got  # one ran beside item 0 (two devices)
        assert len(got) < 8, got  # the waiting ones were dropped
