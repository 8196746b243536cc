"""A paused head (SIGSTOP of the scheduler for longer than the heartbeat timeout, then
SIGCONT: what a frozen VM or a swap storm does) kills no healthy worker and loses no call;
a call that ran past its timeout meanwhile still fails as `Timeout` (issue 29, defect 1)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn
from gpufn.client import default as client_mod

from ..conftest import shutdown_default
from ._head import Head, children
from ._waits import wait_for
from .test_restart import _connect, _runs, once

pytestmark = pytest.mark.timeout(240)
HEARTBEAT = float(os.environ.get("TEST_PAUSE_HEARTBEAT", "4"))
PAUSE = float(os.environ.get("TEST_PAUSE_SECONDS", "10"))


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    shutdown_default()
    h = Head(tmp_path / "head", devices=4, GPUFN_HEARTBEAT_TIMEOUT=str(HEARTBEAT))
    try:
        yield h
    finally:
        client_mod._shutdown_default()
        h.close()


def test_a_paused_scheduler_kills_no_healthy_worker(head: Head, tmp_path: Path) -> None:
    head.start()
    _connect(head)
    workers_before = children(head.supervisor())
    log = tmp_path / "runs.log"
    calls = [once.spawn(str(log), i, 6.0) for i in range(2)]
    slow = once.with_options(timeout=3).spawn(str(log), 9, PAUSE + 20)  # running at the resume
    deadline = time.monotonic() + 60
    while len(_runs(log)) < 3 and time.monotonic() < deadline:  # all three started
        time.sleep(0.05)
    assert len(_runs(log)) == 3, _runs(log)
    sched = head.scheduler()
    os.kill(sched, signal.SIGSTOP)
    try:
        time.sleep(PAUSE)  # 2.5 heartbeat timeouts
    finally:
        os.kill(sched, signal.SIGCONT)
    assert [c.get(timeout=60) for c in calls] == [0, 1]
    with pytest.raises(gpufn.Timeout):
        slow.get(timeout=60)
    assert sorted(_runs(log)) == [(0, 1), (1, 1), (9, 1)], "a call ran twice or was retried"
    # The two busy workers and the idle one (it sends no heartbeat while idle) still serve;
    # only the worker of the call that overran its timeout was killed.
    wait_for(lambda: len(workers_before - children(head.supervisor())) >= 1, 30,
             "the timed-out call's worker to be killed")
    left = children(head.supervisor())
    assert len(workers_before) == 4 and len(workers_before & left) == 3, (
        workers_before, left, head.log())
    assert "exceeded its 3s timeout" in head.log()
    assert "no heartbeat" not in head.log()
    assert "the scheduler did not run for" in head.log()  # said, not hidden
