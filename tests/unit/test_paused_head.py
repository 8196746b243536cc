"""A paused scheduler (SIGSTOP, a frozen VM, swap) tells its own stall from its workers'
silence, and a call's timeout still ends it as a `Timeout` (issue 29, defect 1)."""

from __future__ import annotations

from gpufn.exceptions import Timeout as TimeoutError_
from gpufn.exceptions import kind_of
from gpufn.scheduler.core import Stalled
from gpufn.scheduler.nouns.states import DeviceState
from gpufn.wire import protocol as p
from tests.unit.core_harness import Harness


def _stall(h: Harness, seconds: float) -> None:
    """The shell saw its loop come round `seconds` late, then ticks."""
    h.now += seconds
    h.sent += h.core.handle(Stalled(seconds), h.now)
    h.tick()


def test_a_stall_longer_than_the_heartbeat_timeout_kills_no_worker() -> None:
    h = Harness(devices=2, heartbeat_timeout=8.0)
    workers = [h.start_worker(i) for i in range(2)]
    h.tick(1.0)
    _stall(h, 20.0)
    assert not h.of_type(p.KillWorker), "a paused scheduler killed healthy workers"
    assert [h.core.devices[f"n:{i}"].worker for i in range(2)] == workers
    assert all(d.state is DeviceState.READY for d in h.core.devices.values())
    assert h.core.counters.stalls == 1


def test_silence_after_a_stall_still_counts() -> None:
    """Only the stall is forgiven: a worker silent for a heartbeat timeout after it is lost."""
    h = Harness(devices=1, heartbeat_timeout=8.0)
    h.start_worker(0, pid=100)
    _stall(h, 20.0)
    h.tick(9.0)
    assert [k.msg.pid for k in h.of_type(p.KillWorker)] == [100]


def test_the_same_silence_without_a_stall_kills_the_worker() -> None:
    h = Harness(devices=1, heartbeat_timeout=8.0)
    h.start_worker(0, pid=100)
    h.tick(20.0)
    assert [k.msg.pid for k in h.of_type(p.KillWorker)] == [100]


def test_a_call_past_its_timeout_during_a_stall_fails_as_a_timeout() -> None:
    h = Harness(devices=1, heartbeat_timeout=8.0)
    h.start_worker(0)
    f = h.register("slow", timeout=3.0)
    inv = h.submit(f)
    _stall(h, 20.0)
    r = h.results()[inv]
    assert not r.ok and r.error_kind == kind_of(TimeoutError_), (r.error_kind, r.message)


def test_a_success_reported_after_running_past_the_timeout_is_a_timeout() -> None:
    """The worker finished (8 s) before a tick could stop it (3 s): still a timeout."""
    h = Harness(devices=1)
    w = h.start_worker(0)
    f = h.register("slow", timeout=3.0)
    inv = h.submit(f)
    h.finish(w, inv, duration=8.0)
    r = h.results()[inv]
    assert not r.ok and r.error_kind == kind_of(TimeoutError_) and "ran 8.0s" in r.message
    h2 = Harness(devices=1)
    w2 = h2.start_worker(0)
    inv2 = h2.submit(h2.register("quick", timeout=3.0))
    h2.finish(w2, inv2, duration=2.0)
    assert h2.results()[inv2].ok
