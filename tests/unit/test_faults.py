"""Faults at the scheduler core: fencing by worker generation, devices that come back
after the supervisor gave up, retries that back off and move elsewhere."""

from __future__ import annotations

import logging

import pytest

from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.nouns.records import FunctionRecord, Invocation
from gpufn.scheduler.nouns.settings import SchedulerConfig
from gpufn.scheduler.nouns.states import DeviceState, InvState
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

from .core_harness import Harness


@pytest.fixture(autouse=True)
def _no_scheduler_errors(caplog: pytest.LogCaptureFixture) -> None:
    yield
    # caplog.records holds the current (teardown) phase's records only: ask for the call's
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_a_stale_gave_up_notice_is_not_applied_to_the_ready_successor() -> None:
    h = Harness(devices=1)
    h.start_worker(0, pid=100)  # generation 1
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))
    w = h.start_worker(0, peer=b"w0b", pid=200)  # generation 2, ready
    h.feed(b"sup", p.WorkerExited("n:0", 100, p.GAVE_UP, "gave up", 1))  # late, about gen 1
    d = h.core.devices["n:0"]
    assert d.state is DeviceState.READY and d.worker == w
    inv = h.submit(h.register("f"))
    assert [r.invocation_id for r in h.runs(w)] == [inv]  # scheduling goes on


def test_gave_up_fails_the_device_until_a_new_worker_comes() -> None:
    h = Harness(devices=1)
    h.start_worker(0, pid=100)
    f = h.register("f")
    h.feed(b"sup", p.WorkerExited("n:0", 100, p.GAVE_UP, "gave up", 1))
    d = h.core.devices["n:0"]
    assert d.state is DeviceState.FAILED and d.worker is None
    inv = h.submit(f)
    assert h.results()[inv].error_kind == "Unschedulable"  # no device could run it now
    w = h.start_worker(0, peer=b"w0b", pid=200)  # the supervisor tried again later
    assert d.state is DeviceState.READY
    inv = h.submit(f)
    assert [r.invocation_id for r in h.runs(w)] == [inv]


def test_a_lost_worker_never_leaves_a_ready_device_without_a_worker() -> None:
    h = Harness(devices=2)
    h.start_worker(0)
    h.start_worker(1)
    for d in h.core.devices.values():
        h.core._members(h.core.members.lose_worker(d, h.now, "test", restart=False), h.now)
        assert d.state is not DeviceState.READY
    f = h.register("f")
    h.submit(f)
    h.tick(1.0)  # a pass with queued work and no worker anywhere: nothing fails


def test_the_supervisor_is_told_when_a_worker_serves() -> None:
    h = Harness(devices=1)
    h.start_worker(0, pid=321)
    serving = [s for s in h.of_type(p.WorkerServing) if s.peer == b"sup"]
    assert [(s.msg.device, s.msg.pid, s.msg.incarnation) for s in serving] == [("n:0", 321, 1)]


def test_a_frozen_worker_is_fenced_and_its_late_messages_ignored() -> None:
    h = Harness(devices=1, heartbeat_timeout=5.0, retry_backoff_seconds=0.2)
    old = h.start_worker(0, pid=100)
    f = h.register("f", retries=1)
    inv = h.submit(f)
    first = h.token(inv)
    h.tick(6.0)  # no heartbeat: killed, fenced, the call queued again
    kills = [s.msg for s in h.of_type(p.KillWorker)]
    assert kills and kills[-1].pid == 100
    assert h.core.invocations[inv].state is InvState.QUEUED
    new = h.start_worker(0, peer=b"w0b", pid=200)
    h.tick(0.3)
    assert h.core.invocations[inv].state is InvState.RUNNING
    # The frozen one wakes up: its result, heartbeat and model event are not applied...
    h.feed(old, p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=first), (b"stale",)))
    h.feed(old, p.Heartbeat([inv], {}))
    h.feed(old, p.ModelEvent("m", p.ModelState.RESIDENT, 1, 0.1))
    assert inv not in h.results()
    # ...and its hello again is refused, and the supervisor told to kill it.
    msg = h.hello(old, p.Role.WORKER, info={"device": "n:0", "incarnation": 1}, pid=100)
    assert isinstance(msg, p.Welcome) and not msg.ok
    assert h.of_type(p.KillWorker)[-1].msg.pid == 100
    assert h.core.devices["n:0"].worker == new
    h.finish(new, inv)
    assert h.results()[inv].ok and h.results()[inv].meta.attempts == 2


def test_a_fenced_control_channel_does_not_replace_the_current_one() -> None:
    h = Harness(devices=1, heartbeat_timeout=5.0)
    h.start_worker(0, pid=100)
    h.tick(6.0)
    h.start_worker(0, peer=b"w0b", pid=200)
    h.hello(b"w0b/ctl", p.Role.WORKER, info={"device": "n:0", "incarnation": 2, "channel": "control"})
    h.hello(b"w0/ctl", p.Role.WORKER, info={"device": "n:0", "incarnation": 1, "channel": "control"})
    assert h.core.devices["n:0"].control == b"w0b/ctl"


def test_retries_back_off_and_prefer_another_device() -> None:
    h = Harness(devices=2, retry_backoff_seconds=0.2, retry_backoff_max=0.3)
    w0 = h.start_worker(0)
    w1 = h.start_worker(1)
    f = h.register("f", retries=3)
    inv = h.submit(f)
    lost = h.core.invocations[inv].devices[0]
    other_w = w1 if lost == "n:0" else w0
    h.feed(b"sup", p.WorkerExited(lost, 100, -9, "killed", 1))
    h.start_worker(int(lost[-1]), peer=b"again", pid=300)  # both devices ready again at once
    h.tick(0.1)
    assert h.core.invocations[inv].state is InvState.QUEUED  # 0.2 s backoff not over
    h.tick(0.15)
    assert [r.invocation_id for r in h.runs(other_w)] == [inv]  # not where it was lost
    assert h.core.invocations[inv].lost_on == (lost,)
    # The second retry waits twice as long, capped at retry_backoff_max.
    h.feed(b"sup", p.WorkerExited(h.core.invocations[inv].devices[0], 100, -9, "killed", 1))
    h.tick(0.25)
    assert h.core.invocations[inv].state is InvState.QUEUED
    h.start_worker(int(h.core.invocations[inv].lost_on[0][-1]), peer=b"third", pid=400)
    h.tick(0.1)
    assert h.core.invocations[inv].state is InvState.RUNNING


def test_retry_delay_doubles_up_to_the_cap() -> None:
    cfg = SchedulerConfig(retry_backoff_seconds=0.2, retry_backoff_max=1.0)
    assert [cfg.retry_delay(n) for n in (1, 2, 3, 4, 10)] == [0.2, 0.4, 0.8, 1.0, 1.0]


def _inv(fn: FunctionRecord, i: int, not_before: float = 0.0) -> Invocation:
    inv = Invocation(f"i{i}", fn, b"c", fn.spec, (), float(i), i)
    inv.not_before = not_before
    return inv


def test_ready_queue_holds_a_backing_off_call_until_it_is_due() -> None:
    fn = FunctionRecord("f", "c", "f", make_spec(), ())
    q = ReadyQueue()
    first, second = _inv(fn, 1, not_before=10.0), _inv(fn, 2)
    q.push(first, now=5.0)
    q.push(second, now=5.0)
    assert len(q) == 2 and q.depth("f") == 2 and set(q) == {first, second}
    assert q.release(5.0) == 10.0
    assert q.head("f") is second  # the retry is not eligible yet
    assert q.release(10.0) is None
    assert q.head("f") is first  # due: back at its original place, ahead of later calls
    cancelled = _inv(fn, 3, not_before=20.0)
    q.push(cancelled, now=10.0)
    q.discard(cancelled)
    cancelled.state = InvState.CANCELLED
    assert q.release(30.0) is None and len(q) == 2


def _restarted(**cfg: object) -> tuple[Harness, bytes]:
    """A new scheduler (fresh core) that a forgotten client says Hello to again."""
    h = Harness(devices=2, restart_grace_seconds=3.0, **cfg)
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 3})
    return h, b"back"


def test_a_resubmitted_call_a_worker_ran_fails_with_worker_lost_without_retries() -> None:
    h, cli = _restarted()
    once, twice = h.register("once"), h.register("twice", retries=1)  # functions are global
    lost, retried, queued = h.submit(once, cli), h.submit(twice, cli), h.submit(once, cli)
    # The workers register again (within the grace) and say what they ran.
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 4, "ran": [lost]})
    h.hello(b"w1", p.Role.WORKER, info={"device": "n:1", "incarnation": 2, "ran": [retried]})
    assert not h.results(cli)  # decided when the hold ends (a worker may still run them)
    assert not h.runs()  # held for the grace, so that every worker can report first
    h.tick(3.1)
    res = h.results(cli)
    assert res[lost].error_kind == "WorkerLost" and "retries=N" in res[lost].message
    assert retried not in res and queued not in res
    runs = {r.invocation_id: r.meta.attempt_number for r in h.runs()}
    assert runs == {retried: 2, queued: 1}


def test_a_report_after_the_hold_of_a_call_still_queued_counts_as_its_lost_attempt() -> None:
    """The hold is over and a resubmitted call still waits for room; then a worker that
    was late says it ran that call before the restart: its attempt is lost (WorkerLost
    with retries=0), it is not run now."""
    h, cli = _restarted()
    f = h.register("f", memory="8GiB")  # one at a time per device
    first, second = h.submit(f, cli), h.submit(f, cli)
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 2})
    h.tick(3.1)  # the hold ends without n:1: the first runs, the second waits
    assert [r.invocation_id for r in h.runs()] == [first]
    h.hello(b"w1", p.Role.WORKER, info={"device": "n:1", "incarnation": 2, "ran": [second]})
    assert h.results(cli)[second].error_kind == "WorkerLost"
    assert [r.invocation_id for r in h.runs()] == [first]


def test_a_worker_that_reports_before_the_resubmit_is_remembered() -> None:
    h, cli = _restarted()
    once = h.register("once")
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1, "ran": ["early"]})
    h.feed(cli, p.Submit("early", once, {}, frames=(b"args",)))
    h.tick(3.1)
    assert h.results(cli)["early"].error_kind == "WorkerLost"


def test_calls_of_a_client_that_was_not_forgotten_start_at_once() -> None:
    h = Harness(devices=1, restart_grace_seconds=3.0)
    w = h.start_worker(0)
    inv = h.submit(h.register("f"))
    assert [r.invocation_id for r in h.runs(w)] == [inv]


def test_a_client_forgotten_long_after_the_start_resubmits_without_waiting() -> None:
    """It fell silent and was forgotten; the scheduler did not restart: nothing to wait for."""
    h = Harness(devices=1, restart_grace_seconds=3.0)
    w = h.start_worker(0)
    f = h.register("f")
    h.tick(10.0)
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 1})
    inv = h.submit(f, b"back")
    assert [r.invocation_id for r in h.runs(w)] == [inv]


def test_a_client_forgotten_by_the_same_scheduler_resubmits_without_waiting() -> None:
    h = Harness(devices=1, restart_grace_seconds=3.0)
    w = h.start_worker(0)
    f = h.register("f")
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 1, "instance": h.core.instance})
    inv = h.submit(f, b"back")
    assert [r.invocation_id for r in h.runs(w)] == [inv]


def test_a_worker_stopped_over_its_host_memory_fails_its_calls_without_a_retry() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0, pid=100)
    f = h.register("f", retries=3, concurrency=2)
    a, b = h.submit(f), h.submit(f)
    assert {r.invocation_id for r in h.runs(w)} == {a, b}
    why = "its worker on host n used 2.10 GiB of host memory, over its limit of 2.00 GiB"
    h.feed(b"sup", p.WorkerExited("n:0", 100, p.OUT_OF_HOST_MEMORY, why, 1))
    for inv in (a, b):
        res = h.results()[inv]
        assert res.error_kind == "HostOutOfMemory", res
        assert f"f call {inv} on device n:0: {why}" == res.message
    assert len(h.runs()) == 2  # nothing was queued again
    w2 = h.start_worker(0, peer=b"w0b", pid=200)
    c = h.submit(f)
    assert [r.invocation_id for r in h.runs(w2)] == [c]  # the replacement serves
    assert h.core.devices["n:0"].state is DeviceState.READY
