"""`gpufn deploy` and `gpufn.lookup` against a real `gpufn serve`: versions, rolling and
recreate updates, pins (also for nested calls), rollback, stop, broken versions, the
CLI, and deployments that survive a scheduler restart."""

from __future__ import annotations

import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import gpufn
import gpufn.api.deployment
from gpufn.cli.main import app as cli
from gpufn.client import default as client_mod

from ..conftest import shutdown_default
from .served import Served, gpufn_cmd

pytestmark = pytest.mark.timeout(300)

APP = '''
import time
import gpufn
import gpufn.api.deployment
import {helper}

VERSION = "{version}"


@gpufn.gpu
def square(x):
    return x * x


@gpufn.gpu
def which(seconds=0.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # in small steps: a cancel lands between them
        time.sleep(0.02)
    return VERSION


@gpufn.gpu
def nested():
    return [which.remote(), gpufn.lookup("{app}", "which").remote()]


@gpufn.gpu
def helped(x):
    return {helper}.twice(x)
'''

HELPER = "def twice(x):\n    return 2 * x\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    shutdown_default()
    s = Served(tmp_path_factory.mktemp("serve")).start()
    gpufn.connect(s.address, token=s.token)
    try:
        yield s
    finally:
        client_mod._shutdown_default()
        s.stop()


def write_app(folder: Path, app: str, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    helper = f"helper_{app}"
    (folder / f"{helper}.py").write_text(HELPER)
    path = folder / f"{app}.py"
    path.write_text(textwrap.dedent(APP.format(helper=helper, version=version, app=app)))
    return path


def running(fn_name: str) -> int:
    st = client_mod.get_client().status()
    return sum(1 for d in st["devices"] for r in d["running"] if r["function"] == fn_name)


def wait_for(cond: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_deploy_lookup_every_call_style(server: Served, tmp_path: Path) -> None:
    path = write_app(tmp_path, "calls", "v1")
    d = gpufn.deploy(path, tag="first")
    assert (d.app, d.version, d.unchanged) == ("calls", 1, False)
    assert {f["name"] for f in d.functions} == {"square", "which", "nested", "helped"}

    sq = gpufn.lookup("calls", "square")
    assert sq.remote(7) == 49
    assert sq.spawn(3).get() == 9
    assert list(sq.map(range(5))) == [0, 1, 4, 9, 16]
    assert list(sq.starmap([(2,), (3,)])) == [4, 9]
    assert sq.with_options(priority=5, timeout=30).remote(4) == 16
    assert sq.spec.count == 1

    async def both() -> list[int]:
        out = [await sq.remote.aio(5)]
        out += [x async for x in sq.map.aio([1, 2])]
        return out

    import asyncio

    assert asyncio.run(both()) == [25, 1, 4]
    # the app's local helper module was pickled by value: the workers run in another folder
    assert gpufn.lookup("calls", "helped").remote(21) == 42

    again = gpufn.deploy(path)
    assert (again.version, again.unchanged) == (1, True)


def test_not_found_lists_what_is_deployed(server: Served, tmp_path: Path) -> None:
    gpufn.deploy(write_app(tmp_path, "known", "v1"))
    lazy = gpufn.lookup("nosuchapp", "f")  # no error until it is called
    with pytest.raises(gpufn.NotFound, match=r"no app 'nosuchapp'.*known v1"):
        lazy.remote(1)
    with pytest.raises(gpufn.NotFound, match=r"no function 'nope'.*square"):
        gpufn.lookup("known", "nope").spawn()
    with pytest.raises(gpufn.NotFound, match="no version 9"):
        gpufn.lookup("known", "square", version=9).remote(1)


def test_rolling_update_keeps_each_call_on_its_version(server: Served, tmp_path: Path) -> None:
    path = write_app(tmp_path, "roll", "v1")
    gpufn.deploy(path)
    which = gpufn.lookup("roll", "which")
    first = which.spawn(2.0)
    wait_for(lambda: running("which") == 1)
    path.write_text(path.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
    d = gpufn.deploy(path)
    assert d.version == 2 and any("rolling" in n for n in d.notes)
    assert which.remote() == "v2"  # a call made after the deploy runs the new code
    assert first.get(timeout=60) == "v1"  # the call started on v1 finished there
    assert gpufn.lookup("roll", "which", version=1).remote() == "v1"  # a pin


def test_pin_holds_for_nested_calls(server: Served, tmp_path: Path) -> None:
    path = write_app(tmp_path, "nest", "v1")
    gpufn.deploy(path)
    path.write_text(path.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
    gpufn.deploy(path)
    # a direct reference and a lookup of the same app, inside a call pinned to v1
    assert gpufn.lookup("nest", "nested", version=1).remote() == ["v1", "v1"]
    assert gpufn.lookup("nest", "nested").remote() == ["v2", "v2"]


def test_recreate_fails_queued_and_cancels_running(server: Served, tmp_path: Path) -> None:
    path = write_app(tmp_path, "recr", "v1")
    gpufn.deploy(path)
    which = gpufn.lookup("recr", "which")
    calls = [which.spawn(30.0) for _ in range(3)]  # 2 devices: two run, one waits
    wait_for(lambda: running("which") == 2)
    path.write_text(path.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
    d = gpufn.deploy(path, strategy="recreate")
    assert any("3 call(s)" in n for n in d.notes), d.notes
    errors = []
    for c in calls:
        with pytest.raises((gpufn.AppStopped, gpufn.Cancelled)) as e:
            c.get(timeout=30)
        errors.append(type(e.value))
    assert sorted(x.__name__ for x in errors) == ["AppStopped", "Cancelled", "Cancelled"]
    assert which.remote() == "v2"


def test_stop_fails_queued_lets_running_finish(server: Served, tmp_path: Path) -> None:
    path = write_app(tmp_path, "stopme", "v1")
    gpufn.deploy(path)
    which = gpufn.lookup("stopme", "which")
    calls = [which.spawn(1.5) for _ in range(3)]
    wait_for(lambda: running("which") == 2)
    out = gpufn.api.deployment.stop("stopme")
    assert out["failed_queued"] == 1
    results = []
    for c in calls:
        try:
            results.append(c.get(timeout=30))
        except gpufn.AppStopped:
            results.append("stopped")
    assert sorted(results) == ["stopped", "v1", "v1"]
    with pytest.raises(gpufn.AppStopped):
        which.remote()
    # a rollback (or a deploy) starts it again
    with pytest.raises(gpufn.NotFound, match="no version before"):
        gpufn.api.deployment.rollback("stopme")
    gpufn.deploy(path)
    assert which.remote() == "v1"


def test_history_and_rollback(server: Served, tmp_path: Path) -> None:
    path = write_app(tmp_path, "hist", "v1")
    gpufn.deploy(path, tag="one")
    path.write_text(path.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
    gpufn.deploy(path, tag="two")
    rb = gpufn.api.deployment.rollback("hist")
    assert rb.version == 3
    assert gpufn.lookup("hist", "which").remote() == "v1"
    h = gpufn.api.deployment.history("hist")
    versions = h["versions"]
    assert [v["version"] for v in versions] == [1, 2, 3]
    assert [v["tag"] for v in versions] == ["one", "two", "one"]
    assert versions[2]["rollback_of"] == 1 and versions[2]["code_hash"] == versions[0]["code_hash"]
    assert all(v["who"] for v in versions)


BROKEN_LOADER = '''
import gpufn
import gpufn.api.deployment

@gpufn.model(memory="1GiB")
def weights():
    raise RuntimeError("weights file is missing")

@gpufn.gpu(models=[weights])
def predict(x):
    return weights.get()
'''


def test_broken_versions_are_reported(server: Served, tmp_path: Path) -> None:
    env = server.env()
    (tmp_path / "bad_import.py").write_text("import gpufn\nraise ValueError('bad config')\n")
    out = subprocess.run([*gpufn_cmd(), "deploy", str(tmp_path / "bad_import.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "ValueError: bad config" in out.stderr

    (tmp_path / "bad_loader.py").write_text(BROKEN_LOADER)
    out = subprocess.run([*gpufn_cmd(), "deploy", "--check", str(tmp_path / "bad_loader.py")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "failed its check" in out.stderr and "weights file is missing" in out.stderr
    assert not any(a["name"] == "bad_loader" for a in gpufn.api.deployment.list_apps())

    gpufn.deploy(tmp_path / "bad_loader.py")  # without --check: it fails on first use
    with pytest.raises(gpufn.ModelLoadError):
        gpufn.lookup("bad_loader", "predict").remote(1)
    listed = CliRunner().invoke(cli, ["app", "list"], env=env)
    assert listed.exit_code == 0, listed.output
    assert "broken" in listed.output and "weights file is missing" in listed.output


def test_drain_first_when_models_do_not_fit(server: Served, tmp_path: Path) -> None:
    src = '''
import gpufn
import gpufn.api.deployment

@gpufn.model(memory="5GiB")
def big():
    return "{tag}"

@gpufn.gpu(models=[big])
def which():
    return big.get()
'''
    path = tmp_path / "drain.py"
    path.write_text(src.format(tag="v1"))
    gpufn.deploy(path)
    assert gpufn.lookup("drain", "which").remote() == "v1"
    path.write_text(src.format(tag="v2"))
    d = gpufn.deploy(path)
    assert any(n.startswith("drain first") for n in d.notes), d.notes
    assert gpufn.lookup("drain", "which").remote() == "v2"

    def resident() -> list[str]:
        st = client_mod.get_client().status()
        return [m["name"] for dev in st["devices"] for m in dev["models"]]

    assert "big" in resident()
    gpufn.api.deployment.stop("drain")  # a stopped app's models leave the devices
    wait_for(lambda: "big" not in resident(), 30)


def test_cli(server: Served, tmp_path: Path) -> None:
    runner = CliRunner()
    env = server.env()
    path = write_app(tmp_path, "clidemo", "v1")
    res = runner.invoke(cli, ["deploy", str(path), "--tag", "t1"], env=env)
    assert res.exit_code == 0, res.output
    assert "clidemo v1 deployed" in res.output and "gpufn.lookup('clidemo'" in res.output
    res = runner.invoke(cli, ["app", "list", "--json"], env=env)
    assert res.exit_code == 0 and '"clidemo"' in res.output
    res = runner.invoke(cli, ["app", "history", "clidemo"], env=env)
    assert res.exit_code == 0 and "t1" in res.output
    res = runner.invoke(cli, ["app", "rollback", "clidemo", "v7"], env=env)
    assert res.exit_code == 1 and "NotFound" in res.output and "Traceback" not in res.output
    res = runner.invoke(cli, ["app", "stop", "nosuch"], env=env)
    assert res.exit_code == 1 and "no app 'nosuch'" in res.output
    # parse errors: exit 2, one line
    assert runner.invoke(cli, ["app", "rollback", "clidemo", "vX"], env=env).exit_code == 2
    assert runner.invoke(cli, ["deploy", str(path), "--strategy", "blue"], env=env).exit_code == 2
    res = runner.invoke(cli, ["app", "list"], env={**env, "GPUFN_HOME": str(tmp_path / "none")})
    assert res.exit_code == 2 and "no scheduler address" in res.output


@pytest.mark.slow
def test_deployments_survive_a_restart(server: Served, tmp_path: Path) -> None:
    path = write_app(tmp_path, "durable", "v1")
    gpufn.deploy(path)
    path.write_text(path.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
    gpufn.deploy(path)
    fn = gpufn.lookup("durable", "which")
    assert fn.remote() == "v2"
    client_mod._shutdown_default()
    server.restart()  # a new scheduler process on the same state directory
    listed = subprocess.run([*gpufn_cmd(), "app", "list"], env=server.env(), capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0 and "durable v2" in listed.stdout, listed.stdout + listed.stderr
    gpufn.connect(server.address, token=server.token)
    assert fn.remote() == "v2"  # no deploy since the restart
    assert gpufn.lookup("durable", "which", version=1).remote() == "v1"
    assert gpufn.lookup("durable", "helped").remote(5) == 10


def test_version_skew_is_reported_at_connect(server: Served) -> None:
    """A worker host on another Python or cloudpickle: connecting says so, with both
    versions, instead of an unpickling error in the middle of a call."""
    import platform

    import zmq

    from gpufn.net.connection import Connection, ConnectionConfig
    from gpufn.wire import protocol as p

    ctx = zmq.Context()
    old = Connection(ctx, ConnectionConfig(server.address, server.token), "s/old-host",
                     p.Role.SUPERVISOR, p.HelloInfo(node="oldbox", python="3.8.10",
                                                    cloudpickle="2.0.0"))
    try:
        old.handshake(30)
        with pytest.raises(gpufn.ProtocolMismatch) as e:
            gpufn.Client(server.address, server.token, connect_timeout=30)
        msg = str(e.value)
        assert f"Python {platform.python_version()}" in msg and "Python 3.8.10" in msg
        assert "cloudpickle 2.0.0" in msg and "oldbox" in msg
    finally:
        old.sock.send_multipart(p.encode(p.Goodbye("done")))
        old.close(1000)
        ctx.term()
    gpufn.Client(server.address, server.token, connect_timeout=30).close()  # gone: fine again
