"""`python -m gpufn.http` (gpufn/http/__main__.py): its refusals before it binds, the port
it writes once it listens, and its end when the `gpufn serve` that started it is gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gpufn.http.__main__ import main

pytestmark = pytest.mark.timeout(60)
SCHEDULER = "tcp://127.0.0.1:9"  # nothing listens: the gateway connects only when asked


def test_no_scheduler_address_is_refused(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("GPUFN_ADDRESS", raising=False)
    assert main(["--port", "0"]) == 2
    assert "pass --address or set GPUFN_ADDRESS" in capsys.readouterr().err


@pytest.mark.parametrize("args, why", [
    (["--host", "0.0.0.0"], "must use TLS"),
    (["--cert", "c.pem"], "give both --http-cert and --http-key"),
    (["--cert", "nowhere.pem", "--key", "nowhere.key"], "nowhere.pem is not a file"),
])
def test_an_unsafe_or_broken_bind_is_refused(args: list[str], why: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--address", SCHEDULER, "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and why in err, err


def _start(parent: int, env: dict[str, str] | None = None,
           port: list[str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """The gateway as `gpufn serve` starts it; (process, the port it wrote)."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "gpufn.http", *(["--port", "0"] if port is None else port),
                             "--ready-fd", str(write), "--parent-pid", str(parent)],
                            pass_fds=(write,), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    os.close(write)
    with os.fdopen(read, "rb") as ready:
        line = ready.readline()  # the gateway closes its end once it has written
        rest = ready.read()
    assert line.endswith(b"\n") and not rest, (line, rest)
    return proc, int(line)


def test_it_writes_its_port_and_serves_while_its_parent_lives(tmp_path: Path) -> None:
    env = {**os.environ, "GPUFN_ADDRESS": SCHEDULER, "HOME": str(tmp_path)}
    proc, port = _start(os.getpid(), env)
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            assert r.read() == b'{"ok":true}'
        time.sleep(1.5)  # past one look at its parent
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        before = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        assert _cpu_seconds(proc.pid) - before < 0.3, "an idle gateway keeps a core busy"
    finally:
        proc.terminate()
        proc.wait(15)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_its_default_port_is_8000(tmp_path: Path) -> None:
    try:
        with socket.create_server(("127.0.0.1", 8000)):
            pass
    except OSError:
        pytest.skip("port 8000 is taken on this machine")
    env = {**os.environ, "GPUFN_ADDRESS": SCHEDULER, "HOME": str(tmp_path)}
    proc, port = _start(os.getpid(), env, port=[])
    try:
        assert port == 8000
    finally:
        proc.terminate()
        proc.wait(15)


def test_it_stops_when_its_parent_is_gone(tmp_path: Path) -> None:
    env = {**os.environ, "GPUFN_ADDRESS": SCHEDULER, "HOME": str(tmp_path)}
    proc, _ = _start(1, env)  # a parent that is not its parent: it is gone
    try:
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
