"""A damaged state file (issue 29, defect 3): a real `gpufn serve` on a state directory
with one damaged file refuses to start, in one line naming the file and the fix, exit
code 1, no traceback, the file untouched and no process left; `gpufn state restore`
keeps it aside and puts back the head's backup (or what can be read), and serve starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufn.scheduler.stores.deployments import DeploymentStore, StoredFunction, Version
from gpufn.wire.spec import make_spec

from ._head import ROOT, Head, free_port

pytestmark = pytest.mark.timeout(120)


def gpufn(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update(GPUFN_HOME=str(home), GPUFN_STATE_DIR=str(home / "state"),
               GPUFN_LOG_DIR=str(home / "logs"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "gpufn.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def serve_once(home: Path) -> subprocess.CompletedProcess[str]:
    """`gpufn serve` expected to refuse; one that starts after all is stopped with SIGINT
    (everything it started stops with it) and fails the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update(GPUFN_HOME=str(home), GPUFN_STATE_DIR=str(home / "state"),
               GPUFN_LOG_DIR=str(home / "logs"), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "gpufn.cli.main", "serve", "--port",
                             str(free_port()), "--cpu-devices", "1"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"gpufn serve started on a damaged state dir: {out}{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def deployed(state: Path, apps: int = 2) -> Path:
    """A real deployments.sqlite with `apps` apps (and the head's backups of it)."""
    store = DeploymentStore(state / "deployments.sqlite")
    for i in range(apps):
        fn = StoredFunction(f"app{i}", 1, "f", f"d{i}", f"code{i}", make_spec().to_wire(), [],
                            1, (os.urandom(20_000),))
        store.add_version(Version(f"app{i}", 1, 1.0, f"h{i}"), [fn])
    store.close()
    return state / "deployments.sqlite"


def _truncate_empty(state: Path) -> Path:
    path = deployed(state)
    os.truncate(path, 0)
    return path


def _truncate_half(state: Path) -> Path:
    path = deployed(state)
    os.truncate(path, path.stat().st_size // 2)
    return path


def _garbage(name: str) -> Callable[[Path], Path]:
    def make(state: Path) -> Path:
        (state / name).write_bytes(b"\x00garbage\xff" * 700)
        return state / name
    return make


def _bad_token(state: Path) -> Path:
    (state / "admin.token").write_bytes(b"\xff\xfe\x00token")
    return state / "admin.token"


def _bad_keys(state: Path) -> Path:
    keys = state / "keys"
    keys.mkdir(mode=0o700)
    (keys / "server.key").write_text("not a key\n")
    (keys / "server.key_secret").write_text("not a key either\n")
    os.chmod(keys / "server.key_secret", 0o600)
    return keys


DAMAGE = {
    "deployments truncated to 0": _truncate_empty,
    "deployments truncated in half": _truncate_half,
    "deployments garbage": _garbage("deployments.sqlite"),
    "ops garbage": _garbage("ops.sqlite"),
    "kept results garbage": _garbage("results.sqlite"),
    "users.json garbage": _garbage("users.json"),
    "head.json garbage": _garbage("head.json"),
    "admin.token not UTF-8": _bad_token,
    "keys garbage": _bad_keys,
}


def _snapshot(path: Path) -> dict[str, bytes]:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {f.name: f.read_bytes() for f in files}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_serve_refuses_a_damaged_state_file_in_one_line(tmp_path: Path, case: str) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = DAMAGE[case](state)
    before = _snapshot(path)
    out = serve_once(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert str(path) in lines[0] and "damaged" in lines[0], lines[0]
    assert f"gpufn state restore {path}" in lines[0], lines[0]
    assert "listening" not in out.stdout
    assert _snapshot(path) == before  # nothing was changed, nothing taken for empty
    assert not (tmp_path / "cluster.json").exists() and not (state / "head.json.tmp").exists()
    check = gpufn(tmp_path, "state", "check")
    assert check.returncode == 1 and f"damaged {path}" in " ".join(check.stdout.split())


def test_restore_puts_back_the_backup_and_serve_starts_with_every_app(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = _truncate_half(state)
    out = serve_once(tmp_path)
    assert out.returncode == 1 and "newest good backup" in out.stderr, out.stderr
    fixed = gpufn(tmp_path, "state", "restore", str(path))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "kept aside" in fixed.stdout and "restored from its backup" in fixed.stdout
    assert len(list(state.glob("deployments.sqlite.damaged-*"))) == 1  # kept, not deleted
    assert gpufn(tmp_path, "state", "check").returncode == 0
    head = Head(tmp_path)
    try:
        head.start()
        listed = head.gpufn("app", "list", "--json")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert {a["name"] for a in json.loads(listed.stdout)} == {"app0", "app1"}
        head.shutdown()
    finally:
        head.close()


def test_restore_without_a_backup_keeps_the_rows_it_can_read(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = deployed(state)
    for b in (state / "backups").iterdir():
        b.unlink()
    with open(path, "r+b") as f:  # a damaged page past the schema: the rest is readable
        f.seek(path.stat().st_size - 4096)
        f.write(b"\xff" * 4096)
    assert gpufn(tmp_path, "state", "check").returncode == 1
    fixed = gpufn(tmp_path, "state", "restore", str(path))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "rows it could still read" in fixed.stdout, fixed.stdout
    assert gpufn(tmp_path, "state", "check").returncode == 0
    assert DeploymentStore(path).apps()  # what was readable was kept


def test_restore_refuses_while_serve_runs(tmp_path: Path) -> None:
    head = Head(tmp_path)
    try:
        head.start()
        out = gpufn(tmp_path, "state", "restore", str(tmp_path / "state" / "ops.sqlite"))
        assert out.returncode == 1 and "stop it first" in out.stderr, out.stderr
        head.shutdown()
    finally:
        head.close()
