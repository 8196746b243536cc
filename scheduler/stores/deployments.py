"""The deployment store: apps, their versions, functions and code blobs, in sqlite (WAL)
in the scheduler's state directory, so deployments survive a scheduler restart.

It stores opaque pickled frames by content hash and never unpickles them. The file (and
sqlite's -wal and -shm files, which take its mode) is 0600 in a 0700 folder. After each
change of the apps a consistent copy goes to `backups/` (the newest 3, gpufn/net/backups.py)
for `gpufn state restore`. A write that fails (a full disk) raises `StateWriteError`
naming the state directory, and the deploy that asked for it fails with it.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufn.exceptions import GpufnError
from gpufn.net import backups
from gpufn.net.private_files import open_private
from gpufn.scheduler.stores.disk import OnceLog, transaction, write_error
from gpufn.wire.codec import as_bytes

SCHEMA = """
CREATE TABLE IF NOT EXISTS apps (
    name TEXT PRIMARY KEY, current INTEGER NOT NULL, state TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    app TEXT NOT NULL, version INTEGER NOT NULL, created REAL NOT NULL, who TEXT, tag TEXT,
    git_commit TEXT, git_dirty INTEGER, code_hash TEXT NOT NULL, rollback_of INTEGER,
    strategy TEXT, source TEXT, PRIMARY KEY (app, version)
);
CREATE TABLE IF NOT EXISTS functions (
    app TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL, function_id TEXT NOT NULL,
    code_id TEXT NOT NULL, spec TEXT NOT NULL, models TEXT NOT NULL, ncode INTEGER NOT NULL,
    frames TEXT NOT NULL, interface TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (app, version, name)
);
CREATE INDEX IF NOT EXISTS functions_by_id ON functions (function_id);
CREATE TABLE IF NOT EXISTS blobs (hash TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS pins (
    invocation_id TEXT PRIMARY KEY, app TEXT NOT NULL, function_id TEXT NOT NULL
);
"""


@dataclass
class StoredFunction:
    app: str
    version: int
    name: str
    function_id: str
    code_id: str
    spec: dict[str, Any]
    models: list[dict[str, Any]]
    ncode: int  # the first `ncode` frames are the function's code, then the loaders'
    frames: tuple[bytes, ...] = ()
    # How it is called (gpufn/wire/interface.py): parameters, streaming, HTTP roles.
    interface: dict[str, Any] = field(default_factory=dict)


@dataclass
class Version:
    app: str
    version: int
    created: float
    code_hash: str
    who: str = ""
    tag: str = ""
    git_commit: str = ""
    git_dirty: bool = False
    rollback_of: int | None = None
    strategy: str = "rolling"
    source: str = ""
    functions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class App:
    name: str
    current: int
    state: str  # "active" or "stopped"
    created: float




def deployed_function_id(app: str, version: int, base_id: str) -> str:
    """A deployed function's id: one per app version, so each call stays on its version
    (the code id is shared, so workers do not load unchanged code again)."""
    h = hashlib.blake2b(f"{app}\0{version}\0{base_id}".encode(), digest_size=12).hexdigest()
    return f"d{h}"


class DeploymentStore:
    """The apps' versions in one sqlite file (":memory:" for none), opened on first use: a
    scheduler that deploys nothing creates no file."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._memory = str(path) == ":memory:"
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._backups = OnceLog(f"the backup of {self.path}")
        self._unpins = OnceLog(f"a call's version binding in {self.path}")

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            db = None
            try:
                if not self._memory:
                    open_private(self.path)
                db = sqlite3.connect(":memory:" if self._memory else str(self.path),
                                     check_same_thread=False, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(SCHEMA)
                columns = {r[1] for r in db.execute("PRAGMA table_info(functions)")}
                if "interface" not in columns:  # written before interfaces were recorded
                    db.execute("ALTER TABLE functions ADD COLUMN interface TEXT NOT NULL "
                               "DEFAULT '{}'")
            except (OSError, sqlite3.Error) as e:  # a full disk: the file cannot be made
                if db is not None:
                    db.close()
                raise write_error(self.path, e) from None
            self._conn = db
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction; a failed write raises `StateWriteError` (rolled back)."""
        with transaction(self._db, self._lock, self.path) as cur:
            yield cur

    def _backup(self) -> None:
        """A copy for `gpufn state restore`; one that fails is said, not fatal (the
        change itself is written)."""
        if self._memory:
            return
        try:
            backups.backup_sqlite(self._db, self.path)
        except (OSError, sqlite3.Error) as e:
            self._backups.failed(e, "the previous backups stay")
        else:
            self._backups.worked()

    @classmethod
    def in_state_dir(cls, state_dir: str) -> DeploymentStore:
        """The store of a scheduler whose state lives in `state_dir` ("" for memory only)."""
        return cls(Path(state_dir) / "deployments.sqlite" if state_dir else ":memory:")

    def exists(self) -> bool:
        """Whether any app may be stored (the file is open or exists)."""
        return self._conn is not None or (not self._memory and self.path.exists())

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def db_mode(self) -> str:
        """The journal mode ("wal" on a file)."""
        return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    # ------------------------------------------------------------------ reads

    def apps(self) -> list[App]:
        rows = self._db.execute("SELECT name, current, state, created FROM apps ORDER BY name")
        return [App(*r) for r in rows]

    def app(self, name: str) -> App | None:
        r = self._db.execute("SELECT name, current, state, created FROM apps WHERE name=?",
                             (name,)).fetchone()
        return App(*r) if r else None

    def versions(self, app: str) -> list[Version]:
        rows = self._db.execute(
            "SELECT app, version, created, code_hash, who, tag, git_commit, git_dirty, "
            "rollback_of, strategy, source FROM versions WHERE app=? ORDER BY version", (app,))
        out = []
        for r in rows.fetchall():
            v = Version(r[0], r[1], r[2], r[3], r[4] or "", r[5] or "", r[6] or "", bool(r[7]),
                        r[8], r[9] or "rolling", r[10] or "")
            v.functions = [n for (n,) in self._db.execute(
                "SELECT name FROM functions WHERE app=? AND version=? ORDER BY name",
                (app, v.version))]
            out.append(v)
        return out

    def version(self, app: str, version: int) -> Version | None:
        return next((v for v in self.versions(app) if v.version == version), None)

    def functions(self, app: str, version: int, with_frames: bool = False) -> list[StoredFunction]:
        rows = self._db.execute(
            "SELECT app, version, name, function_id, code_id, spec, models, ncode, frames, "
            "interface FROM functions WHERE app=? AND version=? ORDER BY name", (app, version))
        return [self._function(r, with_frames) for r in rows.fetchall()]

    def function_by_id(self, function_id: str) -> StoredFunction | None:
        r = self._db.execute(
            "SELECT app, version, name, function_id, code_id, spec, models, ncode, frames, "
            "interface FROM functions WHERE function_id=?", (function_id,)).fetchone()
        return self._function(r, True) if r else None

    def _function(self, r: Sequence[Any], with_frames: bool) -> StoredFunction:
        fn = StoredFunction(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), json.loads(r[6]), r[7],
                            interface=json.loads(r[9] or "{}"))
        if with_frames:
            hashes = json.loads(r[8])
            blobs = dict(self._db.execute(
                f"SELECT hash, data FROM blobs WHERE hash IN ({','.join('?' * len(hashes))})",
                hashes).fetchall()) if hashes else {}
            fn.frames = tuple(bytes(blobs[h]) for h in hashes)
        return fn

    # ------------------------------------------------------------------ writes

    def add_version(self, v: Version, functions: list[StoredFunction]) -> None:
        """Store a version and its functions (frames as blobs) and make it current."""
        with self._transaction() as cur:
            for fn in functions:
                hashes = []
                for frame in fn.frames:
                    data = as_bytes(frame)
                    h = hashlib.blake2b(data, digest_size=20).hexdigest()
                    cur.execute("INSERT OR IGNORE INTO blobs (hash, data) VALUES (?, ?)",
                                (h, data))
                    hashes.append(h)
                cur.execute(
                    "INSERT INTO functions (app, version, name, function_id, code_id, spec, "
                    "models, ncode, frames, interface) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (v.app, v.version, fn.name, fn.function_id, fn.code_id,
                     json.dumps(fn.spec), json.dumps(fn.models), fn.ncode, json.dumps(hashes),
                     json.dumps(fn.interface)))
            cur.execute(
                "INSERT INTO versions (app, version, created, code_hash, who, tag, git_commit, "
                "git_dirty, rollback_of, strategy, source) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (v.app, v.version, v.created, v.code_hash, v.who, v.tag, v.git_commit,
                 int(v.git_dirty), v.rollback_of, v.strategy, v.source))
            cur.execute(
                "INSERT INTO apps (name, current, state, created) VALUES (?, ?, 'active', ?) "
                "ON CONFLICT(name) DO UPDATE SET current=excluded.current, state='active'",
                (v.app, v.version, v.created))
        self._backup()

    def pins(self) -> dict[str, tuple[str, str]]:
        """invocation id -> (app, deployed function id): the calls in flight when their
        app's version changed (or it stopped), bound to the version that admitted them."""
        if not self.exists():
            return {}
        rows = self._db.execute("SELECT invocation_id, app, function_id FROM pins").fetchall()
        return {i: (a, f) for i, a, f in rows}

    def set_pins(self, app: str, pins: dict[str, str]) -> None:
        """The app's pinned calls are now exactly `pins` (the others ended)."""
        with self._transaction() as cur:
            cur.execute("DELETE FROM pins WHERE app=?", (app,))
            cur.executemany("INSERT OR REPLACE INTO pins (invocation_id, app, function_id) "
                            "VALUES (?, ?, ?)", [(i, app, f) for i, f in pins.items()])

    def unpin(self, invocation_id: str) -> None:
        """The call is bound again (it was resubmitted). On a call's path, so a write
        that fails is said once, not raised: a binding left on disk names a call that
        ended, and no new call has its id."""
        try:
            with self._transaction() as cur:
                cur.execute("DELETE FROM pins WHERE invocation_id=?", (invocation_id,))
        except GpufnError as e:
            self._unpins.failed(e, "the binding stays on disk")
        else:
            self._unpins.worked()

    def set_state(self, app: str, state: str) -> None:
        with self._transaction() as cur:
            cur.execute("UPDATE apps SET state=? WHERE name=?", (state, app))
        self._backup()

    def next_version(self, app: str) -> int:
        (n,) = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM versions WHERE app=?",
                                (app,)).fetchone()
        return int(n) + 1
