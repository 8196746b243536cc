"""Files only their owner may read: the state directory's databases and the workers'
logs are created 0600 in 0700 folders (a file or folder made by an older version, or
under a loose umask, is tightened when gpufn opens it)."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(d: Path) -> Path:
    """Make `d` (and its parents) if needed; `d` itself becomes 0700 when we own it."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if d.stat().st_uid == os.getuid() and d.stat().st_mode & 0o077:
            os.chmod(d, 0o700)  # mkdir's mode is masked by the umask; an old folder keeps its own
    except OSError:
        pass  # not ours to change (a shared folder named by hand)
    return d


def private_file(path: Path) -> Path:
    """Create `path` empty if missing; it is 0600 either way (`sqlite3` and `open` would
    create it 0644 under the usual umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that existed already
    finally:
        os.close(fd)
    return path


def open_private_append(path: Path) -> int:
    """A descriptor appending to `path`, created (or tightened to) 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def open_private(path: Path) -> None:
    """Before sqlite opens `path`: its folder 0700, the file and its -wal/-shm 0600
    (sqlite creates those with the main file's mode; older ones are tightened here)."""
    private_dir(path.parent)
    private_file(path)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            private_file(side)
