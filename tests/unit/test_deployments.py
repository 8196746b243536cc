"""Deployments without processes: the sqlite store, the scheduler's AppBook driven
through a SchedulerCore (versions, aliases, rolling and recreate, stop, restart), and
the version-skew check."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufn.scheduler.stores.deployments import DeploymentStore, StoredFunction, Version
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec
from gpufn.wire.versions import runtime_info, skew

from .core_harness import Harness


def test_store_persists_versions_functions_and_blobs(tmp_path: Path) -> None:
    path = tmp_path / "deployments.sqlite"
    s = DeploymentStore(path)
    fn = StoredFunction("a", 1, "f", "d1", "code1", {"count": 1}, [], 1, (b"frame", b"frame"))
    s.add_version(Version("a", 1, 1.0, "h1", tag="t"), [fn])
    s.close()
    s = DeploymentStore(path)  # reopened, as after a restart
    assert s.db_mode() == "wal"
    assert [(a.name, a.current, a.state) for a in s.apps()] == [("a", 1, "active")]
    [v] = s.versions("a")
    assert (v.tag, v.code_hash, v.functions) == ("t", "h1", ["f"])
    got = s.function_by_id("d1")
    assert got is not None and got.frames == (b"frame", b"frame")
    assert s.next_version("a") == 2


def deploy(h: Harness, app: str, code: str, strategy: str = "rolling") -> p.AppReply:
    spec = make_spec().to_wire()
    fn = {"name": "f", "function_id": f"base-{code}", "code_id": code, "spec": spec,
          "models": [], "ncode": 1}
    h.feed(b"cli", p.Deploy(7, app, {"code_hash": code, "strategy": strategy}, [fn],
                            (code.encode(),)))
    return [s.msg for s in h.of_type(p.AppReply)][-1]


def runs_of(h: Harness, inv: str) -> list[p.Run]:
    return [r for r in h.runs() if r.invocation_id == inv]


def test_alias_calls_bind_to_the_version_current_at_admission() -> None:
    h = Harness(devices=1, state_dir="")
    w = h.start_worker(0)
    assert deploy(h, "app", "v1").data["version"] == 1
    first = h.submit(p.app_alias("app", "f"))
    queued = h.submit(p.app_alias("app", "f"))  # one device: waits behind the first
    [run1] = runs_of(h, first)
    assert (run1.code_id, run1.meta.app, run1.meta.version) == ("v1", "app", 1)
    reply = deploy(h, "app", "v2")
    assert reply.data["version"] == 2 and not reply.data["unchanged"]
    later = h.submit(p.app_alias("app", "f"))
    h.finish(w, first)
    h.finish(w, queued)
    assert runs_of(h, queued)[0].code_id == "v1"  # admitted on v1: runs v1's code
    assert runs_of(h, later)[0].code_id == "v2"
    pinned = h.submit(p.app_alias("app", "f", 1))
    h.finish(w, later)
    assert runs_of(h, pinned)[0].code_id == "v1"
    assert deploy(h, "app", "v2").data["unchanged"]  # same code: same version


def test_recreate_fails_queued_calls_with_app_stopped() -> None:
    h = Harness(devices=1, state_dir="")
    h.start_worker(0)
    deploy(h, "app", "v1")
    running = h.submit(p.app_alias("app", "f"))
    queued = h.submit(p.app_alias("app", "f"))
    deploy(h, "app", "v2", strategy="recreate")
    res = h.results()
    assert res[queued].error_kind == "AppStopped"
    assert res[running].error_kind == "Cancelled"
    assert any(isinstance(s.msg, p.Cancel) and s.msg.invocation_id == running for s in h.sent)


def test_unknown_and_stopped_apps() -> None:
    h = Harness(devices=1, state_dir="")
    h.start_worker(0)
    deploy(h, "app", "v1")
    bad = h.submit(p.app_alias("nope", "f"))
    assert h.results()[bad].error_kind == "NotFound"
    assert "app v1 (f)" in h.results()[bad].message
    h.feed(b"cli", p.AppCommand(9, "stop", {"app": "app"}))
    stopped = h.submit(p.app_alias("app", "f"))
    assert h.results()[stopped].error_kind == "AppStopped"
    h.feed(b"cli", p.Lookup(10, "app", "g"))
    reply = [s.msg for s in h.of_type(p.AppReply)][-1]
    assert not reply.ok and reply.error_kind == "AppStopped"


def test_a_new_scheduler_serves_what_the_last_one_deployed(tmp_path: Path) -> None:
    h = Harness(devices=1, state_dir=str(tmp_path))
    deploy(h, "app", "v1")
    h2 = Harness(devices=1, state_dir=str(tmp_path))  # a restart: nothing in memory
    h2.start_worker(0)
    inv = h2.submit(p.app_alias("app", "f"))
    [run] = runs_of(h2, inv)
    assert run.code_id == "v1"
    loads = [s.msg for s in h2.of_type(p.LoadCode)]
    assert [bytes(f) for f in loads[-1].frames] == [b"v1"]
    h2.feed(b"cli", p.AppCommand(3, "list"))
    [app] = [s.msg for s in h2.of_type(p.AppReply)][-1].data["apps"]
    assert (app["name"], app["version"], app["functions"][0]["calls_1h"]) == ("app", 1, 1)


@pytest.mark.parametrize(("theirs", "ok"), [
    ({"python": "3.11.9"}, True),  # another patch release unpickles the same code
    ({"python": "3.12.1"}, False),
    ({"cloudpickle": "2.2.1"}, False),
])
def test_version_skew(theirs: dict[str, str], ok: bool) -> None:
    mine = {"python": "3.11.7", "cloudpickle": "3.1.1"}
    out = skew(mine, [{**mine, **theirs, "nodes": ["gpu1"]}])
    assert (out is None) == ok
    if out is not None:
        assert "3.11.7" in out and "gpu1" in out
    assert set(runtime_info()) == {"python", "cloudpickle"}


def test_lookup_is_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    """At import time there may be no scheduler: nothing is contacted until a call."""
    import gpufn
    from gpufn.client import default as client_mod

    monkeypatch.setenv("GPUFN_ADDRESS", "tcp://127.0.0.1:1")
    before = client_mod._default
    f = gpufn.lookup("app", "fn", version=2)
    g = f.with_options(priority=3)
    assert client_mod._default is before
    assert (g.app, g.function, g.version) == ("app", "fn", 2)
    with pytest.raises(gpufn.InvalidSpec):
        f.with_options(models=[])
    with pytest.raises(gpufn.InvalidSpec):
        gpufn.lookup("app", "fn", version=0)


def test_the_store_and_its_wal_files_are_owner_only(tmp_path: Path) -> None:
    import os
    import stat

    state = tmp_path / "state"
    state.mkdir(mode=0o755)  # an older folder, or a loose umask
    old = state / "deployments.sqlite-wal"
    s = DeploymentStore.in_state_dir(str(state))
    s.add_version(Version("a", 1, 1.0, "h"), [StoredFunction("a", 1, "f", "d1", "c", {}, [], 1,
                                                             (b"x",))])
    files = sorted(f.name for f in state.iterdir() if f.name != "backups")
    assert files == ["deployments.sqlite", "deployments.sqlite-shm", "deployments.sqlite-wal"]
    for name in files:
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    [copy] = (state / "backups").iterdir()  # the head's backup of it: owner-only too
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "backups").stat().st_mode) == 0o700
    s.close()
    for f in state.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)  # made by an older version: tightened when opened again
    s = DeploymentStore.in_state_dir(str(state))
    assert s.apps()
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in state.iterdir()
               if f.is_file())
    assert old.exists()
    s.close()
