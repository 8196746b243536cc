"""The supervisor's restart policy, with fake worker processes: only failures to start
count towards giving up, and a device it gave up on is tried again later."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufn.memory_pool.probe import simulated_devices
from gpufn.wire import protocol as p
from gpufn.worker.supervisor.daemon import GIVE_UP_AFTER, Supervisor


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@pytest.fixture
def sup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    monkeypatch.setenv("GPUFN_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("GPUFN_GIVE_UP_RETRY", "60")
    s = Supervisor("tcp://127.0.0.1:9", "", simulated_devices("n", 1, 2**30), "n")
    s.sent = []
    s._send = s.sent.append
    pids = itertools.count(100)

    def spawn(slot: Any) -> None:
        slot.incarnation += 1
        slot.proc = FakeProc(next(pids))

    s._spawn = spawn
    s._stop_leftovers = lambda key, pid: None  # the fake pids may be real processes' here
    s.slot = next(iter(s.slots.values()))
    spawn(s.slot)
    yield s
    s.conn.close()
    s.ctx.term()


def die(s: Any, now: float, served: bool) -> p.WorkerExited:
    proc = s.slot.proc
    if served:
        s._serving(p.WorkerServing(s.slot.device.key, proc.pid, s.slot.incarnation))
    proc.returncode = -9
    s._reap(now)
    msg = s.sent[-1]
    assert isinstance(msg, p.WorkerExited) and msg.pid == proc.pid
    return msg


def test_workers_that_served_and_were_killed_never_make_it_give_up(sup: Any) -> None:
    for i in range(3 * GIVE_UP_AFTER):
        msg = die(sup, 10.0 + i, served=True)
        assert msg.returncode == -9 and msg.incarnation == i + 1
        assert sup.slot.restart_at == 10.0 + i  # at once
        sup._reap(10.0 + i)  # restarted
        assert sup.slot.proc is not None


def test_failures_to_start_give_up_then_try_again_later(sup: Any) -> None:
    now = 10.0
    for _ in range(GIVE_UP_AFTER - 1):
        assert die(sup, now, served=False).returncode == -9
        now = sup.slot.restart_at
        sup._reap(now)
    gave_up = die(sup, now, served=False)
    assert gave_up.returncode == p.GAVE_UP and "trying again in 60s" in gave_up.reason
    assert gave_up.incarnation == GIVE_UP_AFTER
    sup._reap(now + 59)
    assert sup.slot.proc is None  # waiting
    sup._reap(now + 60)
    assert sup.slot.proc is not None  # tried again
    assert die(sup, now + 61, served=False).returncode == p.GAVE_UP  # still broken: wait again
    sup._reap(now + 121)
    assert die(sup, now + 122, served=True).returncode == -9  # it works now: counts reset
    assert sup.slot.fast_failures == 0
