"""A head restart callers do not notice, against a real `gpufn serve` killed with real
signals: `gpufn serve` or only its scheduler, SIGKILL or SIGTERM. The calls running then
finish where they ran and their one result arrives (a side-effect log shows each ran
once, as its first attempt); queued calls run; resident models stay (no loader runs);
usage and logs include what ran before; a call keeps its deployment version; retried
calls wait through the outage; spawned calls whose spawner left run to their end, once;
only `gpufn shutdown` or an expired grace fails calls, and every process of the head
ends."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpufn
from gpufn.client import default as client_mod

from ..conftest import _alive, assert_all_gone, shutdown_default, wait_ready
from ._head import Head, children
from ._waits import wait_for
from .test_deploy import write_app

pytestmark = pytest.mark.timeout(300)


def _steps(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)


@gpufn.gpu
def once(log: str, i: int, seconds: float) -> int:
    """retries=0: a second run would be a bug; each run is noted (i, attempt, pid)."""
    with open(log, "a") as f:
        f.write(f"{i} {gpufn.context().attempt} {os.getpid()}\n")
    _steps(seconds)
    print(f"once {i} done")
    return i


@gpufn.gpu(retries=2)
def retried(log: str, i: int, seconds: float) -> int:
    return once.local(log, i, seconds)


@gpufn.model(memory="10MiB")
def weights() -> torch.nn.Module:
    with open(os.environ["TEST_LOADS_FILE"], "a") as f:  # the head's env: one line a load
        f.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


@gpufn.gpu(models=[weights])
def use_weights() -> float:
    return float(weights.get().weight.detach().sum())


def _runs(log: Path) -> list[tuple[int, int]]:
    if not log.exists():
        return []
    return [(int(i), int(a)) for i, a, _ in (ln.split() for ln in log.read_text().splitlines())]


def _saved_calls(head: Head, function: str) -> int:
    """Calls of `function` in the usage the scheduler saved on disk."""
    path = head.home / "state" / "ops.sqlite"
    if not path.exists():
        return 0
    with sqlite3.connect(path) as db:
        (n,) = db.execute("SELECT COALESCE(SUM(calls), 0) FROM usage WHERE function=?",
                          (function,)).fetchone()
    return int(n)


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    shutdown_default()
    h = Head(tmp_path / "head", TEST_LOADS_FILE=str(tmp_path / "loads.log"))
    try:
        yield h
    finally:
        client_mod._shutdown_default()
        h.close()


def _connect(head: Head) -> gpufn.Client:
    c = gpufn.connect(head.address, token="restart-test-token")
    wait_ready(c)
    return c


KILLS = {
    "serve-SIGKILL": ("serve", signal.SIGKILL), "serve-SIGTERM": ("serve", signal.SIGTERM),
    "scheduler-SIGKILL": ("scheduler", signal.SIGKILL),
    "scheduler-SIGTERM": ("scheduler", signal.SIGTERM),
}


@pytest.mark.parametrize("kill", list(KILLS))
def test_a_head_restart_is_invisible_to_callers(head: Head, tmp_path: Path, kill: str) -> None:
    what, sig = KILLS[kill]
    head.start()
    c = _connect(head)
    expected = use_weights.remote()  # the model is loaded once, here
    loads = (tmp_path / "loads.log").read_text().splitlines()
    assert len(loads) == 1
    log = tmp_path / "once.log"
    calls = [once.spawn(str(log), i, 1.0) for i in range(8)]  # 2 devices: 2 at a time
    # Some finished (and their usage is on disk), two run now, the rest wait.
    wait_for(lambda: _saved_calls(head, "once") >= 2 and len(_runs(log)) >= 4, 90,
             "calls to finish, to be saved and to run")
    supervisor = head.supervisor()
    workers = children(supervisor)
    saved = _saved_calls(head, "once")  # what the books on disk hold before the kill
    if what == "serve":
        head.kill(sig)
        assert all(_alive(p) for p in {supervisor, *workers})  # they outlived it
        head.start()
        assert "adopted the workers" in head.log(), head.log()
        assert head.supervisor() == supervisor  # not a second set of workers
    else:
        head.kill_scheduler(sig)
    before = {i for i, f in enumerate(calls) if f.done()}  # answered by the old scheduler
    assert [f.get(timeout=120) for f in calls] == list(range(8))
    runs = _runs(log)
    assert sorted(runs) == [(i, 1) for i in range(8)], runs  # each once, as attempt 1
    call = use_weights.spawn()
    assert call.get(timeout=60) == expected
    assert not call.result_meta()["cold_start"]  # still resident
    assert (tmp_path / "loads.log").read_text().splitlines() == loads  # no loader ran
    # The books kept what ran before: all of it after a SIGTERM (saved as it stopped);
    # after a SIGKILL, at least what was saved (once a second) before it.
    usage = json.loads(head.gpufn("usage", "--json").stdout)
    rows = {r["function"]: r["calls"] for r in usage["rows"]}
    low = 8 if sig == signal.SIGTERM else saved + 8 - len(before)
    assert low <= rows.get("once", 0) <= 8 and rows.get("use_weights") == 2, (low, usage)
    logs = head.gpufn("logs", "once", "--json")
    done = [ln["text"] for ln in json.loads(logs.stdout)]
    assert len(set(done)) == len(done) >= low, logs.stdout + logs.stderr
    assert {f"once {i} done" for i in range(8) if i not in before} <= set(done)
    assert c.status()["counters"]["lost"] == 0
    head.shutdown()  # everything stops, the adopted supervisor too


def test_a_call_keeps_its_deployment_version_across_a_restart(head: Head, tmp_path: Path) -> None:
    head.start()
    _connect(head)
    path = write_app(tmp_path / "app", "roll", "v1")
    gpufn.deploy(path)
    which = gpufn.lookup("roll", "which")
    calls = [which.spawn(1.0) for _ in range(8)]  # v1's: two run, six wait
    wait_for(lambda: sum(r["function"] == "which" for d in client_mod.get_client().status()[
        "devices"] for r in d["running"]) == 2, 60, "two calls to run")
    path.write_text(path.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
    assert gpufn.deploy(path).version == 2
    head.kill(signal.SIGKILL)
    head.start()
    assert [f.get(timeout=120) for f in calls] == ["v1"] * 8
    assert which.remote() == "v2"  # a call made now runs the new version
    head.shutdown()


def test_retried_calls_wait_through_an_outage(head: Head, tmp_path: Path) -> None:
    head.start()
    _connect(head)
    log = tmp_path / "retried.log"
    calls = [retried.spawn(str(log), i, 0.3) for i in range(30)]
    wait_for(lambda: len(_runs(log)) >= 4, 60, "calls to run")
    head.kill(signal.SIGTERM)
    time.sleep(2)  # the outage the issue measured (not a synchronisation)
    head.start()
    assert [f.get(timeout=120) for f in calls] == list(range(30))
    assert sorted(i for i, _ in _runs(log)) == list(range(30))  # none ran twice
    head.shutdown()


def test_blocking_calls_running_through_a_head_restart_run_once(
        head: Head, tmp_path: Path) -> None:
    """Blocking `.remote()` calls (each thread its own channel) running when the scheduler
    is killed: each says Hello again to the next one as a client whose calls may have run
    (`HelloInfo.resubmit`), so their resubmits wait for the workers' word and are taken
    over, not run a second time on the idle device."""
    head.start()
    _connect(head)
    log = tmp_path / "once.log"
    out: dict[int, int] = {}

    def call(i: int) -> None:
        out[i] = once.remote(str(log), i, 4.0)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: len(_runs(log)) == 2, 60, "both calls to run")
    head.kill_scheduler(signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert out == {0: 0, 1: 1}
    assert sorted(_runs(log)) == [(0, 1), (1, 1)]  # each once, as attempt 1
    head.shutdown()


def test_a_call_on_a_worker_that_died_during_the_outage_counts_as_lost(
        head: Head, tmp_path: Path) -> None:
    """The worker's journal, read by its supervisor, tells the next scheduler what ran."""
    head.start()
    c = _connect(head)
    logs = tmp_path / "once.log", tmp_path / "retried.log"
    lost = once.spawn(str(logs[0]), 0, 30.0)
    again = retried.spawn(str(logs[1]), 1, 30.0)
    wait_for(lambda: all(p.exists() for p in logs), 60, "both calls to run")
    head.kill(signal.SIGKILL)
    for pid in children(head.supervisor()):  # both workers die while no scheduler watches
        os.kill(pid, signal.SIGKILL)
    head.start()
    with pytest.raises(gpufn.WorkerLost, match="retries=N"):
        lost.get(timeout=120)
    wait_for(lambda: len(_runs(logs[1])) == 2, 120, "the retried call to run again")
    assert _runs(logs[0]) == [(0, 1)] and _runs(logs[1]) == [(1, 1), (1, 2)]
    again.cancel()
    del c
    head.shutdown()


def test_an_expired_grace_fails_calls_and_stops_the_heads_workers(
        head: Head, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head.extra["GPUFN_HEAD_GRACE"] = "4"
    monkeypatch.setenv("GPUFN_HEAD_GRACE", "4")
    head.start()
    _connect(head)
    log = tmp_path / "long.log"
    call = once.spawn(str(log), 0, 60.0)
    wait_for(log.exists, 60, "the call to run")
    head.kill(signal.SIGKILL)  # and no new `gpufn serve`
    with pytest.raises(gpufn.ConnectionLost, match="GPUFN_HEAD_GRACE"):
        call.get(timeout=60)
    assert_all_gone(sorted(head.seen), timeout=30)  # the workers waited 4 s, then stopped


def test_gpufn_shutdown_fails_calls_and_stops_adopted_workers(head: Head, tmp_path: Path) -> None:
    head.start()
    _connect(head)
    head.kill(signal.SIGKILL)
    head.start()  # adopts the supervisor
    wait_ready(client_mod.get_client())
    log = tmp_path / "long.log"
    call = once.spawn(str(log), 0, 60.0)
    wait_for(log.exists, 60, "the call to run")
    out = head.gpufn("shutdown", "--grace", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    with pytest.raises(gpufn.ConnectionLost, match="gpufn shutdown"):
        call.get(timeout=30)
    assert head.proc is not None and head.proc.wait(60) == 0
    assert_all_gone(sorted(head.seen), timeout=30)


def test_a_restart_with_other_device_options_replaces_the_workers(head: Head) -> None:
    """`gpufn serve --cpu-devices 3` after one with 2: the waiting workers are not
    adopted (they are not what was asked for); a new supervisor serves 3 devices."""
    head.start()
    _connect(head)
    before = head.supervisor()
    head.kill(signal.SIGKILL)
    head.devices = 3
    head.start()
    assert head.supervisor() != before
    assert "replaced: cpu_devices (2 -> 3)" in head.log()
    c = client_mod.get_client()
    wait_for(lambda: len(c.status()["devices"]) == 3, 60, "3 devices")
    assert_all_gone([before], timeout=30)


def test_a_restart_with_another_token_replaces_the_workers(head: Head) -> None:
    """A new `gpufn serve` with a different token does not adopt the workers the last one
    left (they hold the old token): it stops them and starts its own."""
    head.start()
    _connect(head)
    before = head.supervisor()
    head.kill(signal.SIGKILL)
    client_mod._shutdown_default()
    head.serve_args = ("--token", "another-restart-token")  # the last --token wins
    head.start()
    assert head.supervisor() != before
    assert "replaced: the token" in head.log()
    assert_all_gone([before], timeout=30)


EVALS = """
import os
import time

import gpufn


@gpufn.gpu
def evaluate(log, i, seconds):
    with open(log, "a") as f:
        f.write(f"{i} {gpufn.context().attempt} {os.getpid()}\\n")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)
    return i * 10
"""

SPAWN_AND_LEAVE = """
import pathlib, sys, time
import gpufn

address, token, log = sys.argv[1:4]
gpufn.connect(address, token=token)
evaluate = gpufn.lookup("evals", "evaluate")
calls = [evaluate.spawn(log, i, 4.0) for i in range(3)]  # 2 devices: two run, one waits
print(" ".join(c.id for c in calls), flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and len(pathlib.Path(log).read_text().splitlines()
                                          if pathlib.Path(log).exists() else []) < 2:
    time.sleep(0.05)
"""  # then it exits: nobody will resubmit them

FROM_ID = """
import json, sys
import gpufn

address, token, *ids = sys.argv[1:]
gpufn.connect(address, token=token)
print(json.dumps([gpufn.FunctionCall.from_id(i).get(timeout=120) for i in ids]))
"""


def _noted_calls(head: Head) -> int:
    path = head.home / "state" / "results.sqlite"
    try:
        with sqlite3.connect(path) as db:
            return int(db.execute("SELECT COUNT(*) FROM calls").fetchone()[0])
    except sqlite3.Error:
        return 0


def _python(head: Head, script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", script, head.address, "restart-test-token",
                           *args], capture_output=True, text=True, timeout=180,
                          env=head.env(), cwd=head.home / "cwd")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("what", ["serve", "scheduler"])
def test_a_spawned_call_whose_spawner_left_survives_a_head_restart(
        head: Head, tmp_path: Path, what: str) -> None:
    head.start()
    _connect(head)
    app = tmp_path / "app" / "evals.py"
    app.parent.mkdir()
    app.write_text(textwrap.dedent(EVALS))
    gpufn.deploy(app)
    log = tmp_path / "evals.log"
    ids = _python(head, SPAWN_AND_LEAVE, str(log)).split()  # two run, one waits; it left
    wait_for(lambda: _noted_calls(head) == 3, 60, "the calls to be noted on disk")
    if what == "serve":
        head.kill(signal.SIGKILL)
        head.start()
    else:
        head.kill_scheduler(signal.SIGKILL)
    values = json.loads(_python(head, FROM_ID, *ids))  # a new process, after the restart
    assert values == [0, 10, 20]
    assert sorted(_runs(log)) == [(0, 1), (1, 1), (2, 1)]  # each ran once, as attempt 1
    wait_for(lambda: _noted_calls(head) == 0, 30, "the rows to leave with their results")
    head.shutdown()


@pytest.mark.parametrize("delay", [0.5, 1.5, 3.0])
def test_ctrl_c_while_serve_starts_stops_everything_it_started(head: Head, delay: float) -> None:
    """SIGINT at any moment of `gpufn serve`'s start (here: while it imports, starts its
    scheduler, its supervisor, writes its files) stops it for good, with every process it
    started. (A SIGINT between the cluster file and the head's run loop used to leave the
    scheduler behind, once in a CI run; that window is too narrow to hit on purpose here.)"""
    import subprocess
    import sys

    # SIGINT at its default, as a terminal's Ctrl-C finds it: a test run started in the
    # background (`nohup`, `cmd &` in a script) hands its children SIGINT ignored, and a
    # SIGINT that lands while serve still imports (before serve catches it) is then
    # discarded by the kernel: serve starts and runs on (this test failed so under load).
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufn.cli.main", "serve", "--port", str(head.port),
         "--cpu-devices", "1", "--token", "restart-test-token"],
        env=head.env(), cwd=head.home / "cwd", stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head.proc = proc  # the fixture stops it (and says so) if this test fails first
    time.sleep(delay)
    rec = head.record()
    proc.send_signal(signal.SIGINT)
    # -SIGINT: it landed while Python still imported, before serve's own handler (an
    # uncaught KeyboardInterrupt ends the interpreter by SIGINT): nothing had started yet.
    assert proc.wait(60) in (0, 1, 130, -signal.SIGINT)
    left = head.record()  # a serve that stopped for good removes its record
    assert not left, f"gpufn serve ended but left its head record: {left}"
    pids = [int(rec[k][0]) for k in ("scheduler", "supervisor") if rec.get(k)]
    # Every process of this head names its port: the scheduler `--port N`, the supervisor
    # and the workers `--address tcp://127.0.0.1:N`.
    found = subprocess.run(["pgrep", "-f", f"127.0.0.1:{head.port}|--port {head.port} "],
                           capture_output=True, text=True).stdout.split()
    assert_all_gone(sorted({*pids, *map(int, found)}), timeout=30)
