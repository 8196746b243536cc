"""The operator's books on disk: usage per minute, the recent log lines per function and
the devices seen lately, in sqlite (WAL, 0600) in the scheduler's state directory, so
that `gpufn usage` and `gpufn logs` after a restart include what ran before it, and the
next scheduler knows which workers to wait for.

The shell passes it in (like the `DeploymentStore`); the operations desk writes to it
once a second at most, never on a call's path. Times are wall-clock seconds. A write
that fails (a full disk) raises `StateWriteError`; the desk keeps what it could not
write in memory and tries again.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufn.net.private_files import private_dir, private_file
from gpufn.scheduler.stores.disk import transaction, write_error

FILE = "ops.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    minute INTEGER NOT NULL, app TEXT NOT NULL, function TEXT NOT NULL,
    version INTEGER NOT NULL, user TEXT NOT NULL, calls INTEGER NOT NULL,
    device_seconds REAL NOT NULL, wait_seconds REAL NOT NULL, outcomes TEXT NOT NULL,
    PRIMARY KEY (minute, app, function, version, user)
);
CREATE TABLE IF NOT EXISTS logs (
    seq INTEGER PRIMARY KEY, at REAL NOT NULL, app TEXT NOT NULL, function TEXT NOT NULL,
    invocation_id TEXT NOT NULL, stream TEXT NOT NULL, text TEXT NOT NULL,
    user TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS logs_by_function ON logs (app, function, seq);
CREATE TABLE IF NOT EXISTS devices (key TEXT PRIMARY KEY, seen REAL NOT NULL);
"""
# Devices seen within this long of the latest one are expected back after a restart.
EXPECTED_WITHIN_S = 600.0


@dataclass(slots=True, frozen=True)
class UsageRow:
    minute: int
    app: str
    function: str
    version: int
    user: str
    calls: int
    device_seconds: float
    wait_seconds: float
    outcomes: dict[str, int]


@dataclass(slots=True, frozen=True)
class LogRow:
    seq: int
    at: float
    app: str
    function: str
    invocation_id: str
    stream: str
    text: str
    user: str = ""  # whose call printed it: only they and an admin read it


class OpsStore:
    """One sqlite file (":memory:" for none: then nothing is written and `durable` is
    False), opened on first use."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.durable = str(path) != ":memory:"
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @classmethod
    def in_state_dir(cls, state_dir: str) -> OpsStore:
        return cls(Path(state_dir) / FILE if state_dir else ":memory:")

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            db = None
            try:
                if self.durable:
                    # Made (or tightened to) 0600 in a 0700 folder before sqlite opens it;
                    # its -wal and -shm files take its mode.
                    private_dir(self.path.parent)
                    private_file(self.path)
                db = sqlite3.connect(str(self.path) if self.durable else ":memory:",
                                     check_same_thread=False, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(SCHEMA)
            except (OSError, sqlite3.Error) as e:  # a full disk: the file cannot be made
                if db is not None:
                    db.close()
                raise write_error(self.path, e) from None
            self._conn = db
        return self._conn

    def exists(self) -> bool:
        return self._conn is not None or (self.durable and self.path.exists())

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _write(self, statements: Iterable[tuple[str, Iterable[Any]]]) -> None:
        """Run (sql, rows) pairs (executemany) in one transaction (`StateWriteError` if
        it cannot be written; nothing of it is then)."""
        with transaction(self._db, self._lock, self.path) as cur:
            for sql, rows in statements:
                cur.executemany(sql, rows)

    # ------------------------------------------------------------------ usage

    def usage(self, since_minute: int) -> list[UsageRow]:
        if not self.exists():
            return []
        rows = self._db.execute(
            "SELECT minute, app, function, version, user, calls, device_seconds, wait_seconds,"
            " outcomes FROM usage WHERE minute >= ? ORDER BY minute", (since_minute,))
        return [UsageRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]))
                for r in rows.fetchall()]

    def save_usage(self, rows: list[UsageRow], prune: tuple[int, int] | None = None) -> None:
        """Upsert minute totals (their values whole, not increments: saving twice is
        harmless). With `prune` (oldest minute, max rows): drop older minutes and keep at
        most that many rows, the oldest minutes going first."""
        statements: list[tuple[str, Iterable[Any]]] = [
            ("INSERT OR REPLACE INTO usage (minute, app, function, version, user, calls, "
             "device_seconds, wait_seconds, outcomes) VALUES (?,?,?,?,?,?,?,?,?)",
             [(r.minute, r.app, r.function, r.version, r.user, r.calls, r.device_seconds,
               r.wait_seconds, json.dumps(r.outcomes, sort_keys=True)) for r in rows])]
        if prune is not None:
            statements += [
                ("DELETE FROM usage WHERE minute < ?", [(prune[0],)]),
                ("DELETE FROM usage WHERE rowid IN (SELECT rowid FROM usage ORDER BY minute "
                 "DESC LIMIT -1 OFFSET ?)", [(prune[1],)])]
        self._write(statements)

    # ------------------------------------------------------------------ logs

    def logs(self, since: float) -> list[LogRow]:
        if not self.exists():
            return []
        rows = self._db.execute("SELECT seq, at, app, function, invocation_id, stream, text, "
                                "user FROM logs WHERE at >= ? ORDER BY seq", (since,))
        return [LogRow(*r) for r in rows.fetchall()]

    def save_logs(self, lines: list[LogRow], oldest: dict[tuple[str, str], int],
                  dropped: list[tuple[str, str]], before: float | None = None) -> None:
        """Append lines; per function, drop its lines before its oldest kept seq; drop
        the functions no longer kept; with `before`, every line older than that."""
        statements: list[tuple[str, Iterable[Any]]] = [
            ("INSERT OR REPLACE INTO logs (seq, at, app, function, invocation_id, stream, text,"
             " user) VALUES (?,?,?,?,?,?,?,?)",
             [(ln.seq, ln.at, ln.app, ln.function, ln.invocation_id, ln.stream, ln.text,
               ln.user) for ln in lines]),
            ("DELETE FROM logs WHERE app=? AND function=? AND seq < ?",
             [(a, f, seq) for (a, f), seq in oldest.items()]),
            ("DELETE FROM logs WHERE app=? AND function=?", dropped)]
        if before is not None:
            statements.append(("DELETE FROM logs WHERE at < ?", [(before,)]))
        self._write(statements)

    # ------------------------------------------------------------------ devices

    def expected_devices(self) -> set[str]:
        """The devices seen lately before this scheduler started (within
        `EXPECTED_WITHIN_S` of the last one seen): the workers a restart waits for."""
        if not self.exists():
            return set()
        rows = self._db.execute("SELECT key, seen FROM devices").fetchall()
        if not rows:
            return set()
        latest = max(seen for _, seen in rows)
        return {key for key, seen in rows if seen >= latest - EXPECTED_WITHIN_S}

    def saw_devices(self, keys: list[str], gone: list[str], wall: float) -> None:
        self._write([("INSERT OR REPLACE INTO devices (key, seen) VALUES (?, ?)",
                      [(k, wall) for k in keys]),
                     ("DELETE FROM devices WHERE key = ?", [(k,) for k in gone])])
