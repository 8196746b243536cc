"""Shared fixtures: the embedded cluster (real processes), fresh clusters with custom
settings, and a check that no gpufn process outlives the tests that started it."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest

# The tests never see the user's own `gpufn serve` (~/.gpufn/cluster.json) nor write there.
TEST_HOME = os.environ["GPUFN_HOME"] = tempfile.mkdtemp(prefix="gpufn-test-home-")
os.environ.setdefault("GPUFN_CPU_DEVICES", "2")
os.environ.setdefault("GPUFN_DEVICE_MEMORY", "8GiB")
os.environ.setdefault("GPUFN_PROGRESS", "0")

import gpufn
from gpufn.client import default as client_mod

atexit.register(shutil.rmtree, TEST_HOME, True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Also here: an xdist worker process ends without running its atexit handlers (one
    empty home directory was left in /tmp per worker per run)."""
    shutil.rmtree(TEST_HOME, ignore_errors=True)


def cluster_pids(c: gpufn.Client) -> list[int]:
    """Scheduler, supervisor and worker pids of an embedded cluster."""
    pids = []
    if c.cluster is not None:
        pids += [p.pid for p in (c.cluster.scheduler, c.cluster.supervisor) if p is not None]
    try:
        pids += [d["pid"] for d in c.status(5)["devices"] if d.get("pid")]
    except gpufn.GpufnError:
        pass
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_all_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    assert not left, f"gpufn processes left behind: {[(p, _cmdline(p)) for p in left]}"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


def shutdown_default() -> None:
    c = client_mod._default
    pids = cluster_pids(c) if c is not None and c.cluster is not None else []
    client_mod._shutdown_default()
    assert_all_gone(pids)


def wait_ready(c: gpufn.Client, n: int | None = None, timeout: float = 60.0) -> dict:
    """Wait until n devices (default: all) have a ready worker."""
    deadline = time.monotonic() + timeout
    while True:
        st = c.status()
        ready = [d for d in st["devices"] if d["state"] == "ready"]
        if ready and len(ready) >= (n or len(st["devices"])):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"devices not ready: {st['devices']}")
        time.sleep(0.05)


@contextlib.contextmanager
def cluster_with(**env: object) -> Iterator[gpufn.Client]:
    """A fresh embedded cluster started with these GPUFN_* settings (module fixtures);
    torn down, and checked for leftover processes, afterwards."""
    mp = pytest.MonkeyPatch()
    shutdown_default()
    for k, v in env.items():
        mp.setenv(k, str(v))
    try:
        c = gpufn.connect()
        wait_ready(c)
        yield c
    finally:
        shutdown_default()
        mp.undo()


@pytest.fixture
def cluster() -> gpufn.Client:
    """The shared embedded cluster (2 simulated devices), workers ready."""
    c = gpufn.connect()
    wait_ready(c)
    return c


@pytest.fixture
def fresh_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., gpufn.Client]]:
    """Start a new embedded cluster with extra GPUFN_* settings; torn down (and checked
    for leftovers) after the test."""

    def start(**env: object) -> gpufn.Client:
        shutdown_default()
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        c = gpufn.connect()
        wait_ready(c)
        return c

    yield start
    shutdown_default()


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind() -> Iterator[None]:
    yield
    shutdown_default()
