"""Processes a call leaves behind are stopped when it ends.

Linux lists the children each thread started (/proc/self/task/TID/children), so the
executor knows which processes a call's thread started during the call: at its end, those
still running (and everything below them) get SIGTERM, then SIGKILL after `GRACE_S`, and
are reaped. A call that wants a process to outlive it belongs in a model loader
(`@gpufn.model`): loaders run on the model thread, whose children stay. What escapes
this (a grandchild whose parent exited, a thread the call started itself) is stopped
with the worker's session when the worker is replaced (see worker/supervisor/daemon.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from gpufn.worker.host import proc_table

GRACE_S = 1.0  # between SIGTERM and SIGKILL


class ThreadChildren:
    """The children of the calling thread, read through a descriptor kept open per
    thread (a pread costs microseconds; opening the file each time costs more)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def now(self) -> frozenset[int]:
        if not proc_table.HAS_PROC:
            return frozenset()
        fd = getattr(self._local, "fd", None)
        if fd is None:
            try:
                fd = self._local.fd = os.open(
                    f"/proc/self/task/{threading.get_native_id()}/children", os.O_RDONLY)
            except OSError:
                return frozenset()
        try:
            data = os.pread(fd, 65536, 0)
        except OSError:
            return frozenset()
        return frozenset(int(x) for x in data.split()) if data else frozenset()


def stop(pids: list[int], grace: float = GRACE_S) -> list[int]:
    """SIGTERM `pids` and everything below them, SIGKILL what still runs after `grace`,
    and reap those that are our children. Returns the pids signalled."""
    victims = proc_table.tree(pids)
    proc_table.signal_all(victims, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = victims
    while left and time.monotonic() < deadline:
        _reap(left)
        left = [p for p in left if _running(p)]
        if left:
            time.sleep(0.02)
    if left:
        proc_table.signal_all(proc_table.tree(left), signal.SIGKILL)
    end = time.monotonic() + 2.0
    while time.monotonic() < end and _reap(pids):
        time.sleep(0.01)
    return victims


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _reap(pids: list[int]) -> bool:
    """Reap those of `pids` that are our exited children; True if some are still ours
    and not reaped yet."""
    waiting = False
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (a grandchild), or reaped already
            continue
        waiting = waiting or done == 0
    return waiting
