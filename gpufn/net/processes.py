"""Process plumbing: is a pid alive (and still the same process), follow a parent's exit
(a watch thread, or Linux's parent-death signal)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie is not; another user's process is)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot; Linux), None if there is no such live
    process: a pid and its start time name one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[19])  # field 22 of stat; the list starts at field 3


def same(pid: int, started: int | None) -> bool:
    """Whether `pid` is alive and is the process that started at `started`."""
    return pid > 0 and started is not None and start_time(pid) == started


def watch_parent(parent_pid: int, on_exit: Any) -> None:
    """Call `on_exit` when the process that started us is gone (we were re-parented)."""
    if parent_pid <= 0:
        return

    def loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                on_exit()
                return
            threading.Event().wait(0.5)

    threading.Thread(target=loop, name="gpufn-parent-watch", daemon=True).start()


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Linux: deliver `sig` to this process when its parent thread exits (preexec_fn)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:
        pass
