"""Kept results of spawned calls of deployed functions, on disk in the state directory,
so that `FunctionCall.from_id` finds them after the spawner left, and after a restart.

A bounded book: a result is kept `retention` seconds after its call ended (24 h by
default, GPUFN_RESULT_RETENTION), and the book holds at most `max_results` results and
`max_bytes` of payload (GPUFN_RESULT_STORE_MAX, 4 GiB by default); the oldest leave
first. Each record names its owner (the caller's user), so that only that user reads it.

It also holds the spawned calls of deployed functions that have not ended (`DetachedCall`:
what admits one again), so that a restarted scheduler runs them to their end although no
client resubmits them; a call's row leaves in the transaction that stores its Result.

Writes go to a thread of their own (a large result must not stall the scheduler); until
written, a record is served from memory. The file is sqlite (WAL), 0600 in a 0700 folder,
opened on first use: a scheduler that keeps nothing creates no file. Payload frames are
stored opaque, in chunks (sqlite's blobs are bounded), and never unpickled here.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufn.net.private_files import open_private
from gpufn.scheduler.stores.disk import OnceLog
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")

RETENTION_S = 24 * 3600.0
MAX_RESULTS = 100_000
MAX_BYTES = 4 * 2**30
CHUNK = 256 * 2**20  # bytes per stored piece of a frame

SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, function TEXT NOT NULL, ended REAL NOT NULL,
    nbytes INTEGER NOT NULL, tag BLOB NOT NULL, header BLOB NOT NULL, nframes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS results_by_end ON results (ended);
CREATE TABLE IF NOT EXISTS frames (
    id TEXT NOT NULL, frame INTEGER NOT NULL, piece INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (id, frame, piece)
);
CREATE TABLE IF NOT EXISTS calls (
    id TEXT PRIMARY KEY, function_id TEXT NOT NULL, owner TEXT NOT NULL,
    submitted REAL NOT NULL, spec TEXT NOT NULL, nframes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS call_frames (
    id TEXT NOT NULL, frame INTEGER NOT NULL, piece INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (id, frame, piece)
);
"""


def _put_frames(cur: sqlite3.Cursor, table: str, rid: str, frames: Any) -> None:
    for i, frame in enumerate(frames):
        view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
        for piece, at in enumerate(range(0, max(1, view.nbytes), CHUNK)):
            cur.execute(f"INSERT INTO {table} VALUES (?, ?, ?, ?)",
                        (rid, i, piece, bytes(view[at:at + CHUNK])))


def _get_frames(db: sqlite3.Connection, table: str, rid: str, nframes: int) -> list[bytes]:
    pieces: list[list[bytes]] = [[] for _ in range(nframes)]
    for frame, data in db.execute(
            f"SELECT frame, data FROM {table} WHERE id=? ORDER BY frame, piece",
            (rid,)):
        pieces[frame].append(bytes(data))
    return [b"".join(ps) for ps in pieces]


def nbytes(frames: tuple[Any, ...]) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes
               for f in frames)


@dataclass(frozen=True, slots=True)
class KeptResult:
    """A finished call's Result, who may read it, and when it ended (wall clock)."""

    result: p.Result
    owner: str  # the caller's user (Invocation.user); only that user reads it
    function: str
    ended: float

    @property
    def nbytes(self) -> int:
        return nbytes(self.result.frames)


@dataclass(frozen=True, slots=True)
class DetachedCall:
    """A spawned call of a deployed function that has not ended, as it was admitted: what
    a restarted scheduler needs to admit it again (its spawner may be gone)."""

    invocation_id: str
    function_id: str  # the deployed function's own id: the version that admitted it
    owner: str  # its user
    submitted: float  # wall clock
    spec: dict[str, Any]  # as admitted (its options and its user's limits applied)
    frames: tuple[Any, ...]  # the Submit's payload (the pickled arguments), never unpickled


@dataclass(frozen=True, slots=True)
class _Entry:
    owner: str
    ended: float
    nbytes: int


class KeptResults:
    """The book: an index in memory (id -> owner, end, size), the records in sqlite."""

    def __init__(self, path: Path | str | None, retention: float = RETENTION_S,
                 max_results: int = MAX_RESULTS, max_bytes: int = MAX_BYTES) -> None:
        self.path = Path(path) if path else None
        self.retention = retention
        self.max_results = max_results
        self.max_bytes = max_bytes
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._pending: dict[str, KeptResult] = {}  # not written yet: served from here
        self._memory: dict[str, KeptResult] = {}  # no file: the records themselves
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._writes: queue.Queue[tuple[str, Any] | None] | None = None
        self._writer: threading.Thread | None = None
        self._failing = OnceLog(f"kept results ({self.path})")
        if self.path is not None and self.path.exists():
            self._load_index()

    @classmethod
    def in_state_dir(cls, state_dir: str, retention: float = RETENTION_S,
                     max_bytes: int = MAX_BYTES) -> KeptResults:
        return cls(Path(state_dir) / "results.sqlite" if state_dir else None, retention,
                   MAX_RESULTS, max_bytes)

    # ------------------------------------------------------------------ the database

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        open_private(self.path)
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return db

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _load_index(self) -> None:
        rows = self._db.execute("SELECT id, owner, ended, nbytes FROM results ORDER BY ended")
        for rid, owner, ended, size in rows.fetchall():
            self._index[rid] = _Entry(owner, ended, size)
            self._bytes += size

    def _start_writer(self) -> queue.Queue[tuple[str, Any] | None]:
        if self._writes is None:
            self._writes = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="gpufn-kept-results",
                                            daemon=True)
            self._writer.start()
        return self._writes

    def _write_loop(self) -> None:
        assert self._writes is not None
        db = self._connect()  # its own connection: WAL lets the scheduler read meanwhile
        while True:
            job = self._writes.get()
            if job is None:
                db.close()
                return
            kind, arg = job
            try:
                if kind == "put":
                    self._insert(db, arg)
                elif kind == "calls":
                    self._save_calls(db, *arg)
                else:
                    self._delete(db, arg)
            except (OSError, sqlite3.Error) as e:  # a full disk: said once, not fatal
                self._failing.failed(e, "a result not written is served from memory until "
                                     "the scheduler stops")
                if kind == "put":  # kept in memory (the book bounds its bytes)
                    with self._lock:
                        self._memory[arg.result.invocation_id] = arg
            except Exception:
                log.exception("could not %s kept results", {"put": "store", "calls": "note the "
                              "calls of"}.get(kind, "drop"))
            else:
                self._failing.worked()
            finally:
                if kind == "put":
                    with self._lock:
                        self._pending.pop(arg.result.invocation_id, None)

    @staticmethod
    def _insert(db: sqlite3.Connection, rec: KeptResult) -> None:
        frames = p.encode(rec.result)
        tag, header, payload = bytes(frames[0]), bytes(frames[1]), frames[2:]
        cur = db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            rid = rec.result.invocation_id
            cur.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (rid, rec.owner, rec.function, rec.ended, rec.nbytes, tag, header,
                         len(payload)))
            cur.execute("DELETE FROM frames WHERE id=?", (rid,))
            _put_frames(cur, "frames", rid, payload)
            # The call ended and its Result is kept: a restart must not admit it again.
            cur.execute("DELETE FROM calls WHERE id=?", (rid,))
            cur.execute("DELETE FROM call_frames WHERE id=?", (rid,))
            cur.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # sqlite may have rolled back already (SQLITE_FULL)
                cur.execute("ROLLBACK")
            raise

    @staticmethod
    def _save_calls(db: sqlite3.Connection, add: list[DetachedCall], drop: list[str]) -> None:
        cur = db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            for rid in [*drop, *(c.invocation_id for c in add)]:
                cur.execute("DELETE FROM calls WHERE id=?", (rid,))
                cur.execute("DELETE FROM call_frames WHERE id=?", (rid,))
            for c in add:
                cur.execute("INSERT INTO calls VALUES (?, ?, ?, ?, ?, ?)",
                            (c.invocation_id, c.function_id, c.owner, c.submitted,
                             json.dumps(c.spec), len(c.frames)))
                _put_frames(cur, "call_frames", c.invocation_id, c.frames)
            cur.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # sqlite may have rolled back already (SQLITE_FULL)
                cur.execute("ROLLBACK")
            raise

    @staticmethod
    def _delete(db: sqlite3.Connection, ids: list[str]) -> None:
        cur = db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            for rid in ids:
                cur.execute("DELETE FROM results WHERE id=?", (rid,))
                cur.execute("DELETE FROM frames WHERE id=?", (rid,))
            cur.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                cur.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ calls not ended

    def save_calls(self, add: list[DetachedCall], drop: list[str]) -> None:
        """Note calls to admit again after a restart, and forget calls that ended without
        a kept Result; one transaction, written by the writer thread."""
        if self.path is not None and (add or drop):
            self._start_writer().put(("calls", (add, drop)))

    def detached(self) -> list[DetachedCall]:
        """The calls noted and not ended (what the previous scheduler left), oldest first."""
        if self.path is None or not self.path.exists():
            return []
        out = []
        rows = self._db.execute("SELECT id, function_id, owner, submitted, spec, nframes "
                                "FROM calls ORDER BY submitted").fetchall()
        for rid, fid, owner, submitted, spec, nframes in rows:
            out.append(DetachedCall(rid, fid, owner, submitted, json.loads(spec),
                                    tuple(_get_frames(self._db, "call_frames", rid, nframes))))
        return out

    # ------------------------------------------------------------------ the book

    def __contains__(self, invocation_id: str) -> bool:
        return invocation_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, rec: KeptResult) -> bool:
        """Keep a record (False if it alone is larger than the book)."""
        size = rec.nbytes
        if size > self.max_bytes:
            log.warning("[%s] the result of %s (%d bytes) is larger than the kept-results "
                        "book (%d bytes; GPUFN_RESULT_STORE_MAX): not kept",
                        rec.result.invocation_id, rec.function, size, self.max_bytes)
            return False
        rid = rec.result.invocation_id
        self._drop([rid], write=False)
        self._index[rid] = _Entry(rec.owner, rec.ended, size)
        self._bytes += size
        if self.path is None:
            self._memory[rid] = rec
        else:
            with self._lock:
                self._pending[rid] = rec
            self._start_writer().put(("put", rec))
        self._bound()
        return True

    def get(self, invocation_id: str) -> KeptResult | None:
        entry = self._index.get(invocation_id)
        if entry is None:
            return None
        if self.path is None:
            return self._memory.get(invocation_id)
        with self._lock:  # not written yet, or not writable (a full disk)
            rec = self._pending.get(invocation_id) or self._memory.get(invocation_id)
        return rec if rec is not None else self._read(invocation_id)

    def owner(self, invocation_id: str) -> str | None:
        entry = self._index.get(invocation_id)
        return entry.owner if entry is not None else None

    def _read(self, rid: str) -> KeptResult | None:
        row = self._db.execute("SELECT owner, function, ended, tag, header, nframes FROM results "
                               "WHERE id=?", (rid,)).fetchone()
        if row is None:
            return None
        owner, function, ended, tag, header, nframes = row
        frames = [tag, header, *_get_frames(self._db, "frames", rid, nframes)]
        msg = p.decode(frames)
        if not isinstance(msg, p.Result):
            return None
        return KeptResult(msg, owner, function, ended)

    def expire(self, wall: float) -> int:
        """Drop records older than the retention; returns how many left."""
        old = []
        for rid, entry in self._index.items():  # oldest first
            if wall - entry.ended <= self.retention:
                break
            old.append(rid)
        self._drop(old)
        return len(old)

    def _bound(self) -> None:
        over = []
        count, size = len(self._index), self._bytes
        for rid, entry in self._index.items():
            if count <= self.max_results and size <= self.max_bytes:
                break
            over.append(rid)
            count -= 1
            size -= entry.nbytes
        self._drop(over)

    def _drop(self, ids: list[str], write: bool = True) -> None:
        gone = []
        for rid in ids:
            entry = self._index.pop(rid, None)
            if entry is not None:
                self._bytes -= entry.nbytes
                self._memory.pop(rid, None)
                gone.append(rid)
        if gone and write and self.path is not None:
            self._start_writer().put(("drop", gone))

    def close(self) -> None:
        """Finish the writes queued (the scheduler is stopping)."""
        if self._writes is not None and self._writer is not None:
            self._writes.put(None)
            self._writer.join(30)
            self._writes = self._writer = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
