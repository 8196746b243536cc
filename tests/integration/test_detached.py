"""A spawned call of a deployed function outlives the process that spawned it (which
exits, or is SIGKILLed): it runs to its end, and `FunctionCall.from_id` gets its result
later, from another process, and after `gpufn serve` restarts. A call of a function the
spawner defined itself is cancelled with it. Real `gpufn serve`, real client processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn
from gpufn.client import default as client_mod

from ..conftest import shutdown_default
from ._waits import wait_for
from .served import Served

pytestmark = pytest.mark.timeout(300)

APP = '''
import pathlib
import time

import gpufn


@gpufn.gpu
def evaluate(marker, seconds):
    time.sleep(seconds)
    pathlib.Path(marker).write_text("done")
    return {"score": 0.75, "marker": marker}
'''

SPAWNER = '''
import os, pathlib, signal, sys, time
import gpufn

address, token, marker, seconds, how = sys.argv[1:6]
gpufn.connect(address, token=token)

@gpufn.gpu
def local_eval(marker, seconds):  # defined here: its calls end with this process
    time.sleep(seconds)
    pathlib.Path(marker).write_text("done")
    return "local"

if how == "local":
    call = local_eval.spawn(marker, float(seconds))
else:
    call = gpufn.lookup("evals", "evaluate").spawn(marker, float(seconds))
print(call.id, flush=True)
deadline = time.monotonic() + 60
while gpufn.connect(address, token=token).status()["devices"] and time.monotonic() < deadline:
    st = gpufn.connect(address, token=token).status()
    if any(r["id"] == call.id for d in st["devices"] for r in d["running"]):
        break  # it runs: now go away
    time.sleep(0.05)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    shutdown_default()
    home = tmp_path_factory.mktemp("detached")
    # A SIGKILLed client is forgotten after 2 s of silence (120 s by default).
    s = Served(home, devices=2, GPUFN_CLIENT_TIMEOUT="2").start()
    app = home / "app" / "evals.py"
    app.parent.mkdir()
    app.write_text(textwrap.dedent(APP))
    gpufn.connect(s.address, token=s.token)
    gpufn.deploy(app)
    try:
        yield s
    finally:
        client_mod._shutdown_default()
        s.stop()


def _spawn_and_leave(s: Served, marker: Path, seconds: float, how: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SPAWNER, s.address, s.token, str(marker),
                           str(seconds), how], capture_output=True, text=True, timeout=120,
                          env=s.env(), cwd=s.home / "cwd")
    assert proc.stdout.strip(), proc.stderr
    if how == "kill":
        assert proc.returncode == -9, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[0]


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_it_runs_to_its_end_and_its_result_is_found_later(server: Served, tmp_path: Path,
                                                          how: str) -> None:
    marker = tmp_path / "marker"
    call_id = _spawn_and_leave(server, marker, 4.0, how)
    assert not marker.exists()  # still running when its spawner went away
    value = gpufn.FunctionCall.from_id(call_id).get(timeout=60)
    assert value == {"score": 0.75, "marker": str(marker)} and marker.exists()
    again = gpufn.FunctionCall.from_id(call_id)  # after it ended: from the kept book
    assert again.get(timeout=30) == value
    assert again.result_meta()["attempts"] == 1  # it ran once


def test_the_result_is_kept_across_a_restart_of_the_head(server: Served, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    call_id = _spawn_and_leave(server, marker, 0.5, "exit")
    wait_for(marker.exists, 60, "the call to finish with nobody waiting")
    time.sleep(0.5)  # the kept result is written to disk as the call ends
    client_mod._shutdown_default()
    server.restart()  # SIGINT: a clean stop, then a new scheduler on the same state dir
    gpufn.connect(server.address, token=server.token)
    value = gpufn.FunctionCall.from_id(call_id).get(timeout=30)
    assert value == {"score": 0.75, "marker": str(marker)}
    state = server.home / "state"
    assert (state / "results.sqlite").stat().st_mode & 0o077 == 0


def test_a_call_of_a_function_the_spawner_defined_is_cancelled_with_it(
        server: Served, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    call_id = _spawn_and_leave(server, marker, 3.0, "local")
    with pytest.raises(gpufn.GpufnError):
        gpufn.FunctionCall.from_id(call_id).get(timeout=30)  # cancelled: never kept
    time.sleep(4.0)
    assert not marker.exists()  # stopped, not run to its end
