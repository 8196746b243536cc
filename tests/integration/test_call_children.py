"""Processes a call starts and leaves running end with it: stopped when the call ends
(SIGTERM, then SIGKILL), or, for what escapes the call's thread, with the worker's session
when the worker is replaced. Real workers, real `sleep` processes, a real fork."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

import gpufn

from ._waits import wait_for

pytestmark = pytest.mark.timeout(120)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@gpufn.gpu
def start_sleep() -> int:
    return subprocess.Popen(["sleep", "1000"]).pid  # never waited for


@gpufn.gpu
def fork_and_return() -> int:
    pid = os.fork()
    if pid == 0:  # the child: a copy of the worker that would hold its memory
        time.sleep(1000)
        os._exit(0)
    return pid


@gpufn.gpu
def start_stubborn_tree() -> list[int]:
    """A shell that ignores SIGTERM, with a sleep below it."""
    proc = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 1000 & echo $!; wait"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return [proc.pid, int(proc.stdout.readline())]


@gpufn.gpu
def start_from_own_thread() -> int:
    """A process started by a thread the call made and that ended: not the call's own."""
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(subprocess.Popen(["sleep", "1000"]).pid))
    t.start()
    t.join()
    return out[0]


@gpufn.gpu
def wait_for_child() -> int:
    return subprocess.run(["true"]).returncode  # a child the call waited for: fine


@gpufn.gpu
def worker_pid() -> int:
    return os.getpid()


def test_a_sleep_the_call_started_is_stopped_when_it_ends(cluster: gpufn.Client) -> None:
    pid = start_sleep.remote()
    wait_for(lambda: not _running(pid), 20, f"sleep {pid} to be stopped")
    assert wait_for_child.remote() == 0


def test_a_forked_child_is_stopped_when_the_call_ends(cluster: gpufn.Client) -> None:
    pid = fork_and_return.remote()
    wait_for(lambda: not _running(pid), 20, f"forked child {pid} to be stopped")


def test_a_child_ignoring_sigterm_is_killed_with_its_children(cluster: gpufn.Client) -> None:
    shell, sleeper = start_stubborn_tree.remote()
    wait_for(lambda: not _running(shell) and not _running(sleeper), 20,
             "the shell and its sleep to be killed")


def test_what_escapes_the_call_ends_when_the_worker_is_replaced(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    c = fresh_cluster(GPUFN_CPU_DEVICES=1)
    pid = start_from_own_thread.remote()
    time.sleep(0.5)
    assert _running(pid)  # not the call's thread's child: it outlives the call...
    worker = worker_pid.remote()
    os.kill(worker, signal.SIGKILL)  # ...until its worker is replaced
    wait_for(lambda: not _running(pid), 30, f"sleep {pid} to end with its worker")
    wait_for(lambda: any(d.get("pid") not in (None, worker) and d["state"] == "ready"
                         for d in c.status()["devices"]), 60, "a new worker")
    assert worker_pid.remote() != worker


@gpufn.gpu
def start_own_group_from_thread() -> int:
    """A process in a process group of its own (as a shell's job), started by a thread the
    call made: not the call's child, not in the worker's process group, but in its session."""
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(
        subprocess.Popen(["sleep", "1000"], process_group=0).pid))
    t.start()
    t.join()
    return out[0]


def test_a_child_in_its_own_process_group_ends_with_its_worker(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    fresh_cluster(GPUFN_CPU_DEVICES=1)
    pid = start_own_group_from_thread.remote()
    time.sleep(0.5)
    assert _running(pid)
    worker = worker_pid.remote()
    assert os.getpgid(pid) == pid != os.getpgid(worker)  # out of the worker's group
    assert os.getsid(pid) == os.getsid(worker)  # in its session
    try:
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not _running(pid), 30, f"sleep {pid} (own group) to end with its worker")
    finally:
        if _running(pid):  # left behind: the test fails, and leaves nothing running
            os.kill(pid, signal.SIGKILL)


def test_a_stopped_supervisor_leaves_no_child_behind(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    c = fresh_cluster(GPUFN_CPU_DEVICES=1)
    pid = start_from_own_thread.remote()
    assert _running(pid)
    assert c.cluster is not None and c.cluster.supervisor is not None
    c.cluster.supervisor.send_signal(signal.SIGTERM)  # stops its workers and their sessions
    c.cluster.supervisor.wait(30)
    wait_for(lambda: not _running(pid), 30, f"sleep {pid} to end with the supervisor")


def test_a_child_process_of_the_test_itself_is_untouched() -> None:
    """Only what a worker's session holds is stopped: a process of ours outside it runs on."""
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert wait_for_child.remote() == 0
        assert start_sleep.remote() > 0
        time.sleep(0.5)
        assert mine.poll() is None
    finally:
        mine.kill()
        mine.wait()
