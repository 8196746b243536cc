"""Same-host big payloads through shared memory (gpufn/wire/shm.py): arguments and results
over GPUFN_SHM_THRESHOLD travel as files in /dev/shm, the worker's argument is a view of
the mapping, and every file is gone when the call ends (but the caller's pool of free
argument files, until they idle or it exits), when it is cancelled before a worker read
it, and when its caller dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gpufn
from gpufn.wire import shm

from ._waits import wait_for

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm.host_id(), reason="no writable /dev/shm here")]
MiB = 2**20


def files_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{pid}-"))


def left() -> list[str]:
    """This process's files that are not free in its pool (so in use, or leaked)."""
    pool = shm.pool()
    free = set(pool.free_names()) if pool is not None else set()
    return [n for n in files_of(os.getpid()) if n not in free]


@pytest.fixture(autouse=True)
def _empty_pool() -> Any:
    yield
    pool = shm.pool()
    if pool is not None:
        pool.clear()
    assert files_of(os.getpid()) == []  # once the pool lets go, nothing of ours is left


@gpufn.gpu
def mapped_and_doubled(t: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """Which shared-memory files this worker has mapped (its argument's), and 2*t."""
    with open("/proc/self/maps") as f:
        maps = sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                       for line in f if f"/{shm.PREFIX}" in line})
    return [os.path.basename(m) for m in maps], t * 2


@gpufn.gpu
def hold(t: Any, seconds: float) -> None:
    time.sleep(seconds)


@gpufn.gpu
def size_of(t: torch.Tensor) -> int:
    return t.numel()


def test_big_tensors_go_through_shared_memory_and_are_freed(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    x = torch.arange(2 * MiB, dtype=torch.float32)  # 8 MiB
    call = mapped_and_doubled.spawn(x)
    mapped, doubled = call.get(timeout=60)
    assert torch.equal(doubled, x * 2)
    assert any(n.startswith(f"{shm.PREFIX}{os.getpid()}-") for n in mapped), mapped
    meta: Any = call._future.result().meta
    assert meta.shm and all(n.startswith(f"{shm.PREFIX}{os.getpid()}-") for n in meta.shm)
    del mapped, doubled, call
    assert left() == []  # both ways: taken and unlinked, or free in the pool
    # the blocking path too, and small values still go through the socket
    mapped, doubled = mapped_and_doubled.remote(x)
    assert torch.equal(doubled, x * 2)
    del mapped, doubled
    assert left() == []
    assert size_of.remote(torch.ones(10)) == 10
    # a .map whose arguments exceed its in-flight byte window: one output per input, in order
    from gpufn.api import map_run

    old = map_run.MAP_WINDOW_BYTES
    map_run.MAP_WINDOW_BYTES = 4 * MiB
    try:
        ins = [torch.full((2 * MiB,), float(i)) for i in range(5)]  # 8 MiB each
        outs = list(mapped_and_doubled.map(ins))
    finally:
        map_run.MAP_WINDOW_BYTES = old
    assert [float(o[1][0]) for o in outs] == [0.0, 2.0, 4.0, 6.0, 8.0]
    del outs
    assert left() == []


@gpufn.gpu
def mapped_and_echoed(a: Any) -> tuple[list[str], Any, Any]:
    """The shared-memory files this worker maps, 2*a (a new array) and a itself."""
    with open("/proc/self/maps") as f:
        maps = sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                       for line in f if f"/{shm.PREFIX}" in line})
    return [os.path.basename(m) for m in maps], a * 2, a


def test_a_64_mib_numpy_array_goes_both_ways_through_shared_memory(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    import numpy as np

    fresh_cluster(GPUFN_SHM_THRESHOLD="64MiB", GPUFN_CPU_DEVICES=1)
    x = np.arange(16 * MiB, dtype=np.float32)  # 64 MiB: the threshold itself
    call = mapped_and_echoed.spawn(x)
    mapped, doubled, same = call.get(timeout=60)
    assert np.array_equal(doubled, x * 2) and np.array_equal(same, x)
    assert same.flags.writeable and not np.shares_memory(same, x)
    mine = f"{shm.PREFIX}{os.getpid()}-"
    assert any(n.startswith(mine) for n in mapped), mapped  # the worker mapped the argument
    meta: Any = call._future.result().meta
    assert meta.shm and len(meta.shm) == 2 and all(n.startswith(mine) for n in meta.shm)
    del mapped, doubled, same, call
    assert left() == []  # both ways: taken and unlinked, or free in the pool
    # a small array goes through the socket: nothing mapped, no file named
    small = np.arange(MiB, dtype=np.float32)  # 4 MiB
    call = mapped_and_echoed.spawn(small)
    mapped, doubled, same = call.get(timeout=60)
    assert np.array_equal(doubled, small * 2) and np.array_equal(same, small)
    assert not any(n.startswith(mine) for n in mapped), mapped
    assert call._future.result().meta.shm is None
    del mapped, doubled, same, call
    assert left() == []


def test_a_call_cancelled_before_it_ran_frees_its_arguments(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    blocker = hold.spawn(None, 30)  # concurrency 1: the next call of hold waits
    wait_for(lambda: any(d["running"] for d in gpufn.connect().status()["devices"]), 30,
             "the blocker to run")
    queued = hold.spawn(torch.zeros(2 * MiB), 0)
    assert len(left()) == 1  # written, waiting in the queue
    queued.cancel()
    with pytest.raises(gpufn.Cancelled):
        queued.get(timeout=30)
    wait_for(lambda: files_of(os.getpid()) == [], 10, "the argument file to go")  # not pooled
    blocker.cancel()


CHILD = textwrap.dedent("""
    import os, sys, threading, time
    import torch, gpufn
    import gpufn.client.client as client_module
    # No ping while it lives: a Pong sent to it after it died would make the scheduler
    # forget it and stop its call (the file would never be written).
    client_module.PING_SECONDS = 3600.0
    gpufn.connect(sys.argv[1], token=sys.argv[2])
    started = sys.argv[3]

    @gpufn.gpu
    def slow_big(t, started):
        open(started, "w").close()
        time.sleep(2)
        return torch.cat([t, t])  # too big for its argument's file: a new one

    threading.Thread(target=slow_big.remote, args=(torch.zeros(2**21), started),
                     daemon=True).start()
    while not os.path.exists(started):  # its call runs: die now
        time.sleep(0.005)
    os._exit(0)  # no goodbye, no cleanup
""")


def test_files_of_a_caller_that_died_are_removed(
        fresh_cluster: Callable[..., gpufn.Client], tmp_path: Any) -> None:
    c = fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), c.address, c.token,
                              str(tmp_path / "started")],
                             env={**os.environ, "GPUFN_SHM_THRESHOLD": "1MiB"})
    try:
        assert child.wait(60) == 0
        # Its call ends after it died: the result is written for it (seen once the call no
        # longer runs), and then the host's supervisor removes it.
        seen = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = any(d["running"] for d in c.status()["devices"])
            files = files_of(child.pid)
            seen = seen or (not busy and bool(files))
            if seen and not files:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"the dead caller's result file was {'not removed' if seen else 'never seen'}")
    finally:
        child.kill()
        child.wait(10)


@gpufn.gpu
def echo(t: torch.Tensor) -> torch.Tensor:
    return t


@gpufn.gpu
def plus_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1


@gpufn.gpu
def keep(t: torch.Tensor, plus: float | None = None) -> torch.Tensor:
    """Returns its argument (or a new tensor, t + plus) and keeps it (in the worker)."""
    import builtins

    builtins.__dict__.setdefault("_gpufn_test_kept", []).append(t)
    return t if plus is None else t + plus


@gpufn.gpu
def kept_first(fill: float | None = None) -> float:
    import builtins

    t = builtins.__dict__["_gpufn_test_kept"][-1]
    if fill is not None:
        t.fill_(fill)
    return float(t[0])


def test_an_argument_file_carries_the_result_back_and_is_reused(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    x = torch.arange(2 * MiB, dtype=torch.float32)
    call = echo.spawn(x)
    got = call.get(timeout=60)
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()
    (arg,) = left()  # the argument's pooled file, in use by the result
    assert shm._is_pooled(arg) and call._future.result().meta.shm == [arg]  # not copied
    assert call.get() is got  # read once
    del got, call
    assert shm.pool().free_names() == [arg]  # nothing views it: free for the next call
    call = plus_one.spawn(x)  # written into the same file; the result written over it
    got = call.get(timeout=60)
    assert torch.equal(got, x + 1) and call._future.result().meta.shm == [arg]
    assert torch.equal(x, torch.arange(2 * MiB, dtype=torch.float32))  # the caller's own
    again = echo.remote(x)  # while `got` views the file, the next call takes another
    assert torch.equal(again, x) and torch.equal(got, x + 1)
    del got, call, again
    assert left() == []


@gpufn.gpu
def two_from_one(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = t + 1, t * 2
    del t  # the argument's file is free: one result may be written into it, not both
    return a, b


def test_a_dropped_argument_and_two_big_results_come_back_different_and_right(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    x = torch.arange(2 * MiB, dtype=torch.float32)
    for _ in range(2):  # the second call reuses the pool's files
        a, b = two_from_one.remote(x)
        assert torch.equal(a, x + 1) and torch.equal(b, x * 2)
        assert a.data_ptr() != b.data_ptr()
        del a, b
    assert torch.equal(x, torch.arange(2 * MiB, dtype=torch.float32))


def test_a_kept_argument_is_never_written_again_and_its_result_is_a_copy(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    x = torch.arange(2 * MiB, dtype=torch.float32)
    call = keep.spawn(x)
    got = call.get(timeout=60)
    (name,) = call._future.result().meta.shm
    assert not shm._is_pooled(name)  # a copy, made when the call ended
    assert kept_first.remote(-7.0) == -7.0  # the worker changes what it kept ...
    assert torch.equal(got, x)  # ... and the result does not change
    del got, call
    assert left() == [] and shm.pool().free_names() == []  # the kept file was removed
    y = torch.full((2 * MiB,), 5.0)
    assert torch.equal(echo.remote(y), y)  # a new file: what the worker kept stays as it was
    assert kept_first.remote() == -7.0
    # a new result is not written into the file of an argument the function kept
    assert torch.equal(keep.remote(y, 1.0), y + 1) and kept_first.remote() == 5.0


HOLDER = textwrap.dedent("""
    import os, sys, time
    import torch, gpufn
    gpufn.connect(sys.argv[1], token=sys.argv[2])

    @gpufn.gpu
    def echo(t):
        return t

    x = torch.ones(2**21)
    for _ in range(3):
        assert torch.equal(echo.remote(x), x)
    print("ready", flush=True)
    time.sleep(120)
""")


def test_a_killed_caller_s_pooled_files_are_removed(
        fresh_cluster: Callable[..., gpufn.Client], tmp_path: Any) -> None:
    c = fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    child = subprocess.Popen([sys.executable, str(script), c.address, c.token],
                             env={**os.environ, "GPUFN_SHM_THRESHOLD": "1MiB"},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert files_of(child.pid)  # its pool keeps a free file
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        wait_for(lambda: files_of(child.pid) == [], 60, "the killed caller's pool files to go")
    finally:
        child.kill()
        child.wait(10)


@gpufn.gpu(retries=1)
def die_once(t: torch.Tensor, mark: str) -> float:
    """The first run kills its own worker with the argument mapped; the retry returns."""
    if not os.path.exists(mark):
        with open(mark, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return float(t[0])


def test_a_worker_that_died_with_the_argument_mapped_leaves_no_file(
        fresh_cluster: Callable[..., gpufn.Client], tmp_path: Any) -> None:
    fresh_cluster(GPUFN_SHM_THRESHOLD="1MiB", GPUFN_CPU_DEVICES=1)
    x = torch.full((2 * MiB,), 3.0)
    call = die_once.spawn(x, str(tmp_path / "mark"))
    assert call.get(timeout=60) == 3.0  # the retry read the same file
    meta: Any = call._future.result().meta
    assert meta.attempts == 2 and meta.shm_freed  # the retry's worker let go of it, but ...
    assert left() == [] and shm.pool().free_names() == []  # ... the first one mapped it
