"""Same-host big payloads through shared memory: a tensor or bytes of GPUFN_SHM_THRESHOLD
(64 MiB) or more is written once into a file in /dev/shm and only its name travels
through the sockets; the receiver maps the file (zero copies: the tensor is a view of the
mapping) and unlinks it at once, so its memory goes back when the tensor is freed.

Files are named `gpufn-<owner pid>-<random>`, the owner being the caller of the call the
payload belongs to. The sender also unlinks what it made when the call ends (a call
cancelled before a worker read its arguments), and `sweep()` (run by each host's
supervisor) removes the files whose owner died. Used only between processes that share
a host *and* a user (`host_id()`), so the receiver can always open the file.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SHM_DIR = "/dev/shm"
PREFIX = "gpufn-"
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

_host: str | None = None


def host_id() -> str:
    """Who can open this process's shared-memory files: the boot, the host and the user
    ("" where there is no /dev/shm: shared memory is then never used)."""
    global _host
    if _host is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            ok = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
        except OSError:
            boot, ok = "", False
        _host = f"{boot}/{socket.gethostname()}/{os.getuid()}" if ok and boot else ""
    return _host


@dataclass(slots=True)
class Outgoing:
    """Where one payload's big buffers go: files owned by `owner` (the caller's pid), at
    least `threshold` bytes each; `names` collects what was written."""

    owner: int
    threshold: int
    names: list[str] = field(default_factory=list)
    nbytes: int = 0

    def put(self, buf: memoryview) -> str:
        """Copy `buf` (C-contiguous bytes) into a new shared-memory file; its name."""
        name = f"{PREFIX}{self.owner}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            view = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
            os.ftruncate(fd, view.nbytes)
            if view.nbytes:  # one copy, into pages mapped at once (no fault per page)
                with mmap.mmap(fd, view.nbytes, flags=_MAP_FLAGS) as mm:
                    mm[:] = view
        except BaseException:
            os.close(fd)
            release([name])
            raise
        os.close(fd)
        self.names.append(name)
        self.nbytes += view.nbytes
        return name


def take(name: str, nbytes: int) -> mmap.mmap:
    """Map a payload file (read-write, private to this process's view) and unlink it: the
    memory lives as long as the mapping."""
    if os.sep in name or not name.startswith(PREFIX):
        raise ValueError(f"not a gpufn shared-memory name: {name!r}")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS)  # its pages mapped at once
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return mm


def release(names: Iterable[str]) -> None:
    """Remove payload files that no receiver took (already taken ones are gone)."""
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except (FileNotFoundError, NotADirectoryError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_sweep_lock = threading.Lock()


def sweep(owner: int | None = None) -> int:
    """Remove the payload files of dead owners (or, with `owner`, all of that one's);
    how many were removed."""
    n = 0
    with _sweep_lock:
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return 0
        for name in names:
            if not name.startswith(PREFIX):
                continue
            try:
                pid = int(name[len(PREFIX):].split("-", 1)[0])
            except ValueError:
                continue
            if (pid == owner) if owner is not None else not _alive(pid):
                release([name])
                n += 1
    return n


def owned(names: Any) -> list[str]:
    """The names in a Result's `meta.shm` (what a peer said it wrote), checked."""
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and n.startswith(PREFIX) and os.sep not in n]
