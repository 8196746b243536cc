"""What a store says when it cannot write its file: `StateWriteError`, naming the state
directory ("no space left on DIR" for a full disk), and a warning said once per outage.

A write that fails fails its request with this error (a deploy, a token change); writes
off the call path (usage, logs, kept results) keep what they could not write in memory
and try again, saying so once when it starts failing and once when it works again.
"""

from __future__ import annotations

import errno
import logging
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpufn.exceptions import GpufnError

log = logging.getLogger("gpufn.scheduler")


class StateWriteError(GpufnError):
    """A state file could not be written (a full disk, an I/O error)."""


def is_full(path: Path, e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(e, sqlite3.Error) and "full" in str(e):
        return True
    try:
        return shutil.disk_usage(path.parent).free == 0
    except OSError:
        return False


def write_error(path: Path, e: BaseException) -> StateWriteError:
    """The error a request fails with when `path` could not be written."""
    if is_full(path, e):
        return StateWriteError(
            f"no space left on {path.parent} ({path.name} could not be written: {e}); "
            "free space there and try again")
    return StateWriteError(f"could not write {path} ({type(e).__name__}: {e}); check the "
                           "state directory's disk (`gpufn state check`) and try again")


class OnceLog:
    """A write that fails again and again is said once, and once when it works again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing: str | None = None

    def failed(self, e: BaseException, keeping: str) -> None:
        if self.failing is None:
            self.failing = str(e)
            log.warning("%s could not be written: %s; %s, and tried again every second "
                        "(said once)", self.what, e, keeping)

    def worked(self) -> None:
        if self.failing is not None:
            log.warning("%s written again (it had failed: %s)", self.what, self.failing)
            self.failing = None


@contextmanager
def transaction(db: sqlite3.Connection, lock: threading.Lock,
                path: Path) -> Iterator[sqlite3.Cursor]:
    """One write transaction on a store's file; a failed write raises `StateWriteError`
    naming `path`, and nothing of it is written."""
    with lock:
        cur = db.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
            yield cur
            cur.execute("COMMIT")
        except BaseException as e:
            if db.in_transaction:  # sqlite may have rolled back already (SQLITE_FULL)
                cur.execute("ROLLBACK")
            if isinstance(e, (OSError, sqlite3.Error)):
                raise write_error(path, e) from None
            raise
