"""The backups the head keeps of its state files, in `<state dir>/backups/` (0700, each
copy 0600): a copy of `deployments.sqlite` (sqlite's online backup API, consistent while
the scheduler writes) after each change of the apps, and of `users.json` after each
change of the users; the newest `KEEP` of each. `gpufn state restore` puts the newest
good one back when the file itself is damaged (docs/reliability.md, "A damaged state file").
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from gpufn.net.private_files import private_dir

FOLDER = "backups"
KEEP = 3


def folder(state_dir: Path) -> Path:
    return state_dir / FOLDER


def copies(path: Path) -> list[Path]:
    """The backups of the state file `path`, newest first."""
    d = folder(path.parent)
    try:
        found = [f for f in d.iterdir() if f.name.startswith(path.name + ".")
                 and f.name.rsplit(".", 1)[1].isdigit()]
    except OSError:
        return []
    return sorted(found, key=lambda f: int(f.name.rsplit(".", 1)[1]), reverse=True)


def _target(path: Path) -> tuple[Path, Path]:
    d = private_dir(folder(path.parent))
    stamp = time.time_ns() // 1_000
    final = d / f"{path.name}.{stamp}"
    return final, d / f".{final.name}.{os.getpid()}.tmp"


def _rotate(path: Path) -> None:
    for old in copies(path)[KEEP:]:
        old.unlink(missing_ok=True)


def backup_sqlite(db: sqlite3.Connection, path: Path) -> Path:
    """A consistent copy of the open database `db` (the file `path`); raises OSError or
    sqlite3.Error (nothing partial is left)."""
    final, tmp = _target(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    try:
        dst = sqlite3.connect(str(tmp))
        try:
            db.backup(dst)
        finally:
            dst.close()
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _rotate(path)
    return final


def backup_bytes(data: bytes, path: Path) -> Path:
    """A copy of `data`, the new content of the state file `path`."""
    final, tmp = _target(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _rotate(path)
    return final
