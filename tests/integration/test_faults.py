"""Faults through real processes: a worker killed during a call, a frozen worker, a
client killed mid-map, and a scheduler restarted under its workers and clients."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import gpufn

from ..conftest import _alive, assert_all_gone, cluster_with, wait_ready

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


@gpufn.gpu(retries=2)
def steps_retried(seconds: float, started: str = "") -> dict[str, int]:
    _started(started)
    _steps(seconds)
    return {"pid": os.getpid(), "attempt": gpufn.context().attempt}


@gpufn.gpu
def steps_once(seconds: float, started: str = "") -> int:
    _started(started)
    _steps(seconds)
    return os.getpid()


def _started(path: str) -> None:
    """Say the call's code runs (the scheduler's "running" is only its dispatch: a worker
    killed before it started the call loses nothing, its journal says so, and the call
    runs again as if first sent)."""
    if path:
        Path(path).write_text(str(os.getpid()))


@gpufn.gpu
def logged_once(path: str, seconds: float) -> int:
    """Notes each run (pid, attempt) in `path`: a side effect that shows a second run."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {gpufn.context().attempt}\n")
    _steps(seconds)
    return os.getpid()


@gpufn.gpu(retries=2)
def logged_retried(path: str, seconds: float) -> int:
    return logged_once.local(path, seconds)


@gpufn.gpu
def quick(x: int) -> int:
    return x + 1


@gpufn.model(memory="10MiB")
def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


@gpufn.gpu(models=[tiny])
def use_tiny() -> float:
    return float(tiny.get().weight.detach().sum())


def _steps(seconds: float) -> None:
    """Sleep in small steps, so that a cancel lands at once."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def running_on(c: gpufn.Client, function: str) -> dict[str, int]:
    """device key -> worker pid, for devices running a call of `function`."""
    return {d["key"]: d["pid"] for d in c.status()["devices"]
            if d["state"] == "ready" and any(r["function"] == function for r in d["running"])}


@pytest.fixture(scope="module")
def two() -> Iterator[gpufn.Client]:
    with cluster_with(GPUFN_CPU_DEVICES=2, GPUFN_SLOTS=1, GPUFN_HEARTBEAT_TIMEOUT=4,
                      GPUFN_CLIENT_TIMEOUT=3) as c:
        yield c


def test_a_killed_worker_call_is_retried_on_the_other_device(
        two: gpufn.Client, tmp_path: Path) -> None:
    started = tmp_path / "started"
    call = steps_retried.spawn(1.5, str(started))
    (key, pid), = wait_for(lambda: running_on(two, "steps_retried"), 60, "the call").items()
    wait_for(started.exists, 60, "the call to start")
    os.kill(pid, signal.SIGKILL)
    out = call.get(timeout=60)
    assert out["attempt"] == 2 and out["pid"] != pid
    assert call.result_meta()["devices"] != [key]  # the other device, which was free
    wait_ready(two)


def test_a_killed_worker_call_without_retries_fails_with_worker_lost(
        two: gpufn.Client, tmp_path: Path) -> None:
    started = tmp_path / "started"
    call = steps_once.spawn(5, str(started))
    (_, pid), = wait_for(lambda: running_on(two, "steps_once"), 60, "the call").items()
    wait_for(started.exists, 60, "the call to start")
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(gpufn.WorkerLost, match="retries=N"):
        call.get(timeout=60)
    wait_ready(two)
    st = two.status()
    assert not any(d["running"] for d in st["devices"])  # its ledger entries are gone
    assert all(d["used"] == 0 or d["models"] for d in st["devices"])


def test_models_are_loaded_again_after_their_workers_died(two: gpufn.Client) -> None:
    expected = float(tiny.loader().weight.detach().sum())
    assert use_tiny.remote() == expected
    for d in two.status()["devices"]:
        os.kill(d["pid"], signal.SIGKILL)
    wait_for(lambda: all(d["state"] != "ready" or not d["models"]
                         for d in two.status()["devices"]), 30, "the devices to be reset")
    wait_ready(two)
    call = use_tiny.spawn()
    assert call.get(timeout=60) == expected
    assert call.result_meta()["cold_start"] == "loaded"


def test_a_frozen_worker_is_detected_killed_and_replaced(two: gpufn.Client) -> None:
    failed = two.status()["counters"]["failed"]
    call = steps_retried.spawn(2.0)
    (key, pid), = wait_for(lambda: running_on(two, "steps_retried"), 60, "the call").items()
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        wait_for(lambda: next(d for d in two.status()["devices"] if d["key"] == key)["state"]
                 != "ready", 30, "the frozen worker to be noticed")
        noticed = time.monotonic() - t0
        assert noticed < 4 + 2.0  # GPUFN_HEARTBEAT_TIMEOUT, plus a tick and a busy machine
        assert_all_gone([pid])  # the supervisor killed it
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    out = call.get(timeout=60)
    assert out["attempt"] == 2 and out["pid"] != pid
    wait_ready(two)
    assert two.status()["counters"]["failed"] == failed


CLIENT_SCRIPT = """
import gpufn
from tests.integration.test_faults import steps_once
gpufn.connect()
list(steps_once.map([20.0] * 20))
"""


def test_a_killed_client_frees_its_slots(two: gpufn.Client) -> None:
    before = two.status()["counters"]
    env = dict(os.environ, GPUFN_ADDRESS=two.address, GPUFN_TOKEN=two.token, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT], env=env, cwd=ROOT)
    try:
        wait_for(lambda: len(running_on(two, "steps_once")) == 2, 60, "the map to fill both devices")
    finally:
        proc.kill()
        proc.wait()
    t0 = time.monotonic()
    assert quick.remote(1) == 2  # both devices were busy for 9 more rounds of 20 s
    waited = time.monotonic() - t0
    assert waited < 3 + 4  # GPUFN_CLIENT_TIMEOUT, then its calls are dropped or stopped
    after = two.status()["counters"]
    assert after["cancelled"] - before["cancelled"] == 20
    out = subprocess.run([sys.executable, "-m", "gpufn.cli.main", "status"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert f"cancelled {after['cancelled']}" in out.stdout, out.stdout + out.stderr


# --------------------------------------------------------------------------- scheduler restart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scheduler(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gpufn.scheduler", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdin=subprocess.DEVNULL)


def test_a_restarted_scheduler_takes_over_running_calls_and_runs_queued_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler alone is SIGKILLed (its supervisor and workers stay): the calls that
    were running finish where they ran and their results reach the caller through the
    new scheduler, each run once; the queued ones run after."""
    from ..conftest import shutdown_default

    shutdown_default()
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = dict(os.environ, GPUFN_TOKEN="t0k", GPUFN_SLOTS="1", PYTHONPATH=str(ROOT),
               GPUFN_LOG_DIR=str(tmp_path), GPUFN_RESTART_GRACE="5")
    env.pop("GPUFN_ADDRESS", None)
    monkeypatch.setenv("GPUFN_ADDRESS", address)
    monkeypatch.setenv("GPUFN_TOKEN", "t0k")
    sched = _scheduler(port, env)
    sup = subprocess.Popen([sys.executable, "-m", "gpufn.worker.supervisor", "--address", address,
                            "--cpu-devices", "2"], env=env, stdin=subprocess.DEVNULL)
    procs = [sched, sup]
    try:
        c = gpufn.connect(address, token="t0k")
        wait_ready(c)
        logs = tmp_path / "once.log", tmp_path / "retried.log"
        once = logged_once.spawn(str(logs[0]), 6)  # runs when the scheduler dies, no retries
        retried = logged_retried.spawn(str(logs[1]), 6)  # runs too, with retries
        wait_for(lambda: all(p.exists() for p in logs), 60, "both calls to run")
        queued = [quick.spawn(i) for i in range(3)]  # SLOTS=1: these wait
        sched.kill()
        sched.wait()
        sched = _scheduler(port, env)
        procs.append(sched)
        pids = [once.get(timeout=60), retried.get(timeout=60)]
        assert [q.get(timeout=60) for q in queued] == [1, 2, 3]
        # Each ran once, as its first attempt, on the worker its result came from.
        assert [p.read_text().split() for p in logs] == [[str(pid), "1"] for pid in pids]
        counters = c.status()["counters"]
        assert counters["lost"] == 0 and counters["retried"] == 0
    finally:
        shutdown_default()
        pids = [p.pid for p in procs]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        assert_all_gone(pids)
