"""A pid's liveness and identity as Linux's /proc shows them: whether it runs (a zombie
does not), when it started, and whether a pid is still the process that started then.
Pure reads, no threads or signals, so every room (shared memory's sweep too) uses them."""

from __future__ import annotations

import os


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
