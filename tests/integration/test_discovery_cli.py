"""Clients find the local `gpufn serve`, as real processes with no GPUFN_* variable set (a
user's shell, HOME of its own): scripts, `gpufn.deploy()` and the CLI use the served cluster
and `gpufn status` counts their calls; an embedded cluster keeps its state to itself; a
stale cluster file or a silent server is reported with where the address came from."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import assert_all_gone
from ._userenv import ROOT, Detached, User
from .test_docs_blocks import blocks

pytestmark = pytest.mark.timeout(400)
APP = ROOT / "examples" / "deploy" / "app.py"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Detached]:
    user = User(tmp_path_factory.mktemp("served-user"))
    server = Detached(user).start()
    try:
        r = user.gpufn("deploy", str(APP), "--name", "demo")
        assert r.returncode == 0, r.stdout + r.stderr
        yield server
    finally:
        server.stop()


def _functions(user: User) -> list[dict]:
    r = user.gpufn("status", "--json")
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["functions"])


def _calls(user: User, name: str) -> int:
    return sum(f["calls"] for f in _functions(user) if f["name"] == name and f["app"] == "demo")


def test_a_script_without_gpufn_address_calls_the_served_cluster(served: Detached) -> None:
    user = served.user
    before = _calls(user, "embed")
    r = user.python("import gpufn\nprint(repr(gpufn.connect()))\n"
                    "print(len(gpufn.lookup('demo', 'embed').remote('x')))\n")
    assert r.returncode == 0, r.stderr
    shown, n = r.stdout.strip().splitlines()[-2:]
    assert served.address in shown and "cluster.json" in shown and n == "16"
    assert "embedded" not in r.stderr  # no notice: nothing else could have been meant
    assert _calls(user, "embed") == before + 1  # it ran there, not on a cluster of its own


def test_the_docs_lookup_block_runs_against_the_served_cluster(served: Detached) -> None:
    """The docs test skips this block (it needs a served cluster): it runs here, as written."""
    (block,) = [b for b in blocks("docs/operations.md")
                if b.lang == "python" and "gpufn.lookup(\"demo\"" in b.code]
    before = _calls(served.user, "embed")
    r = served.user.python(block.code)
    assert r.returncode == 0, r.stderr
    assert _calls(served.user, "embed") == before + 1


def test_gpufn_deploy_from_python_deploys_to_the_served_cluster(served: Detached) -> None:
    r = served.user.python(f"import gpufn\nd = gpufn.deploy({str(APP)!r}, name='pydemo')\n"
                           "print(d.app, d.version)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["pydemo", "1"]
    apps = json.loads(served.user.gpufn("app", "list", "--json").stdout)
    assert "pydemo" in [a["name"] for a in apps]
    assert (served.user.gpufn_home / "deployments.sqlite").exists()


def test_logs_show_cluster_unique_ids_and_app_logs_is_an_alias(served: Detached) -> None:
    code = "import gpufn\nprint(gpufn.lookup('demo', 'similarity').remote('gpu box', 'gpu boxes'))\n"
    for _ in range(2):  # two clients: each numbers its calls from 1
        r = served.user.python(code)
        assert r.returncode == 0, r.stderr
    logs = served.user.gpufn("logs", "demo")
    assert logs.returncode == 0, logs.stderr
    ids = re.findall(r"\[demo\.similarity ([0-9a-f]+)\] similarity\('gpu box'", logs.stdout)
    assert len(ids) >= 2 and len(set(ids)) == len(ids), logs.stdout
    assert all(len(i) == 16 for i in ids)
    alias = served.user.gpufn("app", "logs", "demo")
    assert alias.returncode == 0 and alias.stdout.count("similarity('gpu box'") == len(ids)


def test_status_shows_app_and_version_columns(served: Detached, tmp_path: Path) -> None:
    changed = tmp_path / "app.py"  # v2: the same app with its code changed
    changed.write_text(APP.read_text() + "\n# v2\n")
    (tmp_path / "textfeatures.py").write_text((APP.parent / "textfeatures.py").read_text())
    assert served.user.gpufn("deploy", str(changed), "--name", "demo").returncode == 0
    r = served.user.gpufn("status")
    assert r.returncode == 0, r.stderr
    functions = r.stdout[r.stdout.index("functions"):]
    header = functions.splitlines()[2]
    assert "app" in header and "version" in header, functions
    rows = [ln for ln in functions.splitlines() if " embed " in ln]
    assert any("v1" in ln for ln in rows) and any("v2" in ln for ln in rows), functions
    pool = r.stdout[r.stdout.index("model pool"):r.stdout.index("functions")]
    assert "demo v" in pool, pool


def test_worker_logs_stay_with_the_served_clusters_state(served: Detached) -> None:
    logs = sorted((served.user.gpufn_home / "logs").glob("worker-*.log"))
    assert len(logs) == 2, list(served.user.gpufn_home.iterdir())


def test_an_embedded_cluster_keeps_its_state_to_itself(tmp_path: Path) -> None:
    user = User(tmp_path / "u")
    code = """
import os, gpufn
from gpufn.client import default
gpufn.gpu(lambda: 1).remote()
state = default._default.cluster.state_dir
print(state)
print(sorted(p.name for p in (state / "logs").iterdir()))
env = open(f"/proc/{default._default.cluster.scheduler.pid}/environ", "rb").read().split(bytes(1))
print([e.decode() for e in env if e.startswith(b"GPUFN_STATE_DIR=")])
"""
    r = user.python(code)
    assert r.returncode == 0, r.stderr
    state, logs, sched_env = r.stdout.strip().splitlines()[-3:]
    assert f"gpufn-{os.getuid()}/embedded/" in state and "worker-" in logs
    assert sched_env == repr([f"GPUFN_STATE_DIR={state}"])  # its deployments go there too
    assert not Path(state).exists()  # removed when the cluster stopped
    home = user.gpufn_home
    assert not (home / "deployments.sqlite").exists() and not (home / "logs").exists()


def test_deploy_with_no_cluster_refuses_like_the_cli(tmp_path: Path) -> None:
    user = User(tmp_path / "u")
    r = user.python(f"import gpufn\ngpufn.deploy({str(APP)!r}, name='nowhere')\n")
    assert r.returncode == 1 and "ConnectionLost: gpufn.deploy() needs a running cluster" in r.stderr
    cli = user.gpufn("deploy", str(APP))
    assert cli.returncode == 2 and "no scheduler address" in cli.stderr
    assert not list(user.home.rglob("deployments.sqlite"))


def test_a_silent_and_then_a_killed_server_are_reported_with_the_address_source(
        tmp_path: Path) -> None:
    user = User(tmp_path / "u")
    server = Detached(user, devices=1).start()
    path = user.gpufn_home / "cluster.json"
    try:
        sched = server.scheduler_pid()
        os.kill(sched, signal.SIGSTOP)  # its port still accepts; nothing answers
        try:
            r = user.gpufn("status", "--timeout", "1")
        finally:
            os.kill(sched, signal.SIGCONT)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert "cannot reach" in r.stderr and str(path) in r.stderr and "unset" not in r.stderr
        env = user.gpufn("status", "--timeout", "1", GPUFN_ADDRESS="tcp://127.0.0.1:9")
        assert env.returncode == 1 and "came from GPUFN_ADDRESS" in env.stderr, env.stderr
    finally:
        pids = server.pids()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert_all_gone(pids, timeout=30)
    assert path.exists()  # killed: its cluster file is left behind, stale
    r = user.gpufn("status")
    assert r.returncode == 2 and "no longer running" in r.stderr and str(path) in r.stderr
    py = user.python("import gpufn\nprint(gpufn.gpu(lambda: 7).remote())\n")
    assert py.returncode == 0 and py.stdout.strip().endswith("7"), py.stderr
    notices = [ln for ln in py.stderr.splitlines() if ln.startswith("gpufn: ")]
    assert len(notices) == 1 and "stale" in notices[0] and "embedded cluster" in notices[0]


def test_a_serve_of_another_home_is_named_when_an_embedded_cluster_starts(
        served: Detached, tmp_path: Path) -> None:
    other = User(tmp_path / "other")
    r = other.python("import gpufn\nprint(gpufn.gpu(lambda: 3).remote())\n")
    assert r.returncode == 0, r.stderr
    notices = [ln for ln in r.stderr.splitlines() if ln.startswith("gpufn: ")]
    assert len(notices) == 1 and "another GPUFN_HOME" in notices[0], r.stderr
