"""Host memory (RAM) is watched from outside the worker, as Dask's nanny does: a worker
over its budget (its children's memory included) is stopped and replaced, its call fails
with HostOutOfMemory naming the limit, and nothing else on the host is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import gpufn

from ._waits import wait_for

pytestmark = pytest.mark.timeout(180)

MiB = 2**20
GiB = 2**30


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _workers(c: gpufn.Client) -> dict[str, int]:
    return {d["key"]: d["pid"] for d in c.status()["devices"] if d.get("pid")}


@gpufn.gpu(retries=2)
def grow(nbytes: int, marker: str) -> int:
    with open(marker, "a") as f:  # one line per run: the call must not run again
        f.write(f"{os.getpid()}\n")
    block = bytearray(nbytes)  # zero-filled: every page is touched
    time.sleep(30)
    return len(block)


@gpufn.gpu
def grow_in_a_child(nbytes: int, pidfile: str) -> int:
    child = subprocess.Popen([sys.executable, "-c",
                              f"import time; b = bytearray({nbytes}); time.sleep(60)"])
    Path(pidfile).write_text(str(child.pid))
    return child.wait()


@gpufn.gpu(host_memory="3GiB")
def grow_declared(nbytes: int) -> int:
    block = bytearray(nbytes)
    time.sleep(0.5)  # long enough for several samples
    return len(block)


@gpufn.gpu(host_memory="600MiB")
def grow_past_a_small_declaration(nbytes: int) -> int:
    block = bytearray(nbytes)
    time.sleep(30)
    return len(block)


@gpufn.gpu
def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_worker_over_its_host_budget_is_replaced_and_its_call_fails_typed(
        fresh_cluster: Callable[..., gpufn.Client], tmp_path: Path) -> None:
    c = fresh_cluster(GPUFN_CPU_DEVICES=2, GPUFN_WORKER_HOST_MEMORY="1GiB")
    assert resident.remote() < GiB  # an idle worker fits its budget
    before = _workers(c)
    scheduler = c.cluster.scheduler.pid
    marker = tmp_path / "runs"
    with pytest.raises(gpufn.HostOutOfMemory) as e:
        grow.remote(2 * GiB, str(marker))
    assert isinstance(e.value, gpufn.OutOfMemory)
    text = str(e.value)
    assert "over its limit of 1.00 GiB" in text and "per worker" in text
    assert "--worker-host-memory" in text and "host_memory=" in text  # how to raise it
    assert len(marker.read_text().split()) == 1  # retries=2, yet not run again
    after = wait_for(lambda: (w := _workers(c)) and len(w) == 2 and w, 60, "a new worker")
    changed = [k for k in before if after[k] != before[k]]
    assert len(changed) == 1  # the other worker was not touched
    assert _pid_alive(scheduler) and all(_pid_alive(p) for p in after.values())
    assert resident.remote() < GiB  # the replacement serves


def test_memory_of_a_calls_child_counts_and_the_child_is_stopped(
        fresh_cluster: Callable[..., gpufn.Client], tmp_path: Path) -> None:
    fresh_cluster(GPUFN_CPU_DEVICES=1, GPUFN_WORKER_HOST_MEMORY="1GiB")
    pidfile = tmp_path / "child"
    with pytest.raises(gpufn.HostOutOfMemory, match=r"over its limit of 1\.00 GiB"):
        grow_in_a_child.remote(2 * GiB, str(pidfile))
    child = int(pidfile.read_text())
    wait_for(lambda: not _pid_alive(child), 20, "the call's child to be stopped too")


def test_a_function_declares_its_own_host_memory(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    fresh_cluster(GPUFN_CPU_DEVICES=1, GPUFN_WORKER_HOST_MEMORY="1GiB")
    assert grow_declared.remote(int(1.5 * GiB)) == int(1.5 * GiB)  # over the host's 1 GiB
    with pytest.raises(gpufn.HostOutOfMemory, match="600 MiB its call declared"):
        grow_past_a_small_declaration.remote(800 * MiB)  # under 1 GiB, over its own limit


def test_host_memory_is_validated_at_the_decorator() -> None:
    with pytest.raises(gpufn.InvalidSpec, match="host_memory"):
        gpufn.gpu(host_memory="lots")(resident)
    assert gpufn.gpu(host_memory="2GiB")(resident.local).spec.host_memory == 2 * GiB
    assert resident.with_options(host_memory=GiB).spec.host_memory == GiB


def test_the_cli_refuses_a_bad_budget() -> None:
    proc = subprocess.run([sys.executable, "-m", "gpufn.cli.main", "worker", "--address",
                           "tcp://127.0.0.1:9", "--worker-host-memory", "plenty"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "worker-host-memory" in proc.stderr
