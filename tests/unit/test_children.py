"""The processes a call leaves behind (worker/host/children.py): the calling thread's
children read from /proc, stopped with SIGTERM then SIGKILL after the grace, and reaped.
Real processes (`sleep`, a shell that ignores SIGTERM, Python with a SIGTERM handler);
written for the mutants cosmic-ray picked there (scripts/mutants.py --room children)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufn.worker.host import children, proc_table

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not proc_table.HAS_PROC, reason="needs /proc")]


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts: killed and reaped at its end, whatever it did."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        for pid in proc_table.tree([p.pid]):
            try:
                os.kill(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        p.wait()


def reaped(pid: int) -> bool:
    """No child `pid` of ours was left to reap (it was reaped, or was never ours); one
    that was is reaped now."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def state(pid: int) -> str:
    """The process's state letter in /proc ("" when there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def zombie_of(started: list[subprocess.Popen[bytes]]) -> int:
    """A child that has exited and is not reaped yet."""
    p = subprocess.Popen(["true"])
    started.append(p)
    deadline = time.monotonic() + 10
    while state(p.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state(p.pid) == "Z"
    return p.pid


def test_a_thread_s_children_are_the_processes_it_started(
        started: list[subprocess.Popen[bytes]]) -> None:
    tc = children.ThreadChildren()
    before = tc.now()
    mine = subprocess.Popen(["sleep", "100"])
    started.append(mine)
    other: list[subprocess.Popen[bytes]] = []
    made, end = threading.Event(), threading.Event()

    def start_one() -> None:  # and stay (a thread that ends hands its children on)
        other.append(subprocess.Popen(["sleep", "100"]))
        made.set()
        end.wait(30)

    t = threading.Thread(target=start_one)
    t.start()
    try:
        assert made.wait(30)
        started.extend(other)
        now = tc.now()
        assert now - before == {mine.pid}  # not the other thread's
        assert tc.now() == now  # read again (the descriptor kept), the same
        assert all(type(x) is int for x in now)
        mine.kill()
        mine.wait()
        assert tc.now() == before  # reaped: gone from the list
    finally:
        end.set()
        t.join()


def test_a_thread_with_no_children_file_or_an_unreadable_one_has_none(
        monkeypatch: pytest.MonkeyPatch, started: list[subprocess.Popen[bytes]],
        tmp_path: Path) -> None:
    started.append(subprocess.Popen(["sleep", "100"]))
    tc = children.ThreadChildren()
    monkeypatch.setattr(children.threading, "get_native_id", lambda: 2**22 + 7)  # no such task
    assert tc.now() == frozenset()
    monkeypatch.undo()
    fd = os.open(tmp_path, os.O_RDONLY)  # a folder: reading it fails
    try:
        tc._local.fd = fd
        assert tc.now() == frozenset()
    finally:
        os.close(fd)


def test_running_is_false_for_a_zombie_and_a_pid_that_is_gone(
        started: list[subprocess.Popen[bytes]]) -> None:
    p = subprocess.Popen(["sleep", "100"])
    started.append(p)
    assert children._running(p.pid)
    assert children._running(os.getpid())
    z = zombie_of(started)
    assert not children._running(z)
    assert not children._running(2**22 + 7)


def test_reap_reaps_exited_children_past_one_that_is_not_ours(
        started: list[subprocess.Popen[bytes]]) -> None:
    live = subprocess.Popen(["sleep", "100"])
    started.append(live)
    z = zombie_of(started)
    assert children._reap([1, z]) is False  # pid 1 is not ours; the zombie is reaped
    assert reaped(z)
    assert children._reap([1, live.pid]) is True  # still running: waited for
    assert children._reap([live.pid, 1]) is True


def test_a_child_that_ends_on_sigterm_is_stopped_and_reaped_at_once(
        started: list[subprocess.Popen[bytes]]) -> None:
    p = subprocess.Popen(["sleep", "100"])
    started.append(p)
    t0 = time.monotonic()
    assert children.stop([p.pid], grace=10.0) == [p.pid]
    assert time.monotonic() - t0 < 5.0  # not the grace
    assert reaped(p.pid) and not children._running(p.pid)


def test_a_child_gets_the_grace_to_end_on_sigterm_before_sigkill(
        started: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """A child that cleans up for 0.1 s after SIGTERM finishes within a grace of 20 s,
    and stop() returns soon after it ended (it looks every 20 ms), not at the grace."""
    done = tmp_path / "cleaned"
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            "    time.sleep(0.1)\n"
            f"    open({str(done)!r}, 'w').close()\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('ready', flush=True)\n"
            "time.sleep(100)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    t0 = time.monotonic()
    children.stop([p.pid], grace=20.0)
    assert time.monotonic() - t0 < 1.0
    assert done.exists() and reaped(p.pid)


def test_a_tree_ignoring_sigterm_is_killed_after_the_grace_and_reaped(
        started: list[subprocess.Popen[bytes]]) -> None:
    p = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 1000 & echo $!; wait"],
                         stdout=subprocess.PIPE)
    started.append(p)
    assert p.stdout is not None
    below = int(p.stdout.readline())
    t0, cpu = time.monotonic(), time.process_time()
    victims = children.stop([p.pid])
    took, spent = time.monotonic() - t0, time.process_time() - cpu
    assert victims == [p.pid, below]
    assert 1.0 <= took < 1.9  # GRACE_S (1 s), then SIGKILL, not the reap's 2 s bound
    assert spent < 0.1  # it sleeps between looks, it does not spin through the grace
    assert reaped(p.pid)
    deadline = time.monotonic() + 10  # the sleep below, no child of ours, dies on its own
    while children._running(below) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not children._running(below)


def test_a_killed_child_still_freeing_its_memory_is_waited_for_and_reaped(
        started: list[subprocess.Popen[bytes]]) -> None:
    """A child with 400 MiB to free takes a while to die after SIGKILL: stop() waits
    for it (looking every 10 ms, not for seconds) and reaps it before it returns."""
    code = ("import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "hold = bytearray(400 * 2**20)\n"
            "hold[::4096] = b'x' * len(range(0, len(hold), 4096))\n"
            "print('ready', flush=True)\n"
            "time.sleep(100)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    t0 = time.monotonic()
    assert children.stop([p.pid], grace=0.2) == [p.pid]
    assert time.monotonic() - t0 < 1.0
    assert reaped(p.pid) and state(p.pid) == ""
