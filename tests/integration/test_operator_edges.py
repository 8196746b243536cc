"""Smaller operator faults (issue 29, defect 9), on a real detached `gpufn serve
--http-port`: serve.log is owner-only and holds none of an HTTP caller's prints; key
columns of `gpufn status`, `usage` and `plan` are whole at COLUMNS=80; `gpufn shutdown
--force` after a crash (SIGKILL of serve) leaves neither serve.pid nor cluster.json nor
any process; and a `gpufn serve` of a folder that is not this user's is never named."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from gpufn.net import discovery

from ..conftest import _alive, assert_all_gone
from ._head import ROOT, children, free_port
from ._waits import wait_for

pytestmark = pytest.mark.timeout(240)

APP = "operator_edges_app"
FN = "shout_with_a_name_long_enough_to_need_folding"
SOURCE = f'''
import gpufn


@gpufn.gpu
def {FN}(x):
    print("CALLER-PRINT-" + str(x))
    return x
'''
LLAMA = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
         "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
         "vocab_size": 128256, "max_position_embeddings": 131072}


def run(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    base.update(GPUFN_HOME=str(home), GPUFN_PROGRESS="0", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "gpufn.cli.main", *args], env=base,
                          capture_output=True, text=True, timeout=120, cwd=home)


def first_column(table: str) -> str:
    """The text of a rich table's first column, its folded lines joined."""
    cells = [ln.split("│")[1].strip() for ln in table.splitlines()
             if ln.startswith("│") and ln.count("│") > 2]
    return "".join(cells)


def head_pids(home: Path) -> set[int]:
    rec = json.loads((home / "head.json").read_text())
    pids = {int(rec["serve"]), int(rec["scheduler"][0]), int(rec["supervisor"][0])}
    for p in list(pids):
        pids |= children(p)
    return {p for p in pids if _alive(p)}


def test_serve_log_shutdown_force_and_columns(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    out = run(home, "serve", "--detach", "--json", "--port", str(free_port()),
              "--cpu-devices", "1", "--http-port", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    info = json.loads(out.stdout)
    seen: set[int] = set()
    try:
        seen = head_pids(home)
        log = Path(info["log_file"])
        assert stat.S_IMODE(log.stat().st_mode) == 0o600  # it holds what every call did
        (home / "app.py").write_text(textwrap.dedent(SOURCE))
        deployed = run(home, "deploy", str(home / "app.py"), "--name", APP)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        token = json.loads((home / "cluster.json").read_text())["token"]
        req = urllib.request.Request(f"{info['http']}/v1/apps/{APP}/{FN}",
                                     data=json.dumps({"args": [7]}).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["result"] == 7
        wait_for(lambda: "CALLER-PRINT-7" in run(home, "logs", APP).stdout, 30,
                 "the call's print in gpufn logs")
        time.sleep(0.5)
        assert "CALLER-PRINT" not in log.read_text(errors="replace")  # the caller's, not ours

        usage = run(home, "usage", COLUMNS="80")
        assert usage.returncode == 0, usage.stderr
        assert f"{APP}.{FN}" in first_column(usage.stdout), usage.stdout
        assert "…" not in usage.stdout
        status = run(home, "status", COLUMNS="80")
        assert status.returncode == 0, status.stderr
        assert FN in first_column(status.stdout.split("functions")[1]), status.stdout
        assert all(len(ln) <= 80 for ln in status.stdout.splitlines()), status.stdout

        seen |= head_pids(home)
        os.kill(int(info["pid"]), signal.SIGKILL)  # a crash: serve cleans up nothing
        assert_all_gone([int(info["pid"])])
        forced = run(home, "shutdown", "--force")
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert not (home / "serve.pid").exists() and not (home / "cluster.json").exists()
        assert_all_gone(sorted(seen), timeout=30)
    finally:
        for p in seen:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        assert_all_gone(sorted(seen))


def test_plan_keeps_every_column_whole_at_80_columns(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    out = run(tmp_path, "plan", str(cfg), "--all", COLUMNS="80")
    assert out.returncode == 0, out.stderr
    table = out.stdout.splitlines()[1:]
    assert "…" not in out.stdout and "recommended" in out.stdout, out.stdout
    assert all(len(ln) <= 80 for ln in table), out.stdout


def test_another_users_serve_is_never_named(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A `gpufn serve` (argv) of a GPUFN_HOME owned by another user: counted, not named."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    other = tmp_path / "someone-else" / ".gpufn"
    other.mkdir(parents=True)
    os.chown(other, 65534, 65534)
    os.chown(other.parent, 65534, 65534)
    fake = tmp_path / "bin" / "gpufn"
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    proc = subprocess.Popen([sys.executable, str(fake), "serve", "--port", "7998"],
                            env={**env, "GPUFN_HOME": str(other)})
    try:
        monkeypatch.setenv("GPUFN_HOME", str(tmp_path / "mine"))
        monkeypatch.delenv("GPUFN_ADDRESS", raising=False)
        wait_for(lambda: any(s.pid == proc.pid for s in discovery.other_serves()), 10,
                 "the fake gpufn serve in /proc")
        seen = discovery.other_serves  # as read from /proc; other tests' serves left out
        monkeypatch.setattr(discovery, "other_serves",
                            lambda: [s for s in seen() if s.pid == proc.pid])
        t = discovery.resolve()
        assert t.embedded and "another GPUFN_HOME" in t.notice, t.notice
        assert "someone-else" not in t.notice + t.advice, (t.notice, t.advice)
    finally:
        proc.kill()
        proc.wait()
