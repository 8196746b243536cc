"""The operator's commands as real processes: `gpufn serve --detach` with a temp state dir,
`run`, `status`, `logs`, `usage`, a Prometheus scrape, and `shutdown` letting a running call
finish, with no process left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ..conftest import assert_all_gone

pytestmark = pytest.mark.timeout(300)

APP = '''
import time
import gpufn

@gpufn.gpu
def greet(name, times=1):
    for i in range(times):
        print(f"hi {name} {i}")
    return {"name": name, "times": times}

@gpufn.gpu
def slow(seconds):
    print("slow started")
    time.sleep(seconds)
    return seconds
'''


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update({"GPUFN_HOME": str(tmp / "home"), "GPUFN_PROGRESS": "0",
                "GPUFN_CPU_DEVICES": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _gpufn(tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufn.cli.main", *args], env=_env(tmp),
                          capture_output=True, text=True, timeout=timeout, cwd=tmp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(x) for x in out]
    return kids + [g for k in kids for g in _descendants(k)]


def test_detached_server_operated_from_the_cli(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    (tmp_path / "app.py").write_text(APP)
    state = tmp_path / "state"
    mport = _free_port()
    r = _gpufn(tmp_path, "serve", "--detach", "--port", "0", "--cpu-devices", "1",
               "--state-dir", str(state), "--metrics-port", str(mport), "--json")
    assert r.returncode == 0, r.stderr + r.stdout
    info = json.loads(r.stdout)
    pid = info["pid"]
    assert (state / "serve.pid").read_text().strip() == str(pid) and (state / "serve.log").exists()
    pids = [pid]
    try:
        # A second detached server is refused while this one runs.
        again = _gpufn(tmp_path, "serve", "--detach", "--port", "0", "--state-dir", str(state))
        assert again.returncode == 1 and "already running" in again.stderr
        pids += _descendants(pid)

        run = _gpufn(tmp_path, "run", "app.py::greet", "'ann'", "times=2", "--address",
                     info["address"], "--json")
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout.splitlines()[-1])["result"] == {"name": "ann", "times": 2}
        assert "hi ann 1" in run.stdout  # the function's output reached the caller

        st = _gpufn(tmp_path, "status", "--json")
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["hosts"][0]["workers"] == {"ready": 1}
        pids += [d["pid"] for d in status["devices"] if d.get("pid")]

        logs = _gpufn(tmp_path, "logs", "greet", "--since", "10m")
        assert logs.returncode == 0 and "[greet " in logs.stdout and "hi ann 1" in logs.stdout
        call_id = logs.stdout.split("[greet ", 1)[1].split("]", 1)[0]
        one = _gpufn(tmp_path, "logs", call_id)  # one call's lines, by the id they carry
        assert one.returncode == 0 and "hi ann 1" in one.stdout, one.stderr
        unknown = _gpufn(tmp_path, "logs", "nope")
        assert unknown.returncode == 1 and "no app, function or call 'nope' has output kept" in unknown.stderr
        assert "Traceback" not in unknown.stderr

        use = json.loads(_gpufn(tmp_path, "usage", "--by", "user", "--json").stdout)
        (row,) = use["rows"]
        assert row["calls"] == 1 and row["user"] and row["device_seconds"] > 0

        body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(body)}
        calls = [s for s in fams["gpufn_calls"].samples if s.name == "gpufn_calls_total"]
        assert [(s.labels["function"], s.labels["outcome"], s.value) for s in calls] == [
            ("greet", "succeeded", 1.0)]
        assert {s.labels["state"] for s in fams["gpufn_workers"].samples} == {"ready"}
        assert fams["gpufn_device_memory_total_bytes"].samples[0].value > 0
        assert any(s.name == "gpufn_call_duration_seconds_bucket" and s.labels["le"] == "0.001"
                   for s in fams["gpufn_call_duration_seconds"].samples)
        for name in ("gpufn_queue_depth", "gpufn_queue_wait_seconds", "gpufn_models_resident",
                     "gpufn_model_loads", "gpufn_model_evictions", "gpufn_deployment_info",
                     "gpufn_device_memory_used_bytes"):
            assert name in fams
        assert "pid" not in body and "invocation" not in body

        # Shutdown while a 10 s call runs (long enough for a loaded machine to start the CLI):
        # the call finishes and returns its result.
        slow: dict[str, subprocess.CompletedProcess[str]] = {}
        t = threading.Thread(target=lambda: slow.setdefault("r", _gpufn(
            tmp_path, "run", "app.py::slow", "10", "--address", info["address"])))
        t.start()
        deadline = time.monotonic() + 60
        while "slow started" not in _gpufn(tmp_path, "logs", "slow").stdout:
            assert time.monotonic() < deadline, "the slow call never started"
            time.sleep(0.2)
        down = _gpufn(tmp_path, "shutdown", "--grace", "30", "--json")
        assert down.returncode == 0, down.stderr
        assert json.loads(down.stdout)["running"] == 1
        t.join(60)
        assert slow["r"].returncode == 0 and slow["r"].stdout.strip().endswith("10"), slow["r"].stderr
        assert not (state / "serve.pid").exists()
        assert not (tmp_path / "home" / "cluster.json").exists()
        after = _gpufn(tmp_path, "status")
        assert after.returncode == 2 and "gpufn serve" in after.stderr
    finally:
        for p in pids:
            try:
                os.kill(p, 9) if (state / "serve.pid").exists() else None
            except ProcessLookupError:
                pass
    assert_all_gone(pids)
