"""A full or failing state disk without processes (issue 29, defect 4): a store's failed
write is a `StateWriteError` naming the state dir and leaves nothing half-written; the ops
desk keeps usage and log lines it could not write and says so once; a deploy that cannot
be written is answered with the error."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gpufn.scheduler.books.usage import Key
from gpufn.scheduler.desks.ops import OpsDesk
from gpufn.scheduler.stores import disk
from gpufn.scheduler.stores.deployments import DeploymentStore, StoredFunction, Version
from gpufn.scheduler.stores.ops import OpsStore

pytestmark = pytest.mark.timeout(30)


class _Core:
    """What the ops desk reads of the core: the wall clock and the devices."""

    devices: dict[str, Any] = {}

    @staticmethod
    def wall(now: float) -> float:
        return 1_000_000.0 + now


class _FullStore(OpsStore):
    """An ops store whose disk is full until `full` is cleared."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.full = True

    def _write(self, statements: Any) -> None:
        if self.full:
            raise disk.write_error(self.path, sqlite3.OperationalError(
                "database or disk is full"))
        super()._write(statements)


def test_usage_and_logs_wait_in_memory_and_are_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _FullStore(tmp_path / "ops.sqlite")
    desk = OpsDesk(_Core(), store)  # type: ignore[arg-type]
    key = Key("app", "f", 1, "alice")
    caplog.set_level(logging.WARNING, "gpufn.scheduler")
    for t in range(10):  # ten seconds of a full disk, a call and a line each
        desk.usage.record_call(key, "completed", 1_000_000.0 + t, 1_000_000.0 + t,
                               1_000_000.0 + t)
        desk.logs.add("app", "f", f"i{t}", "stdout", f"line {t}", 1_000_000.0 + t)
        desk.tick(float(t))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"no space left on {tmp_path}" in said[0], said
    store.full = False
    desk.tick(11.0)
    assert sum(r.calls for r in store.usage(0)) == 10
    assert [ln.text for ln in store.logs(0)] == [f"line {t}" for t in range(10)]
    assert "written again" in caplog.records[-1].getMessage()


def test_a_deploy_on_a_full_disk_names_the_state_dir_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DeploymentStore(tmp_path / "deployments.sqlite")
    fn = StoredFunction("a", 1, "f", "d1", "c1", {}, [], 1, (b"code",))
    store.add_version(Version("a", 1, 1.0, "h1"), [fn])
    real = store._db
    monkeypatch.setattr(DeploymentStore, "_db", property(lambda s: _Failing(real)))
    with pytest.raises(disk.StateWriteError, match=f"no space left on {tmp_path}"):
        store.add_version(Version("a", 2, 2.0, "h2"), [fn])
    monkeypatch.undo()
    assert [(a.name, a.current) for a in store.apps()] == [("a", 1)]  # rolled back
    assert store.next_version("a") == 2


class _Failing:
    """A connection whose COMMIT fails as sqlite does on a full disk."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)

    def cursor(self) -> Any:
        cur = self.db.cursor()

        class Cursor:
            def execute(self, sql: str, *args: Any) -> Any:
                if sql == "COMMIT":
                    raise sqlite3.OperationalError("database or disk is full")
                return cur.execute(sql, *args)

            def executemany(self, sql: str, rows: Any) -> Any:
                return cur.executemany(sql, rows)

        return Cursor()
