"""End to end, as a user runs it: `gpufn serve`, `gpufn status`, a wrong token, and the
examples as scripts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn

from ..conftest import assert_all_gone

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update({"GPUFN_HOME": str(tmp), "GPUFN_PROGRESS": "0", "GPUFN_CPU_DEVICES": "1",
                "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def _gpufn() -> list[str]:
    return [sys.executable, "-m", "gpufn.cli.main"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    proc = subprocess.Popen([*_gpufn(), "serve", "--port", "0", "--cpu-devices", "1"],
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    address = ""
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline and not (lines and "connect with" in lines[-1]):
        line = proc.stdout.readline()
        lines.append(line)
        if m := re.search(r"listening on (tcp://\S+)", line):
            address = m.group(1)
    # The token is left in the owner-only cluster file, never printed.
    token = json.loads((tmp_path / "cluster.json").read_text())["token"]
    assert address and token and token not in "".join(lines), "".join(lines)
    try:
        yield address, token, tmp_path
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        assert proc.returncode == 0
        out = subprocess.run(["pgrep", "-f", address.rsplit(":", 1)[1]], capture_output=True,
                             text=True).stdout.split()
        assert_all_gone([int(x) for x in out])


def test_serve_status_and_remote_calls(served: tuple[str, str, Path]) -> None:
    address, _, home = served
    code = (
        "import gpufn, os\n"
        "@gpufn.gpu\n"
        "def where(x):\n    return os.getpid(), x * 2\n"
        f"gpufn.connect({address!r})\n"  # the token comes from ~/.gpufn/cluster.json
        "pid, v = where.remote(21)\n"
        "assert pid != os.getpid() and v == 42, (pid, v)\n"
        "print('ok', v)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=_env(home), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "ok 42" in r.stdout, r.stderr
    st = subprocess.run([*_gpufn(), "status"], env=_env(home), capture_output=True, text=True,
                        timeout=60)
    assert st.returncode == 0, st.stderr
    assert "devices" in st.stdout and "ready" in st.stdout and "where" in st.stdout


def test_wrong_token_is_refused_with_the_fix(served: tuple[str, str, Path]) -> None:
    address, _, _ = served
    with pytest.raises(gpufn.AuthenticationError, match="GPUFN_TOKEN"):
        gpufn.Client(address, "not-the-token", connect_timeout=20)


def test_status_without_a_scheduler_says_how_to_start_one(tmp_path: Path) -> None:
    r = subprocess.run([*_gpufn(), "status"], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "gpufn serve" in r.stderr


@pytest.mark.parametrize("script", ["quickstart.py", "multi_gpu_allreduce.py"])
def test_examples_run_as_scripts(script: str, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script)],
                       env=_env(tmp_path, GPUFN_CPU_DEVICES="4"), capture_output=True,
                       text=True, timeout=200, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    if script == "quickstart.py":
        assert r.stdout.splitlines()[:3] == ["49", "332833500", "9"]
        assert "as expected, too big" in r.stdout
    else:
        assert "warm call" in r.stdout and "'sum': 10.0" in r.stdout
