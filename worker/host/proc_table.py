"""This host's processes as Linux's /proc shows them: a process's parent, session and
resident bytes, the children one thread started, a process tree, and signals to a set.

The supervisor reads it to watch its workers' memory (worker/host/memory_watch.py) and to
stop what a replaced worker left running; the executor, to stop what a call left behind
(worker/host/children.py). Every read tolerates a process that is gone by the time it is read.
Elsewhere than Linux it sees nothing (empty answers), and nothing is watched.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
HAS_PROC = os.path.isdir("/proc/self/task")


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    pgrp: int
    session: int
    rss: int  # resident bytes (0 for a zombie)


def _parse_stat(pid: int, data: bytes) -> Proc | None:
    # "pid (comm) state ppid pgrp session ... rss ...": comm may hold spaces and ")".
    rest = data.rsplit(b")", 1)[-1].split()
    if len(rest) < 22:
        return None
    zombie = rest[0] in (b"Z", b"X")
    return Proc(pid, int(rest[1]), int(rest[2]), int(rest[3]), 0 if zombie else int(rest[21]) * PAGE)


def read(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return _parse_stat(pid, f.read())
    except (OSError, ValueError):
        return None


def snapshot() -> list[Proc]:
    """Every process on the host (those we may read)."""
    if not HAS_PROC:
        return []
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read(int(name))
            if proc is not None:
                out.append(proc)
    return out


def in_session(session: int) -> list[int]:
    """The pids of the processes in a session (a worker is its session's leader)."""
    return [p.pid for p in snapshot() if p.session == session]


def pss(pid: int) -> int | None:
    """Proportional resident bytes: pages shared with other processes (a forked child and
    its parent) counted once in all. None if unreadable (old kernels, a gone process)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Resident:
    """A process's resident bytes, read again cheaply (its statm stays open)."""

    __slots__ = ("fd", "pid")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)

    def bytes(self) -> int:
        """0 once the process is gone."""
        try:
            return int(os.pread(self.fd, 128, 0).split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def thread_children(tid: int) -> list[int]:
    """The processes thread `tid` of this process started that still exist (zombies too)."""
    try:
        with open(f"/proc/self/task/{tid}/children", "rb") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def children(pid: int) -> list[int]:
    """The processes any thread of `pid` started that still exist."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def tree(roots: list[int]) -> list[int]:
    """`roots` and every process below them, parents first."""
    seen: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.append(pid)
        todo += children(pid)
    return seen


def signal_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def host_memory_limit() -> int:
    """The bytes this host lets us use: its RAM, or our cgroup's memory limit if lower
    (as Dask's `distributed.system.memory_limit` reads it)."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * PAGE
    except (ValueError, OSError, AttributeError):
        limit = 0
    for path in _cgroup_limit_files():
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (limit or 2**62):
            limit = int(text)
    return limit


def _cgroup_limit_files() -> list[str]:
    files = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                hid, ctrl, path = line.strip().split(":", 2)
                if hid == "0" and path not in ("", "/"):  # cgroup v2: our own folder
                    files.append(f"/sys/fs/cgroup{path}/memory.max")
                elif "memory" in ctrl.split(",") and path not in ("", "/"):
                    files.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    return files


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where unreadable)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
