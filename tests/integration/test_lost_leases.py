"""A `.map` whose worker dies under one call, through real processes, under a lease and
through the head: the calls queued behind that one never started there, and run again
as if first sent (the dead worker's journal says so), even with `retries=0`. Only the
call that took the worker down fails."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn

from ..conftest import cluster_with
from ._waits import wait_for

pytestmark = pytest.mark.timeout(180)

N, BAD = 16, 5


@gpufn.gpu(memory="1MiB")
def crashes(path: str, i: int, bad: int) -> int:
    """Notes its run in `path`; the `bad` one takes its worker down (a segfault, say)."""
    with open(path, "a") as f:
        f.write(f"{i}\n")
    if i == bad:
        time.sleep(0.3)  # (the answers before it have left)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.005)
    return i


@gpufn.gpu(memory="1MiB", timeout=1.0)
def hangs(path: str, i: int, bad: int) -> int:
    """Notes its run in `path`; the `bad` one swallows its interrupt and never stops
    (native code would not see it at all), so its worker is killed."""
    with open(path, "a") as f:
        f.write(f"{i}\n")
    if i == bad:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                time.sleep(0.05)
            except gpufn.Timeout:
                pass
    time.sleep(0.005)
    return i


@gpufn.gpu(memory="1MiB")
def freezes(path: str, i: int, bad: int) -> int:
    """Notes its run in `path`; the `bad` one freezes its worker at once: native code
    that holds the GIL, so the answers of the calls before it may not have left and the
    worker's heartbeat stops (the scheduler kills it)."""
    with open(path, "a") as f:
        f.write(f"{i}\n")
    if i == bad:
        import ctypes

        ctypes.pythonapi.sleep(600)  # libc's sleep, the GIL held (PyDLL)
    time.sleep(0.005)
    return i


@gpufn.gpu(memory="1MiB")
def crashes_at_once(path: str, i: int, bad: int) -> int:
    """Notes its run in `path`; the `bad` one kills its worker at once. The others take no
    time, so the worker runs them inline, a leased one on its fast path."""
    with open(path, "a") as f:
        f.write(f"{i}\n")
    if i == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Bomb:
    """Unpickled, it takes the process down (an import that segfaults, say)."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_die, ())


@pytest.fixture(scope="module", params=["leased", "scheduled"])
def one_device(request: pytest.FixtureRequest) -> Iterator[gpufn.Client]:
    """One device, long leases (or none: every call through the head, pipelined to the
    worker), a stuck call's worker killed 1 s after its interrupt."""
    leases = "1" if request.param == "leased" else "0"
    with cluster_with(GPUFN_CPU_DEVICES=1, GPUFN_LEASE_SECONDS=30, GPUFN_LEASES=leases,
                      GPUFN_STOP_GRACE_SECONDS=1, GPUFN_HEARTBEAT_TIMEOUT=4) as c:
        yield c


@pytest.mark.parametrize("fn", [crashes, hangs], ids=["crash", "stuck past its timeout"])
def test_calls_queued_behind_the_call_that_lost_the_worker_run_once_each(
        one_device: gpufn.Client, tmp_path: Path, fn: gpufn.Function) -> None:
    warm = str(tmp_path / "warm")
    leased = one_device.leases.on
    wait_for(lambda: (list(fn.map([warm] * 8, range(8), [-1] * 8)),
                      one_device.leases.direct_calls > 0 or not leased)[1],
             timeout=30, what="a lease")
    runs = tmp_path / "runs"
    direct = one_device.leases.direct_calls
    out = list(fn.map([str(runs)] * N, range(N), [BAD] * N, return_exceptions=True))
    if leased:
        assert one_device.leases.direct_calls - direct >= BAD  # the map went under the lease
    failed = {i: o for i, o in enumerate(out) if isinstance(o, BaseException)}
    assert list(failed) == [BAD], failed
    assert isinstance(failed[BAD], gpufn.WorkerLost if fn is crashes else gpufn.Timeout)
    assert [o for i, o in enumerate(out) if i != BAD] == [i for i in range(N) if i != BAD]
    ran = Counter(int(line) for line in runs.read_text().split())
    assert ran == Counter(range(N)), ran  # each once, the bad one too (retries=0)


@pytest.mark.parametrize("fn", [freezes, crashes_at_once], ids=["frozen", "crash at once"])
def test_a_worker_lost_at_once_runs_no_call_twice(
        one_device: gpufn.Client, tmp_path: Path, fn: gpufn.Function) -> None:
    """A call freezes its worker (the GIL held in native code: no heartbeat) or kills it,
    at once, so the answers of calls that ran just before it may die with the process. A
    call the dead worker ran fails `WorkerLost` or answers; one it never started runs
    again as if first sent; none runs twice (`retries=0`). The calls that take no time
    run inline, a leased one on the worker's fast path, which journals its own starts."""
    warm = str(tmp_path / "warm")
    wait_for(lambda: (list(fn.map([warm] * 8, range(8), [-1] * 8)),
                      one_device.leases.direct_calls > 0 or not one_device.leases.on)[1],
             timeout=30, what="a lease")
    runs = tmp_path / "runs"
    out = list(fn.map([str(runs)] * N, range(N), [BAD] * N, return_exceptions=True))
    order = [int(line) for line in runs.read_text().split()]
    assert Counter(order) == Counter(range(N)), order  # each ran once
    failed = {i: o for i, o in enumerate(out) if isinstance(o, BaseException)}
    assert all(isinstance(e, gpufn.WorkerLost) for e in failed.values()), failed
    assert BAD in failed
    before = set(order[:order.index(BAD)])  # ran on the worker that froze
    assert set(failed) - {BAD} <= before, (order, sorted(failed))
    assert all(o == i for i, o in enumerate(out) if i not in failed)


def test_a_call_whose_code_takes_its_worker_down_each_time_fails_at_last(
        one_device: gpufn.Client) -> None:
    """Its code, loaded on the worker before the call starts, kills the worker: the call
    never starts, so each loss sent it back unspent, and it went round for ever. After
    three such losses it fails, saying why; the device serves on."""
    if not one_device.leases.on:
        pytest.skip("the same path with leases on or off: once is enough")
    bomb = _Bomb()

    @gpufn.gpu(memory="1MiB")
    def kills_on_load() -> bool:  # defined here: its code and `bomb` travel by value
        return bomb is not None

    with pytest.raises(gpufn.WorkerLost, match="lost 3 more time"):
        kills_on_load.spawn().get(timeout=120)
    wait_for(lambda: one_device.status()["devices"][0]["state"] == "ready", timeout=60,
             what="the device back")
