"""Leases, piece by piece: the scheduler's desk (grant, revoke, metering, loss), the
worker's lease book and the client's lease table, without processes."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from gpufn.client.leases import (
    DENIED_AFTER_SECONDS,
    DENIED_SECONDS,
    DEPTH_SECONDS,
    HANDED_SECONDS,
    HEAD_WINDOW,
    LEASE_DEPTH,
    LEASED_HEAD_WINDOW,
    MIN_DEPTH,
    RUN_TIME_WEIGHT,
    Leases,
    Reach,
    retried,
    should_retry,
)
from gpufn.scheduler.books.users import UserStore
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p
from gpufn.worker.leases import Answer, Ended, LeaseBook, Refuse, Start

from .core_harness import Harness

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- scheduler


def _leasing(**cfg: object) -> tuple[Harness, str]:
    h = Harness(devices=1, **cfg)  # type: ignore[arg-type]
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1,
                                        "direct": "tcp://127.0.0.1:5999"})
    h.hello(b"w0c", p.Role.WORKER, info={"device": "n:0", "incarnation": 1, "channel": "control"})
    return h, h.register("f")


def _two_leasing(**cfg: object) -> Harness:
    """Two devices, each with a worker that takes direct calls."""
    h = Harness(devices=2, **cfg)  # type: ignore[arg-type]
    for i in (0, 1):
        h.hello(f"w{i}".encode(), p.Role.WORKER,
                info={"device": f"n:{i}", "incarnation": 1, "direct": f"tcp://127.0.0.1:59{i}0"})
    return h


def _submit(h: Harness, fid: str, client: bytes = b"cli", lease: bool = True) -> str:
    h.n += 1
    inv = f"inv{h.n}"
    h.feed(client, p.Submit(inv, fid, {}, lease=lease, frames=(b"args",)))
    return inv


def _one_on_each(h: Harness, fid: str) -> tuple[str, str, dict[str, bytes]]:
    """Two calls of cli's, one on each of two devices: (first, second, worker of each)."""
    first, second = _submit(h, fid), _submit(h, fid)
    return first, second, {r.invocation_id: peer for peer in (b"w0", b"w1") for r in h.runs(peer)}


def _grants(h: Harness, client: bytes = b"cli") -> list[p.LeaseGrant]:
    return [s.msg for s in h.sent if isinstance(s.msg, p.LeaseGrant) and s.peer == client]


def _granted(h: Harness, fid: str) -> tuple[str, p.LeaseGrant, p.Run]:
    inv = _submit(h, fid)
    h.finish(b"w0", inv)
    grant = _grants(h)[-1]
    run = h.runs(b"w0")[-1]
    assert run.invocation_id == grant.lease_id and run.meta.lease is not None
    return inv, grant, run


def test_a_call_that_asks_gets_a_lease_on_its_idle_device_ahead_of_its_result() -> None:
    h, fid = _leasing()
    inv, grant, run = _granted(h, fid)
    order = [s.msg for s in h.sent if s.peer == b"cli" and isinstance(s.msg, (p.LeaseGrant, p.Result))]
    assert isinstance(order[-2], p.LeaseGrant) and order[-1].invocation_id == inv
    assert grant.endpoint == "tcp://127.0.0.1:5999" and grant.function_id == fid
    assert grant.device == "n:0"  # (its client tells a call run beside it by that)
    assert run.meta.lease[:3] == [grant.secret, grant.seconds, grant.max_calls]
    lease = h.core.invocations[grant.lease_id]
    assert lease.state is InvState.RUNNING and grant.lease_id in h.core.devices["n:0"].running


def test_no_lease_without_asking_or_when_leases_are_off() -> None:
    h, fid = _leasing()
    h.finish(b"w0", _submit(h, fid, lease=False))
    assert not _grants(h)
    h, fid = _leasing(lease_seconds=0.0)
    h.finish(b"w0", _submit(h, fid))
    assert not _grants(h)


def test_no_lease_while_another_call_waits() -> None:
    h, fid = _leasing()
    h.hello(b"bob", p.Role.CLIENT)
    first = _submit(h, fid)
    _submit(h, fid, client=b"bob")  # another client's call, queued behind it (one slot)
    h.finish(b"w0", first)
    assert not _grants(h)


def test_a_lease_takes_over_its_clients_own_queued_calls() -> None:
    h, fid = _leasing(pipeline_depth=0)
    first = _submit(h, fid)
    queued = [_submit(h, fid) for _ in range(4)]  # a .map's window: one slot, they wait
    h.finish(b"w0", first)
    [grant] = _grants(h)
    assert sorted(grant.reclaimed) == sorted(queued)
    assert len(h.core.queue) == 0 and not any(q in h.core.invocations for q in queued)
    assert h.core.counters.submitted == 1  # the others are counted from the lease's Result
    assert not any(r.invocation_id in queued for r in h.runs())


def test_a_waiting_call_revokes_the_lease_at_once() -> None:
    h, fid = _leasing()
    _, grant, run = _granted(h, fid)
    h.hello(b"bob", p.Role.CLIENT)
    _submit(h, fid, client=b"bob")  # another user's call of it: its one slot is leased
    cancels = [s for s in h.sent if isinstance(s.msg, p.Cancel) and s.msg.invocation_id == grant.lease_id]
    assert [c.peer for c in cancels] == [b"w0c"]  # the control socket: lands during a call
    assert cancels[0].msg.dispatch_token == run.dispatch_token
    h.feed(b"bob", p.Ping(1))  # another pass: revoked once, not again
    assert len([s for s in h.sent if isinstance(s.msg, p.Cancel)
                and s.msg.invocation_id == grant.lease_id]) == 1
    # The worker ends it: the slot frees and bob's call runs there.
    h.feed(b"w0", p.Result(grant.lease_id, True, "", "revoked",
                           p.ResultMeta(dispatch_token=run.dispatch_token, batch_items=[])))
    assert h.runs(b"w0")[-1].function_id == fid and h.runs(b"w0")[-1].meta.lease is None
    assert grant.lease_id not in h.core.invocations


def test_a_call_that_ends_beside_its_clients_ending_lease_renews_it_and_not_before() -> None:
    h, fid = _leasing(lease_seconds=1.0)
    short = 0.0005  # a short call: another of its calls may wait at the worker beside it
    h.finish(b"w0", _submit(h, fid), duration=short)
    [first] = _grants(h)
    # Early in the lease a call of its client through the scheduler (a grant in flight)
    # runs beside it and gets no second lease there.
    h.tick(0.5)
    h.finish(b"w0", _submit(h, fid), duration=short)
    assert [g.lease_id for g in _grants(h)] == [first.lease_id]
    # In its last quarter (its client stops using it 50 ms before its end): renewed at
    # once beside the old one, which ends by itself.
    h.tick(0.3)
    h.finish(b"w0", _submit(h, fid), duration=short)
    grants = _grants(h)
    assert len(grants) == 2 and grants[1].lease_id != first.lease_id
    running = h.core.devices["n:0"].running
    assert first.lease_id in running and grants[1].lease_id in running
    # Not for another client: its call ends beside the leases and gets none.
    h.hello(b"bob", p.Role.CLIENT)
    h.tick(0.9)
    h.finish(b"w0", _submit(h, fid, client=b"bob"), duration=short)
    assert not _grants(h, b"bob")


def test_a_revoked_lease_is_not_renewed() -> None:
    h, fid = _leasing(lease_seconds=1.0)
    h.finish(b"w0", _submit(h, fid), duration=0.0005)
    [grant] = _grants(h)
    h.core.invocations[grant.lease_id].preempt_asked = h.now  # revoked: a call waited
    h.tick(0.9)
    h.finish(b"w0", _submit(h, fid), duration=0.0005)
    assert len(_grants(h)) == 1


def test_its_clients_calls_that_wait_behind_its_lease_are_handed_to_it() -> None:
    h, fid = _leasing(pipeline_depth=0)
    _, grant, _ = _granted(h, fid)
    waiting = [_submit(h, fid) for _ in range(3)]  # its depth was full: to the scheduler
    again = [g for g in _grants(h) if g.lease_id == grant.lease_id and g.reclaimed]
    assert sorted(i for g in again for i in g.reclaimed) == sorted(waiting)
    assert again[-1].secret == grant.secret and again[-1].endpoint == grant.endpoint
    assert again[-1].device == grant.device == "n:0"
    assert len(h.core.queue) == 0 and not any(w in h.core.invocations for w in waiting)
    assert not any(isinstance(s.msg, p.Cancel) for s in h.sent)  # the lease goes on


def test_its_clients_call_that_takes_no_lease_is_not_handed_to_it_but_revokes_it() -> None:
    h, fid = _leasing(pipeline_depth=0)
    _, grant, run = _granted(h, fid)
    spawned = _submit(h, fid, lease=False)  # e.g. a spawned call whose Result is kept
    assert not any(spawned in g.reclaimed for g in _grants(h))
    cancels = [s.msg for s in h.sent if isinstance(s.msg, p.Cancel)]
    assert [c.invocation_id for c in cancels] == [grant.lease_id]
    # Nor is a lease granted over it: the device is its next.
    h.feed(b"w0", p.Result(grant.lease_id, True, "", "revoked",
                           p.ResultMeta(dispatch_token=run.dispatch_token, batch_items=[])))
    assert h.runs(b"w0")[-1].invocation_id == spawned
    h.finish(b"w0", spawned)
    assert len(_grants(h)) == 1


def test_calls_wait_for_a_device_running_them_without_a_lease_not_for_the_lease() -> None:
    h = _two_leasing(pipeline_depth=0)
    fid = h.register("f")
    first, second, worker_of = _one_on_each(h, fid)
    h.finish(worker_of[first], first)  # a lease there; the other device runs `second`
    assert len(_grants(h)) == 1
    third = _submit(h, fid)
    assert not any(g.reclaimed for g in _grants(h)[1:])  # the other device takes it next
    h.finish(worker_of[second], second)
    assert third in [r.invocation_id for r in h.runs(worker_of[second])] or any(
        third in g.reclaimed for g in _grants(h))


def test_another_functions_call_runs_beside_a_lease_without_revoking_it() -> None:
    h, fid = _leasing()
    _granted(h, fid)
    g = h.register("g")
    inv = _submit(h, g, lease=False)
    assert h.runs(b"w0")[-1].invocation_id == inv  # a free slot of the device: no wait
    assert not any(isinstance(s.msg, p.Cancel) for s in h.sent)


def test_the_leases_result_meters_each_call_it_ran() -> None:
    h, fid = _leasing()
    _, grant, run = _granted(h, fid)
    items = [{"id": f"d{i}", "ok": i != 2, "kind": "" if i != 2 else "UserError", "s": 0.01,
              "wall": h.core.wall(h.now)} for i in range(3)]
    completed = h.core.devices["n:0"].completed
    h.feed(b"w0", p.Result(grant.lease_id, True, "", "spent",
                           p.ResultMeta(dispatch_token=run.dispatch_token, batch_items=items)))
    assert h.core.devices["n:0"].completed - completed == 3  # `gpufn status` counts them
    usage = h.core.ops.usage.calls_total
    assert sum(n for (_, fn, _, outcome), n in usage.items() if fn == "f" and outcome == "succeeded") == 3
    assert sum(n for (_, fn, _, outcome), n in usage.items() if fn == "f" and outcome == "failed") == 1
    # The same Result again (a worker repeats it after a restart): metered once.
    h.feed(b"w0", p.Result(grant.lease_id, True, "", "spent",
                           p.ResultMeta(dispatch_token=run.dispatch_token, batch_items=items)))
    assert sum(usage.values()) == 4
    assert h.core.devices["n:0"].completed - completed == 3
    ends = [s.msg for s in h.sent if isinstance(s.msg, p.Result) and s.peer == b"cli"
            and s.msg.invocation_id == grant.lease_id]
    assert len(ends) == 1 and ends[0].ok  # its client hears the end once
    assert not h.core.devices["n:0"].running


def test_a_lease_lost_with_its_worker_tells_its_client() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    h.feed(b"sup", p.WorkerExited("n:0", 1, -9, "killed by signal 9", 1))
    ends = [s.msg for s in h.sent if isinstance(s.msg, p.Result)
            and s.msg.invocation_id == grant.lease_id]
    assert len(ends) == 1 and not ends[0].ok and ends[0].error_kind == "WorkerLost"
    assert grant.lease_id not in h.core.invocations
    assert len(h.core.queue) == 0  # never queued again as if it were a call


def test_a_lease_whose_client_left_and_whose_worker_died_is_not_left_open() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    h.feed(b"cli", p.Goodbye("closed"))  # the lease is cancelled; its worker has not said so
    assert grant.lease_id in h.core.devices["n:0"].running
    h.feed(b"sup", p.WorkerExited("n:0", 1, -9, "killed by signal 9", 1))
    assert grant.lease_id not in h.core.leases.open
    assert not h.core.devices["n:0"].running


def test_a_draining_scheduler_revokes_leases() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    h.feed(b"cli", p.Drain(1, 30.0, "test"))
    assert any(isinstance(s.msg, p.Cancel) and s.msg.invocation_id == grant.lease_id
               for s in h.sent)


# --------------------------------------------------------------------------- worker


def _open(book: LeaseBook, seconds: float = 1.0, max_calls: int = 3, at: float = 10.0) -> p.Run:
    run = p.Run("lease:x", "f1", "c1", "f", 77, p.RunMeta(lease=["s", seconds, max_calls, "ann"],
                                                         app="a", version=2))
    book.open(run, at)
    return run


def _direct(inv: str, secret: str = "s") -> p.DirectRun:
    return p.DirectRun("lease:x", secret, inv, frames=(b"args",))


def test_the_worker_runs_a_leases_calls_one_at_a_time_in_order() -> None:
    book = LeaseBook()
    _open(book)
    first = book.offer(b"c", _direct("i1"), 10.1)
    assert [type(a) for a in first] == [Start]
    assert isinstance(first[0], Start) and first[0].run.invocation_id == "i1"
    assert first[0].run.meta.lease is None and first[0].run.dispatch_token == 77
    assert book.offer(b"c", _direct("i2"), 10.1) == []  # waits for i1
    assert book.finished(p.Result("i1", True, "", ""), 0.01, 10.2) == b"c"
    nxt = book.step(10.2)
    assert isinstance(nxt[0], Start) and nxt[0].run.invocation_id == "i2"


def test_the_worker_refuses_a_wrong_secret_a_spent_lease_and_an_unknown_one() -> None:
    book = LeaseBook()
    _open(book, max_calls=1)
    bad = book.offer(b"c", _direct("i1", secret="nope"), 10.1)
    assert isinstance(bad[0], Refuse) and bad[0].msg.reason == "wrong lease secret"
    assert isinstance(book.offer(b"c", _direct("i2"), 10.1)[0], Start)
    spent = book.offer(b"c", _direct("i3"), 10.1)
    assert isinstance(spent[0], Refuse) and spent[0].msg.invocation_ids == ["i3"]
    assert book.offer(b"c", p.DirectRun("lease:y", "s", "i4"), 10.1) == []  # may come later
    assert book.refuse_late(11.0) == []
    [late] = book.refuse_late(12.2)
    assert isinstance(late, Refuse) and late.msg.invocation_ids == ["i4"]


def test_a_direct_call_that_beats_its_lease_to_the_worker_runs_once_it_opens() -> None:
    book = LeaseBook()
    assert book.offer(b"c", _direct("i1"), 9.9) == []  # the scheduler's Run is on its way
    _open(book)
    [start] = book.opened("lease:x", 10.0)
    assert isinstance(start, Start) and start.run.invocation_id == "i1"
    assert book.finished(p.Result("i1", True, "", ""), 0.01, 10.1) == b"c"
    book.revoke("lease:x", "done")
    assert any(isinstance(a, Ended) for a in book.step(10.2))
    ended = book.offer(b"c", _direct("i2"), 10.3)  # a lease that ended here: refused at once
    assert isinstance(ended[0], Refuse) and ended[0].msg.reason == "the lease ended"


def test_a_revoked_lease_refuses_what_waits_and_reports_what_ran() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    book.offer(b"c", _direct("i1"), 10.1)
    book.offer(b"c", _direct("i2"), 10.1)
    book.offer(b"d", _direct("i3"), 10.1)
    assert book.revoke("lease:x", "revoked by the scheduler")
    out = book.step(10.2)
    refused = {a.peer: a.msg.invocation_ids for a in out if isinstance(a, Refuse)}
    assert refused == {b"c": ["i2"], b"d": ["i3"]}
    assert not any(isinstance(a, Ended) for a in out)  # i1 still runs
    book.finished(p.Result("i1", False, "UserError", "boom"), 0.5, 10.7)
    end = [a for a in book.step(10.7) if isinstance(a, Ended)]
    assert len(end) == 1
    meta = end[0].result.meta
    assert meta.dispatch_token == 77 and meta.batch_items is not None
    [item] = meta.batch_items
    assert (item["id"], item["ok"], item["kind"], item["s"]) == ("i1", False, "UserError", 0.5)
    assert (item["fn"], item["app"], item["v"], item["user"]) == ("f", "a", 2, "ann")
    assert not book.leases


def test_a_lease_runs_out_on_time() -> None:
    book = LeaseBook()
    _open(book, seconds=1.0)
    assert book.next_deadline() == 11.0
    late = book.offer(b"c", _direct("i1"), 11.0 + 1.0)
    assert isinstance(late[0], Refuse)
    assert any(isinstance(a, Ended) for a in book.step(12.0))


# --------------------------------------------------------------------------- client


def _grant(seconds: float = 1.0, calls: int = 2, ep: str = "tcp://127.0.0.1:1") -> p.LeaseGrant:
    return p.LeaseGrant("lease:x", "f1", ep, "s", seconds, calls, 0)


def test_the_client_asks_only_for_plain_calls() -> None:
    leases = Leases()
    assert leases.mark(p.Submit("i", "f1", {})).lease
    assert not leases.mark(p.Submit("i", "f1", {"timeout": 3})).lease
    assert not leases.mark(p.Submit("i", "f1", {}, keep=True)).lease
    assert not leases.mark(p.Submit("i", "f1", {}), stream=True).lease


def test_a_marked_submit_keeps_every_other_field() -> None:
    """mark builds the Submit field by field (dataclasses.replace cost 7 us a call)."""
    sub = p.Submit("i", "f1", {}, keep=False, shm=True, prior_attempts=2, prior_raised=True,
                   prior_device="d1", prior_lease="lease:x", frames=(b"a", b"b"))
    assert {f.name for f in dataclasses.fields(p.Submit)} == {
        "invocation_id", "function_id", "options", "keep", "shm", "lease", "prior_attempts",
        "prior_raised", "prior_device", "prior_lease", "frames"}
    assert Leases().mark(sub) == dataclasses.replace(sub, lease=True)


def test_a_call_sent_again_after_a_leased_attempt_carries_it() -> None:
    """An attempt lost with its leased worker, or raising an exception it retries on,
    counts at the scheduler: the Submit sent again says so, and where it ran."""
    grant = dataclasses.replace(_grant(), device="cpu:3", retries=2)
    sub = Leases().mark(p.Submit("i", "f1", {}, frames=(b"a",)))
    again = retried(sub, grant, raised=False)
    assert (again.prior_attempts, again.prior_raised, again.prior_device) == (1, False, "cpu:3")
    assert again.frames == sub.frames and again.lease and again.invocation_id == "i"
    assert retried(again, grant, raised=True).prior_attempts == 2
    failed = p.Result("i", False, "user", "boom", p.ResultMeta(retryable=True))
    assert should_retry(failed, grant)
    assert not should_retry(failed, dataclasses.replace(grant, retries=0))
    assert not should_retry(p.Result("i", False, "user", "boom"), grant)
    assert not should_retry(p.Result("i", True, "", "", p.ResultMeta(retryable=True)), grant)


def test_the_client_uses_a_lease_only_on_a_probed_worker_within_its_calls_and_time() -> None:
    leases = Leases()
    sub = leases.mark(p.Submit("i1", "f1", {}))
    assert leases.granted(_grant(), 0.0)
    assert leases.take(sub, 0.1) is None  # not probed yet
    assert leases.endpoints_to_probe() == ["tcp://127.0.0.1:1"]
    leases.reach["tcp://127.0.0.1:1"] = Reach.OK
    assert leases.take(sub, 0.1) is not None and leases.in_flight("i1")
    assert leases.take(leases.mark(p.Submit("i2", "f1", {})), 0.1) is not None
    assert leases.take(leases.mark(p.Submit("i3", "f1", {})), 0.1) is None  # its calls spent
    leases.answered("i1", ok=True)
    assert not leases.in_flight("i1")
    other = Leases()
    other.granted(_grant(seconds=1.0, calls=10), 0.0)
    other.reach["tcp://127.0.0.1:1"] = Reach.OK
    assert other.take(other.mark(p.Submit("j", "f1", {})), 0.99) is None  # past its time
    assert other.take(other.mark(p.Submit("j", "f2", {})), 0.1) is None  # another function


def test_a_lease_ended_lost_gives_its_calls_in_flight_and_a_refusal_ends_it() -> None:
    leases = Leases()
    leases.observe("f1", 0.0)  # short calls: the full depth
    leases.granted(_grant(calls=10), 0.0)
    leases.reach["tcp://127.0.0.1:1"] = Reach.OK
    for i in range(3):
        leases.take(leases.mark(p.Submit(f"i{i}", "f1", {})), 0.1)
    leases.answered("i0", ok=True)
    held = leases.ended("lease:x")
    assert held is not None and held.calls == {"i1", "i2"}
    assert leases.take(leases.mark(p.Submit("i9", "f1", {})), 0.1) is None
    again = Leases()
    again.observe("f1", 0.0)  # short calls: the full depth
    again.granted(_grant(calls=10), 0.0)
    again.reach["tcp://127.0.0.1:1"] = Reach.OK
    again.take(again.mark(p.Submit("i1", "f1", {})), 0.1)
    again.refused(p.LeaseRefused("lease:x", ["i1"], "revoked"))
    assert not again.in_flight("i1")
    assert again.take(again.mark(p.Submit("i2", "f1", {})), 0.1) is None


def test_an_unreachable_worker_turns_leases_off_said_once(caplog: pytest.LogCaptureFixture) -> None:
    leases = Leases()
    leases.granted(_grant(), 0.0)
    with caplog.at_level(logging.WARNING, logger="gpufn.client"):
        assert leases.unreachable("tcp://127.0.0.1:1") == ["lease:x"]
        leases.unreachable("tcp://127.0.0.1:1")
    assert len([r for r in caplog.records if "cannot reach the worker" in r.message]) == 1
    assert not leases.mark(p.Submit("i", "f1", {})).lease  # no more asking
    assert not leases.granted(_grant(), 0.0)


def test_a_function_with_a_timeout_is_leased_and_its_worker_times_each_call() -> None:
    """The lease's Run carries the function's timeout for its calls (their worker times
    them: worker/lease_clock.py); the lease itself, which may outlast one call's timeout,
    is never timed out by the scheduler."""
    h, _ = _leasing()
    fid = h.register("slow", timeout=3)
    _, grant, run = _granted(h, fid)
    assert run.meta.timeout == 3 and run.meta.lease is not None
    h.tick(10.0)
    assert grant.lease_id in h.core.devices["n:0"].running
    assert not h.of_type(p.KillWorker) and h.core.counters.timeouts == 0


def test_a_call_sent_beside_its_functions_lease_is_timed_from_its_dispatch() -> None:
    """A short function's call the scheduler pipelines to the device its lease holds (its
    client sent it to the head) runs there between the lease's calls: its clock starts
    at once, not at the lease's end (it was never timed: a 6 s call of a timeout=2
    function ran to its end)."""
    h, _ = _leasing()
    fid = h.register("spin", timeout=2)
    h.finish(b"w0", _submit(h, fid), duration=0.0001)
    assert _grants(h)
    beside = _submit(h, fid, lease=False)
    assert h.runs(b"w0")[-1].invocation_id == beside
    assert h.core.devices["n:0"].running[beside].run_started is not None
    h.tick(2.5)
    assert [s.msg.reason for s in h.of_type(p.KillWorker)] == [
        f"call {beside} exceeded its 2s timeout"]


def test_a_leased_call_that_did_not_stop_at_its_timeout_fails_so_and_its_worker_restarts() -> None:
    """Its worker says so (it interrupted the call a grace ago): the call fails with
    Timeout at its client before the lease's end, is metered as failed and a timeout once
    however often it is said, and the worker is killed (the lease is lost with it)."""
    h, _ = _leasing()
    fid = h.register("slow", timeout=3)
    _, grant, _ = _granted(h, fid)
    said = "slow call d1 ran longer than its timeout of 3s on n:0 and did not stop"
    h.feed(b"w0c", p.LeaseOverrun(grant.lease_id, "d1", said, 63.0))
    to_client = [s.msg for s in h.sent if s.peer == b"cli" and isinstance(s.msg, p.Result)]
    timed, end = to_client[-2:]
    assert (timed.invocation_id, timed.ok, timed.error_kind, timed.message) == (
        "d1", False, "Timeout", said)
    assert end.invocation_id == grant.lease_id and end.error_kind == "WorkerLost"
    kills = [s.msg for s in h.of_type(p.KillWorker)]
    assert [k.device for k in kills] == ["n:0"] and "d1" in kills[0].reason
    assert h.core.counters.timeouts == 1 and h.core.counters.failed == 1
    usage = h.core.ops.usage.calls_total
    assert sum(n for (_, fn, _, outcome), n in usage.items()
               if fn == "slow" and outcome == "failed") == 1
    # metered in the minute it ended (now), having started 63 s before
    from gpufn.scheduler.books.usage import BUCKET_S

    minute = h.core.ops.usage._buckets[int(h.core.wall(h.now) // BUCKET_S)]
    assert sum(c.outcomes.get("failed", 0) for k, c in minute.items() if k.function == "slow") == 1
    # Said again (each grace until the kill lands): its worker is gone here, nothing more.
    h.feed(b"w0c", p.LeaseOverrun(grant.lease_id, "d1", said, 14.0))
    assert len(h.of_type(p.KillWorker)) == 1 and h.core.counters.timeouts == 1
    # A lease this scheduler does not know (it restarted): the worker is still restarted.
    h2, _ = _leasing()
    h2.feed(b"w0c", p.LeaseOverrun("lease:gone", "d2", said, 13.0))
    assert [k.msg.device for k in h2.of_type(p.KillWorker)] == ["n:0"]
    assert not [s for s in h2.sent if s.peer == b"cli" and isinstance(s.msg, p.Result)]


def test_a_function_that_retries_on_an_exception_is_leased_and_its_worker_judges_it() -> None:
    """A leased call's exception that `Retries(on=...)` matches goes back to its client
    marked retryable (the client sends it again, counted: `Submit.prior_attempts`); the
    lease's Run names the classes only when the function has retries to make."""
    from gpufn.wire.spec import Retries

    for name, retries, judged in (("flaky", Retries(max_retries=2, on=(ValueError,)), True),
                                  ("never", Retries(max_retries=0, on=(ValueError,)), False),
                                  ("lossy", 2, False)):
        h, _ = _leasing()
        fid = h.register(name, retries=retries)
        _, grant, run = _granted(h, fid)
        assert bool(run.meta.retry_on) is judged, name
        assert grant.retries == (retries if isinstance(retries, int) else retries.max_retries)


def _resubmit(h: Harness, fid: str, attempts: int, raised: bool, inv: str = "again") -> str:
    h.feed(b"cli", p.Submit(inv, fid, {}, lease=True, prior_attempts=attempts, prior_raised=raised,
                            prior_device="n:0", frames=(b"args",)))
    return inv


def test_attempts_used_under_a_lease_count_against_retries_and_wait_their_backoff() -> None:
    """A call its client sends again after a leased attempt (lost with its worker, or
    raising an exception it retries on) runs as that retry would have: attempt 2, after
    the backoff, preferring another device; with none left it fails at once."""
    from gpufn.wire.spec import Retries

    h = _two_leasing(retry_backoff_seconds=0.5)
    fid = h.register("lossy", retries=1)
    inv = _resubmit(h, fid, 1, raised=False)
    assert not h.runs()  # its backoff first
    h.tick(0.6)
    [run] = h.runs()
    assert run.invocation_id == inv and run.meta.attempt_number == 2
    assert h.core.invocations[inv].devices == ("n:1",)  # not where the lease lost it
    assert h.core.counters.retried == 1
    h.feed(b"sup", p.WorkerExited("n:1", 1, -9, "killed by signal 9", 1))
    assert h.results()[inv].error_kind == "WorkerLost"  # its one retry was that run

    h = _two_leasing()
    fid = h.register("flaky", retries=Retries(max_retries=2, initial_delay=2.0,
                                              on=(ValueError,)))
    inv = _resubmit(h, fid, 1, raised=True)
    assert h.core.counters.retried == 1  # retry 1 of 2
    h.tick(1.9)
    assert not h.runs()  # the function's own backoff (2 s), not the scheduler's
    h.tick(0.2)
    assert [r.meta.attempt_number for r in h.runs()] == [2]

    h = _two_leasing()
    fid = h.register("once", retries=1)
    inv = _resubmit(h, fid, 2, raised=True)  # its retry was used already
    result = h.results()[inv]
    assert not result.ok and "more than its retries (1)" in result.message
    assert "raised an exception it retries on after 2 attempt(s)" in result.message
    assert h.core.counters.retried == 0
    lost = _resubmit(h, fid, 2, raised=False, inv="lost")
    assert "its worker was lost during a lease after 2" in h.results()[lost].message
    assert not h.runs() and len(h.core.queue) == 0


def test_a_queued_retry_is_not_handed_to_a_lease_and_ends_one() -> None:
    """A lease takes its client's queued calls, but not one that is a retry: that one
    keeps its attempt count with the scheduler (its worker would run it as attempt 1).
    Like another call waiting, it keeps a lease from being granted, or ends one."""
    h, fid = _leasing(pipeline_depth=0, retry_backoff_seconds=0.0)
    fid = h.register("lossy", retries=2)
    first = _submit(h, fid)
    again = _resubmit(h, fid, 1, raised=False)
    _submit(h, fid)
    h.finish(b"w0", first)
    assert not _grants(h)
    assert h.runs()[-1].invocation_id == again and h.runs()[-1].meta.attempt_number == 2

    h, fid = _leasing(pipeline_depth=0, retry_backoff_seconds=0.0)
    fid = h.register("lossy", retries=2)
    _, grant, _ = _granted(h, fid)
    again = _resubmit(h, fid, 1, raised=False)
    h.tick(0.01)
    assert any(isinstance(s.msg, p.Cancel) and s.msg.invocation_id == grant.lease_id
               for s in h.sent)  # revoked: the retry waits for its slot
    assert not any(again in g.reclaimed for g in _grants(h))


def test_a_leased_attempt_that_its_client_retries_is_not_metered_as_a_call() -> None:
    """The call is metered once, when its retry ends: not also for the attempt that
    raised (said by the worker, or by the client of a lease lost with its worker)."""
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    wall = h.core.wall(h.now)
    h.feed(b"w0", p.LeaseReport(grant.lease_id, [
        {"id": "d1", "ok": True, "s": 0.01, "wall": wall},
        {"id": "d2", "ok": False, "s": 0.01, "wall": wall, "retry": True}]))
    calls = h.core.ops.usage.calls_total
    assert sum(calls.values()) == 2  # the first call and d1
    h.feed(b"sup", p.WorkerExited("n:0", 1, -9, "killed by signal 9", 1))
    h.feed(b"cli", p.LeaseReport(grant.lease_id, [{"id": "d3", "ok": False, "retry": True},
                                                  {"id": "d4", "ok": True}]))
    assert sum(calls.values()) == 3


def test_a_lease_runs_as_its_user_with_their_capped_priority() -> None:
    store = UserStore()
    token = store.create("bob", 0.0, max_priority=1)[1]
    h = Harness(devices=1, users=store, token="admin-token")
    h.hello(b"w0", p.Role.WORKER, token="admin-token",
            info={"device": "n:0", "incarnation": 1, "direct": "tcp://127.0.0.1:5999"})
    assert h.hello(b"bob", p.Role.CLIENT, token=token).ok  # type: ignore[attr-defined]
    fid = h.register("hi", priority=5)
    h.finish(b"w0", _submit(h, fid, client=b"bob"))
    [grant] = _grants(h, b"bob")
    run = h.runs(b"w0")[-1]
    assert run.invocation_id == grant.lease_id
    assert run.meta.priority == 1 and run.meta.lease[3] == "bob"  # capped; metered to bob


def test_a_call_cancelled_while_it_waits_under_a_lease_is_answered_cancelled() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    book.offer(b"c", _direct("i1"), 10.1)
    book.offer(b"c", _direct("i2"), 10.1)
    actions, running = book.cancel(b"c", "i2", "by the caller", 10.2)
    assert not running and len(actions) == 1
    [answer] = actions
    assert answer.result.invocation_id == "i2" and answer.result.error_kind == "Cancelled"
    assert book.cancel(b"c", "i1", "by the caller", 10.2) == ([], True)  # running: interrupted
    assert book.cancel(b"other", "i1", "not yours", 10.2) == ([], False)


def test_the_client_spreads_calls_over_its_leases_by_their_calls_in_flight() -> None:
    leases = Leases()
    leases.observe("f1", 0.0)  # short calls: the full depth
    for i in (1, 2):
        leases.granted(p.LeaseGrant(f"lease:{i}", "f1", f"tcp://127.0.0.1:{i}", "s", 1.0, 100), 0.0)
        leases.reach[f"tcp://127.0.0.1:{i}"] = Reach.OK
    taken = [leases.take(leases.mark(p.Submit(f"i{k}", "f1", {})), 0.1) for k in range(6)]
    by_lease = [h.grant.lease_id for h in taken if h is not None]
    assert by_lease.count("lease:1") == 3 and by_lease.count("lease:2") == 3


def test_a_lease_takes_at_most_its_depth_of_calls_in_flight() -> None:
    from gpufn.client.leases import LEASE_DEPTH

    leases = Leases()

    leases.observe("f1", 0.0)  # short calls: the full depth
    leases.granted(p.LeaseGrant("lease:1", "f1", "tcp://127.0.0.1:1", "s", 1.0, 10_000), 0.0)
    leases.reach["tcp://127.0.0.1:1"] = Reach.OK
    taken = [leases.take(leases.mark(p.Submit(f"i{k}", "f1", {})), 0.1)
             for k in range(LEASE_DEPTH + 5)]
    assert sum(h is not None for h in taken) == LEASE_DEPTH and taken[LEASE_DEPTH] is None
    leases.answered("i0", True)  # an answer makes room for one more
    assert leases.take(leases.mark(p.Submit("again", "f1", {})), 0.1) is not None
    assert leases.take(leases.mark(p.Submit("more", "f1", {})), 0.1) is None


def test_a_clients_calls_wait_for_a_lease_only_while_enough_are_at_the_scheduler() -> None:
    leases = Leases()
    for k in range(HEAD_WINDOW):
        assert not leases.hold_back("f1", 0.0)
        leases.to_head("f1", f"i{k}")
    assert leases.hold_back("f1", 0.0)  # the window is full: wait for a lease
    leases.granted(_grant(calls=10), 0.0)
    assert leases.adopt("lease:x", "i0") is not None  # handed to the lease: not at the head
    # a lease is open (its worker not probed yet, then reachable): a few at the scheduler
    assert leases.hold_back("f1", 0.0)
    leases.reach["tcp://127.0.0.1:1"] = Reach.OK
    for k in range(1, HEAD_WINDOW - LEASED_HEAD_WINDOW):
        assert leases.from_head(f"i{k}", 0.1)  # answered with a lease alive: still hold back
        assert leases.hold_back("f1", 0.1)
    assert leases.from_head(f"i{HEAD_WINDOW - LEASED_HEAD_WINDOW}", 0.1)
    assert not leases.hold_back("f1", 0.1)  # fewer than LEASED_HEAD_WINDOW there now
    leases.to_head("f1", "j")
    assert leases.hold_back("f1", 0.1)
    leases.ended("lease:x")
    assert leases.from_head("i62", 0.2)  # answered and no lease: to the scheduler a while
    assert not leases.hold_back("f1", 0.2)
    assert leases.hold_back("f1", 1.3) is (leases._head_count.get("f1", 0) >= HEAD_WINDOW)
    assert not leases.from_head("never-sent", 0.3)


def test_a_hand_over_holds_its_functions_calls_back_from_the_scheduler_a_while() -> None:
    leases = Leases()
    _reachable(leases, _grant(calls=100, seconds=10.0), now=0.0)
    assert not leases.hold_back("f1", 0.0)  # an open lease, none at the scheduler
    leases.handed("f1", 1.0)  # no device took its queued calls: a lease did
    assert leases.hold_back("f1", 1.0)
    assert leases.hold_back("f1", 1.0 + HANDED_SECONDS - 0.001)
    assert not leases.hold_back("f1", 1.0 + HANDED_SECONDS)
    assert not leases.hold_back("f2", 1.0)  # its own function only
    leases.ended("lease:x")
    assert not leases.hold_back("f1", 1.0)  # no lease open: nothing to wait for


def test_a_call_the_scheduler_ran_beside_its_own_open_lease_holds_calls_back_a_while() -> None:
    leases = Leases()
    g = p.LeaseGrant("lease:x", "f1", "tcp://127.0.0.1:1", "s", 10.0, 100, 0, device="n:0")
    _reachable(leases, g, now=0.0)
    sent = [p.Submit(f"c{i}", "f1", {}, lease=True) for i in range(3)]
    for sub in sent:
        leases.to_head("f1", sub.invocation_id)
    assert not leases.hold_back("f1", 1.0)  # a few at the scheduler: within the window
    leases.from_head("c0", 1.0, 0.001, ["n:1"])  # ran on a device no lease of ours holds
    assert not leases.hold_back("f1", 1.0)
    leases.from_head("c1", 1.0, 0.001, ["n:0"])  # beside our lease: no other device was free
    assert leases.hold_back("f1", 1.0)
    assert leases.hold_back("f1", 1.0 + HANDED_SECONDS - 0.001)
    assert not leases.hold_back("f1", 1.0 + HANDED_SECONDS)
    assert not leases.hold_back("f2", 1.0)
    leases.ended("lease:x")  # beside a lease that is over: nothing to hold back for
    leases.from_head("c2", 2.0, 0.001, ["n:0"])
    assert not leases.hold_back("f1", 2.0)


def test_a_leases_depth_follows_its_functions_run_time() -> None:
    leases = Leases()
    _reachable(leases, _grant(calls=1000, seconds=10.0), now=0.0)

    def taken() -> int:
        n = 0
        while leases.take(leases.mark(p.Submit(f"t{n}", "f1", {})), 0.1) is not None:
            n += 1
        for k in range(n):
            leases.withdraw(f"t{k}")
        return n

    assert taken() == MIN_DEPTH  # no call answered yet: one running, one waiting
    leases.observe("f1", 0.005)
    assert taken() == int(DEPTH_SECONDS / 0.005)  # 5 ms calls: 20 ms of work queued
    leases.observe("f2", 0.0)  # another function's run time is its own
    assert taken() == int(DEPTH_SECONDS / 0.005)
    slow = Leases()
    slow.observe("f1", 3.0)
    assert slow._depth("f1") == MIN_DEPTH
    fast = Leases()
    fast.observe("f1", DEPTH_SECONDS / LEASE_DEPTH)
    assert fast._depth("f1") == LEASE_DEPTH
    fast.observe("f1", None)  # no duration said: nothing learnt
    fast.observe("f1", -1.0)
    assert fast._run_time["f1"] == DEPTH_SECONDS / LEASE_DEPTH


def test_the_run_time_is_a_moving_average_of_answers_from_leases_and_the_scheduler() -> None:
    leases = Leases()
    _reachable(leases, _grant(calls=100, seconds=10.0), now=0.0)
    leases.take(leases.mark(p.Submit("a", "f1", {})), 0.1)
    leases.answered("a", True, 0.010)
    assert leases._run_time["f1"] == pytest.approx(0.010)
    leases.to_head("f1", "b")
    assert leases.from_head("b", 0.2, 0.020)
    assert leases._run_time["f1"] == pytest.approx(0.010 + RUN_TIME_WEIGHT * 0.010)
    leases.answered("never-sent", True, 5.0)  # not a call of a lease: not counted
    assert leases._run_time["f1"] == pytest.approx(0.010 + RUN_TIME_WEIGHT * 0.010)


def test_a_handed_call_past_the_leases_depth_is_left_to_the_client() -> None:
    leases = Leases()
    _reachable(leases, _grant(calls=100, seconds=10.0), now=0.0)
    leases.observe("f1", 0.005)
    depth = int(DEPTH_SECONDS / 0.005)
    for k in range(depth + 2):
        leases.to_head("f1", f"q{k}")
    got = [leases.adopt("lease:x", f"q{k}") for k in range(depth + 2)]
    assert [h is not None for h in got] == [True] * depth + [False, False]
    assert leases._head_count.get("f1", 0) == 0  # the scheduler has none of them any more
    assert not leases.in_flight(f"q{depth}") and leases.in_flight("q0")

def test_what_a_lease_ran_is_metered_once_from_reports_its_end_and_its_lost_clients_word() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    item = {"id": "d1", "ok": True, "s": 0.01, "wall": h.core.wall(h.now)}
    completed = h.core.devices["n:0"].completed
    h.feed(b"w0", p.LeaseReport(grant.lease_id, [item]))  # while it lasts
    h.feed(b"w0", p.LeaseReport(grant.lease_id, [item]))  # said twice: once
    calls = h.core.ops.usage.calls_total
    assert sum(calls.values()) == 2  # the first call and d1
    assert h.core.devices["n:0"].completed - completed == 1  # on its worker's device
    # Lost with its worker: its client says what it got answers for; only the new ones count.
    h.feed(b"sup", p.WorkerExited("n:0", 1, -9, "killed by signal 9", 1))
    h.hello(b"bob", p.Role.CLIENT)
    h.feed(b"bob", p.LeaseReport(grant.lease_id, [{"id": "d9", "ok": True}]))  # not its lease
    h.feed(b"cli", p.LeaseReport(grant.lease_id, [{"id": "d1", "ok": True},
                                                  {"id": "d2", "ok": False}]))
    assert sum(calls.values()) == 3
    assert h.core.devices["n:0"].completed - completed == 1  # the client names no device
    assert h.core.status(h.now)["leases"]["calls"] == 2
    h.feed(b"cli", p.LeaseReport("lease:unknown", [{"id": "x", "ok": True}]))  # no such lost lease
    assert sum(calls.values()) == 3


def test_a_lease_this_scheduler_does_not_know_is_metered_by_its_first_items_names() -> None:
    """A lease of the scheduler before a restart: its worker's first item names the
    function, app, version and user for all of the report's items."""
    book = LeaseBook()
    _open(book, max_calls=10)
    for inv in ("i1", "i2", "i3"):
        book.offer(b"c", _direct(inv), 10.1)
        book.finished(p.Result(inv, inv != "i2", "" if inv != "i2" else "UserError", ""),
                      0.01, 10.2)
        book.step(10.2)
    [report] = book.reports(10.5)
    assert [("fn" in i) for i in report.items] == [True, False, False]
    h = Harness(devices=1)
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1})
    h.feed(b"w0", report)
    assert h.core.ops.usage.calls_total == {("a", "f", 2, "succeeded"): 2, ("a", "f", 2, "failed"): 1}
    assert h.core.devices["n:0"].completed == 3  # counted on the reporting worker's device
    [row] = h.core.ops.usage.report(h.core.wall(h.now), by="user")
    assert (row["user"], row["calls"]) == ("ann", 3)
    h.feed(b"w0", p.LeaseReport("lease:y", [{"id": "z", "ok": True}]))  # names none
    assert h.core.ops.usage.calls_total[("", "?", 0, "succeeded")] == 1
    # A first item naming only the function: version 0, and no run time counts as none.
    h.feed(b"w0", p.LeaseReport("lease:z", [{"id": "z1", "ok": True, "fn": "g"}]))
    assert h.core.ops.usage.calls_total[("", "g", 0, "succeeded")] == 1
    from gpufn.scheduler.books.usage import BOUNDS
    assert h.core.ops.usage.duration[("", "g")].counts[BOUNDS.index(min(BOUNDS))] == 1


def test_the_worker_reports_what_a_lease_ran_while_it_lasts() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    book.offer(b"c", _direct("i1"), 10.0)
    book.finished(p.Result("i1", True, "", ""), 0.01, 10.05)
    assert book.reports(10.1) == []  # not yet: every 0.2 s
    [report] = book.reports(10.25)
    assert report.lease_id == "lease:x" and [i["id"] for i in report.items] == ["i1"]
    assert book.reports(10.6) == []  # said once


def test_a_lease_takes_calls_a_little_past_its_end_then_none() -> None:
    book = LeaseBook()
    _open(book, seconds=1.0, max_calls=10)  # opened at 10.0: ends at 11.0
    late = book.offer(b"c", _direct("i1"), 11.2)  # sent just before the client's end
    assert isinstance(late[0], Start) and late[0].run.meta.attempt_number == 1
    book.finished(p.Result("i1", True, "", ""), 0.01, 11.21)
    refused = book.offer(b"c", _direct("i2"), 11.3)
    assert isinstance(refused[0], Refuse) and refused[0].msg.reason == "the lease ran out"


def test_a_lease_ends_when_its_calls_are_spent_and_says_how_long_it_held() -> None:
    book = LeaseBook()
    _open(book, seconds=30.0, max_calls=3)
    for k in range(3):
        started = book.offer(b"c", _direct(f"i{k}"), 10.0 + k)
        assert isinstance(started[0], Start), started
        book.finished(p.Result(f"i{k}", True, "", ""), 0.5, 10.5 + k)
    end = [a for a in book.step(12.75) if isinstance(a, Ended)]
    assert len(end) == 1 and end[0].result.meta.duration == pytest.approx(2.75)
    assert end[0].result.ok and end[0].result.message == "its calls are spent"
    assert [i["id"] for i in end[0].result.meta.batch_items or []] == ["i0", "i1", "i2"]
    before = time.time()
    item = (end[0].result.meta.batch_items or [])[-1]
    assert before - 5.0 < item["wall"] <= before + 0.01  # when it started, wall clock


def test_the_worker_wakes_for_a_direct_call_waiting_for_its_lease() -> None:
    book = LeaseBook()
    book.offer(b"c", _direct("i1"), 9.5)
    assert book.next_deadline() == pytest.approx(11.5)
    _open(book)  # ends at 11.0: the earlier of the two
    assert book.next_deadline() == pytest.approx(11.0)


def test_a_lease_ended_long_ago_is_forgotten() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    book.revoke("lease:x", "done")
    book.step(10.0)
    assert isinstance(book.offer(b"c", _direct("i1"), 69.0)[0], Refuse)  # known as ended
    book.refuse_late(71.0)  # more than a minute on: forgotten
    assert book.offer(b"c", _direct("i2"), 71.0) == []  # could be a lease still to open


def test_a_cancel_that_beats_its_call_to_the_worker_still_cancels_it() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    assert book.cancel(b"c", "i1", "the map was stopped", 10.0) == ([], False)
    [answer] = book.offer(b"c", _direct("i1"), 10.1)
    assert isinstance(answer, Answer) and answer.result.error_kind == "Cancelled"
    assert isinstance(book.offer(b"c", _direct("i2"), 10.1)[0], Start)  # others run


def test_a_function_that_uses_shared_models_stays_with_the_scheduler() -> None:
    """Placement weighs waiting for the device that holds a model against loading another
    copy; a lease would take that device from the waiting call (a second copy loaded)."""
    h, _ = _leasing()
    model = {"name": "enc", "code_id": "0123456789abc", "memory": 2**30, "pin": False,
             "offload": True, "nframes": 1}
    h.feed(b"cli", p.Register("embed-1", "code-embed", "embed", {"count": 1}, [model],
                              (b"code", b"loader")))
    inv = _submit(h, "embed-1")
    key = next(iter(h.core.models.models))
    h.feed(b"w0", p.ModelEvent(key, p.ModelState.RESIDENT, 2**30, 1.0))
    h.finish(b"w0", inv)
    assert not _grants(h) and h.results()[inv].ok


def test_cancelled_calls_are_reported_as_cancelled_now_and_the_rest_as_they_ran() -> None:
    book = LeaseBook()
    run = p.Run("lease:x", "f1", "c1", "f", 77, p.RunMeta(lease=["s", 30.0, 10]))  # no user
    book.open(run, 10.0)
    assert book.revoke("lease:y", "unknown") is False
    book.cancel(b"c", "early", "by the caller", 10.0)
    book.offer(b"c", _direct("early"), 10.1)  # cancelled before it came
    book.offer(b"c", _direct("i1"), 10.1)
    book.offer(b"c", _direct("i2"), 10.1)
    book.cancel(b"c", "i2", "by the caller", 10.2)  # while it waited
    assert not any(isinstance(a, Ended) for a in book.step(10.3))  # calls left: it goes on
    book.finished(p.Result("i1", True, "", ""), None, 10.6)  # no duration measured
    [report] = book.reports(10.6)
    items = {i["id"]: i for i in report.items}
    now = time.time()
    for inv in ("early", "i2"):
        assert (items[inv]["ok"], items[inv]["kind"], items[inv]["s"]) == (False, "Cancelled", 0.0)
        assert abs(items[inv]["wall"] - now) < 5.0  # when it was cancelled: now
    assert items["i1"]["s"] == pytest.approx(0.5) and report.items[0]["user"] == ""
    assert all("fn" not in i for i in report.items[1:])  # the first names them for all


def test_cancels_of_calls_that_never_came_are_forgotten_after_a_minute() -> None:
    book = LeaseBook()
    _open(book, seconds=300.0, max_calls=10)
    book.cancel(b"c", "late", "by the caller", 10.0)
    book.refuse_late(71.0)
    assert isinstance(book.offer(b"c", _direct("late"), 71.0)[0], Start)  # not cancelled now


def test_a_call_cancelled_while_it_waits_fails_and_is_metered_as_cancelled_now() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    book.offer(b"c", _direct("i1"), 10.1)
    book.offer(b"c", _direct("i2"), 10.1)
    before = time.time()
    [answer], running = book.cancel(b"c", "i2", "by the caller", 10.2)
    after = time.time()
    assert isinstance(answer, Answer) and not answer.result.ok and not running
    book.finished(p.Result("i1", True, "", ""), 0.1, 10.3)
    [report] = book.reports(10.5)
    item = {i["id"]: i for i in report.items}["i2"]
    assert before <= item["wall"] <= after  # cancelled now, not in the future
    # One cancelled before it came is answered not ok as well, metered as of now.
    book.cancel(b"c", "i3", "by the caller", 10.5)
    before = time.time()
    [early] = book.offer(b"c", _direct("i3"), 10.6)
    after = time.time()
    assert isinstance(early, Answer) and not early.result.ok
    [report] = book.reports(11.0)
    assert before <= report.items[0]["wall"] <= after


def test_a_cancel_takes_only_the_call_it_names_from_its_own_client() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    book.offer(b"c", _direct("i1"), 10.1)  # runs
    book.offer(b"c", _direct("i2"), 10.1)
    book.offer(b"d", _direct("i3"), 10.1)
    book.offer(b"c", _direct("i4"), 10.1)
    assert book.cancel(b"d", "i4", "not its call", 10.2) == ([], False)
    [answer], _ = book.cancel(b"c", "i4", "by the caller", 10.2)
    assert answer.result.invocation_id == "i4" and answer.peer == b"c"
    book.finished(p.Result("i1", True, "", ""), 0.1, 10.3)
    started = []
    for t in (10.3, 10.4):
        [start] = [a for a in book.step(t) if isinstance(a, Start)]
        started.append(start.run.invocation_id)
        book.finished(p.Result(start.run.invocation_id, True, "", ""), 0.1, t)
    assert started == ["i2", "i3"] and book.step(10.5) == []


def test_what_ended_or_was_cancelled_is_remembered_a_minute_on_a_late_clock() -> None:
    """The worker's clock is monotonic (thousands of seconds): ended leases and early
    cancels are kept for a minute from when they happened, whatever the clock reads."""
    book = LeaseBook()
    _open(book, max_calls=10, at=5000.0)
    book.cancel(b"c", "gone", "by the caller", 5000.0)
    book.revoke("lease:x", "done")
    assert any(isinstance(a, Ended) for a in book.step(5000.0))
    assert book.refuse_late(5059.5) == []  # 59.5 s on: still remembered
    assert book.refuse_late(5060.0) == []  # a minute on, to the tick: still
    ended = book.offer(b"c", _direct("i1"), 5060.0)
    assert isinstance(ended[0], Refuse) and ended[0].msg.reason == "the lease ended"
    _open(book, max_calls=10, at=5060.0)  # a new lease under the same id
    [answer] = book.offer(b"c", _direct("gone"), 5060.0)
    assert isinstance(answer, Answer) and answer.result.error_kind == "Cancelled"


def test_a_direct_call_sent_at_the_very_end_of_the_grace_still_runs() -> None:
    book = LeaseBook()
    _open(book, seconds=1.0, max_calls=10)  # ends at 11.0; the grace runs to 11.25
    [first] = book.offer(b"c", _direct("i0"), 10.99)  # runs across the lease's end
    assert isinstance(first, Start)
    assert book.offer(b"c", _direct("i1"), 11.2) == []  # waits behind it, in the grace
    assert not any(isinstance(a, Ended) for a in book.step(11.25))
    assert book.next_deadline() == pytest.approx(11.25)  # busy: the grace's end
    book.finished(p.Result("i0", True, "", ""), 0.2, 11.25)
    [start] = book.step(11.25)
    assert isinstance(start, Start) and start.run.invocation_id == "i1"


def test_an_idle_lease_ends_at_its_end_not_after_the_grace() -> None:
    """Its client stopped sending MARGIN_SECONDS before: held through the grace, its
    device idled while that client's calls waited for it at the scheduler."""
    book = LeaseBook()
    _open(book, seconds=1.0, max_calls=10)  # ends at 11.0
    assert book.next_deadline() == pytest.approx(11.0)  # the shell wakes then
    assert not any(isinstance(a, Ended) for a in book.step(11.0))  # not before its end
    [ended] = book.step(11.001)
    assert isinstance(ended, Ended) and ended.result.message == "the lease ran out"
    [refused] = book.offer(b"c", _direct("late"), 11.1)  # a late call goes back
    assert isinstance(refused, Refuse)


def test_a_lease_reports_at_once_when_it_ran_many_calls_in_a_moment() -> None:
    from gpufn.worker.leases import REPORT_CALLS

    book = LeaseBook()
    _open(book, seconds=30.0, max_calls=10 * REPORT_CALLS)
    for k in range(REPORT_CALLS):
        if k == REPORT_CALLS - 1:
            assert book.reports(10.0) == []  # one short of the batch, no time passed
        [start] = book.offer(b"c", _direct(f"i{k}"), 10.0)
        assert isinstance(start, Start)
        book.finished(p.Result(f"i{k}", True, "", ""), 0.0, 10.0)
    [report] = book.reports(10.0)
    assert len(report.items) == REPORT_CALLS == 256


def test_the_worker_wakes_and_reports_a_report_interval_after_the_last() -> None:
    book = LeaseBook()
    _open(book, seconds=30.0, max_calls=10, at=0.0)  # times exact in binary from 0
    book.offer(b"c", _direct("i1"), 0.0)
    book.finished(p.Result("i1", True, "", ""), 0.01, 0.05)
    assert book.next_deadline() == pytest.approx(0.2)  # not the lease's end (30.0)
    [report] = book.reports(0.2)  # due at 0.2 s, to the tick
    assert [i["id"] for i in report.items] == ["i1"]


def test_a_direct_call_waiting_for_its_lease_wakes_the_worker_by_the_first_ones_time() -> None:
    book = LeaseBook()
    book.offer(b"c", _direct("i1"), 9.5)
    book.offer(b"c", _direct("i2"), 9.8)
    assert book.next_deadline() == pytest.approx(11.5)  # i1 is refused first


def test_the_worker_does_not_spin_on_a_lease_with_nothing_to_start() -> None:
    book = LeaseBook()
    _open(book, max_calls=10)
    assert not book.startable()  # open, nothing waits
    book.offer(b"c", _direct("i1"), 10.1)
    book.offer(b"c", _direct("i2"), 10.1)
    assert not book.startable()  # i2 waits for i1, which runs
    book.finished(p.Result("i1", True, "", ""), 0.1, 10.2)
    assert book.startable()


def test_direct_calls_waiting_for_a_lease_that_never_opens_are_refused_by_the_first() -> None:
    book = LeaseBook()
    book.offer(b"c", _direct("i1"), 9.5)
    book.offer(b"d", _direct("i2"), 11.0)
    assert book.refuse_late(11.5) == []  # i1 waited 2 s, to the tick: not yet
    refused = book.refuse_late(11.6)
    assert sorted((a.peer, a.msg.invocation_ids[0]) for a in refused
                  if isinstance(a, Refuse)) == [(b"c", "i1"), (b"d", "i2")]
    assert book.next_deadline() is None


def test_an_open_lease_with_calls_left_and_none_running_stays_open() -> None:
    book = LeaseBook()
    _open(book, seconds=30.0, max_calls=3)
    assert book.step(10.0) == []
    assert isinstance(book.offer(b"c", _direct("i1"), 10.1)[0], Start)
    book.finished(p.Result("i1", True, "", ""), 0.1, 10.2)
    assert book.step(10.3) == [] and "lease:x" in book.leases  # two calls left
    book.revoke("lease:x", "revoked: a call waits")
    [end] = book.step(10.4)
    assert isinstance(end, Ended) and end.result.ok
    assert end.result.message == "revoked: a call waits"  # its client hears why


def test_a_lease_asked_to_end_once_idle_ends_after_a_moment_without_a_call() -> None:
    from gpufn.worker.leases import IDLE_SECONDS
    book = LeaseBook()
    _open(book, seconds=30.0, max_calls=10)
    book.offer(b"c", _direct("i1"), 10.0)
    assert book.revoke("lease:x", "asked", when_idle=True)
    assert book.next_deadline() == pytest.approx(40.25)  # busy: its own end's grace
    book.finished(p.Result("i1", True, "", ""), 0.01, 10.02)
    assert book.next_deadline() == pytest.approx(10.02 + IDLE_SECONDS)  # wakes then
    assert not any(isinstance(a, Ended) for a in book.step(10.02 + IDLE_SECONDS * 0.9))
    [start] = book.offer(b"c", _direct("i2"), 10.06)  # still takes calls meanwhile
    assert isinstance(start, Start)
    book.finished(p.Result("i2", True, "", ""), 0.01, 10.07)
    assert not any(isinstance(a, Ended) for a in book.step(10.07 + IDLE_SECONDS - 0.001))
    [ended] = book.step(10.07 + IDLE_SECONDS)
    assert isinstance(ended, Ended) and "idle" in ended.result.message
    assert [i["id"] for i in ended.result.meta.batch_items or []] == ["i1", "i2"]


def test_a_lease_not_asked_to_end_once_idle_stays_open_idle_and_a_plain_revoke_ends_it() -> None:
    book = LeaseBook()
    _open(book, seconds=30.0, max_calls=10)
    book.offer(b"c", _direct("i1"), 10.0)
    book.finished(p.Result("i1", True, "", ""), 0.01, 10.02)
    assert len(book.reports(15.0)) == 1  # (what it ran, said)
    assert book.step(15.0) == [] and book.next_deadline() == pytest.approx(40.0)
    book.offer(b"c", _direct("i2"), 15.0)
    book.revoke("lease:x", "revoked by the scheduler", when_idle=True)
    book.revoke("lease:x", "revoked by the scheduler")  # now at once, though busy
    assert book.offer(b"c", _direct("i3"), 15.0)[0].msg.reason == "revoked by the scheduler"  # type: ignore[union-attr]
    book.finished(p.Result("i2", True, "", ""), 0.01, 15.001)
    [ended] = book.step(15.001)
    assert isinstance(ended, Ended) and ended.result.message == "revoked by the scheduler"


def test_a_cancel_carries_whether_it_takes_a_running_call_to_the_worker_shell() -> None:
    from gpufn.worker.core import Interrupt, control_actions
    assert control_actions(p.Cancel("lease:x", "r", False, 7)) == [Interrupt("lease:x", 7, False)]
    assert control_actions(p.Cancel("i", "r", True, 8)) == [Interrupt("i", 8, True)]


def test_revoking_every_lease_ends_each_of_them() -> None:
    book = LeaseBook()
    _open(book, seconds=30.0, max_calls=10)
    run = p.Run("lease:y", "f1", "c1", "f", 78, p.RunMeta(lease=["t", 30.0, 10, "ann"]))
    book.open(run, 10.0)
    book.revoke_all("the worker drains")
    ends = [a for a in book.step(10.1) if isinstance(a, Ended)]
    assert sorted((e.result.invocation_id, e.result.message) for e in ends) == [
        ("lease:x", "the worker drains"), ("lease:y", "the worker drains")]
    assert not book.leases


# ------------------------------------------------------------- client, mutation survivors


def _reachable(leases: Leases, *grants: p.LeaseGrant, now: float) -> None:
    for g in grants:
        assert leases.granted(g, now)
        leases.reach[g.endpoint] = Reach.OK


def test_equally_loaded_leases_take_calls_in_the_order_they_were_granted() -> None:
    leases = Leases()
    a = p.LeaseGrant("lease:1", "f1", "tcp://127.0.0.1:1", "s", 1.0, 100)
    b = p.LeaseGrant("lease:2", "f1", "tcp://127.0.0.1:2", "s", 1.5, 100)
    _reachable(leases, a, b, now=0.0)
    order = []
    for k in range(4):
        held = leases.take(leases.mark(p.Submit(f"i{k}", "f1", {})), 0.1)
        assert held is not None
        order.append(held.grant.lease_id)
    assert order == ["lease:1", "lease:2", "lease:1", "lease:2"]
    assert leases.direct_calls == 4  # each call sent under a lease counted once


def test_a_lease_takes_no_call_not_marked_for_one_nor_any_once_leases_are_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    leases = Leases()
    _reachable(leases, _grant(calls=10), now=0.0)
    assert leases.take(p.Submit("i1", "f1", {}), 0.1) is None  # asked for no lease
    assert leases.direct_calls == 0
    monkeypatch.setenv("GPUFN_LEASES", "0")
    off = Leases()
    assert not off.granted(_grant(calls=10), 0.0)  # leases off: the grant goes back
    off.on = True
    _reachable(off, _grant(calls=10), now=0.0)
    off.on = False
    assert off.take(p.Submit("i1", "f1", {}, lease=True), 0.1) is None


def test_a_lease_is_over_at_its_client_side_end_to_the_tick() -> None:
    leases = Leases()
    _reachable(leases, _grant(seconds=1.0, calls=10), now=0.0)
    [held] = leases._by_fn["f1"]
    assert leases.take(leases.mark(p.Submit("i1", "f1", {})), held.ends_at) is None
    assert leases.take(leases.mark(p.Submit("i2", "f1", {})), held.ends_at - 0.01) is held
    # The scheduler's answer at that very moment finds no live lease: calls move on freely.
    leases.to_head("f1", "h1")
    leases.to_head("f1", "h2")
    assert leases.from_head("h1", held.ends_at)  # (a spell without a lease starts)
    assert leases.from_head("h2", held.ends_at + DENIED_AFTER_SECONDS + 1e-9)
    for k in range(HEAD_WINDOW):
        leases.to_head("f1", f"w{k}")
    assert not leases.hold_back("f1", held.ends_at + 0.5)


def test_calls_adopted_by_a_lease_use_up_its_calls() -> None:
    leases = Leases()
    leases.observe("f1", 0.0)  # short calls: the full depth
    _reachable(leases, _grant(calls=3), now=0.0)
    assert leases.adopt("lease:x", "q1") is not None
    assert leases.adopt("lease:x", "q2") is not None
    assert leases.take(leases.mark(p.Submit("i1", "f1", {})), 0.1) is not None  # the third
    assert leases.take(leases.mark(p.Submit("i2", "f1", {})), 0.1) is None  # all spent
    assert leases.direct_calls == 3 and leases.in_flight("q1")
    assert leases.adopt("lease:gone", "q3") is None and not leases.in_flight("q3")


def test_a_refused_lease_does_not_keep_the_others_of_its_function_from_calls() -> None:
    now = time.monotonic()  # the table prunes by the monotonic clock
    leases = Leases()
    leases.observe("f1", 0.0)  # short calls: the full depth
    a = p.LeaseGrant("lease:1", "f1", "tcp://127.0.0.1:1", "s", 60.0, 100)
    b = p.LeaseGrant("lease:2", "f1", "tcp://127.0.0.1:2", "s", 60.0, 100)
    _reachable(leases, a, b, now=now)
    held = leases.take(leases.mark(p.Submit("i1", "f1", {})), now)
    assert held is not None and held.grant.lease_id == "lease:1"
    leases.refused(p.LeaseRefused("lease:1", ["i1"], "revoked"))
    for k in range(3):  # lease:1 is dead (time left or not): lease:2 takes them all
        h = leases.take(leases.mark(p.Submit(f"j{k}", "f1", {})), now + 0.1)
        assert h is not None and h.grant.lease_id == "lease:2"


def test_an_answer_from_the_scheduler_with_only_a_refused_lease_alive_lets_calls_go() -> None:
    now = time.monotonic()
    leases = Leases()
    _reachable(leases, _grant(seconds=60.0, calls=100), now=now)
    leases.refused(p.LeaseRefused("lease:x", [], "revoked"))
    for k in range(HEAD_WINDOW):
        leases.to_head("f1", f"w{k}")
    assert leases.hold_back("f1", now)
    assert leases.from_head("w0", now)  # answered: no live lease (the one left is dead)
    assert leases.from_head("w1", now + DENIED_AFTER_SECONDS + 1e-9)
    leases.to_head("f1", "w64")
    leases.to_head("f1", "w65")
    assert not leases.hold_back("f1", now + 0.5)


def test_calls_go_to_the_scheduler_freely_for_a_second_after_it_granted_none() -> None:
    """...once it has answered without one for DENIED_AFTER_SECONDS: at the first such
    answer a lease may be on its way (a .map's whole window had gone to the scheduler)."""
    leases = Leases()
    for k in range(HEAD_WINDOW + 4):
        leases.to_head("f1", f"w{k}")
    assert leases.from_head("w0", 10.0)  # no lease came with the answer
    assert leases.from_head("w1", 10.0 + DENIED_AFTER_SECONDS * 0.9)
    assert leases.hold_back("f1", 10.0 + DENIED_AFTER_SECONDS * 0.9)  # not yet
    assert leases.from_head("w2", 10.0 + DENIED_AFTER_SECONDS + 1e-9)  # still none: denied
    assert not leases.hold_back("f1", 10.5)
    assert not leases.hold_back("f1", 10.0 + DENIED_AFTER_SECONDS + DENIED_SECONDS - 0.01)
    assert leases.hold_back("f1", 11.25)  # a second on: wait for a lease again
    # A spell long after the last starts afresh: not denied at its first answer.
    assert leases.from_head("w3", 20.0)
    assert leases.hold_back("f1", 20.0)
    assert leases.from_head("w4", 20.0 + DENIED_AFTER_SECONDS + 1e-9)
    assert not leases.hold_back("f1", 20.0 + DENIED_AFTER_SECONDS + 1e-9)


def test_a_lease_that_ended_after_its_table_pruned_it_is_ended_quietly() -> None:
    leases = Leases()
    _reachable(leases, _grant(seconds=1.0, calls=10), now=0.0)  # long over by the clock
    other = p.LeaseGrant("lease:y", "f1", "tcp://127.0.0.1:1", "s", 1.0, 10)
    _reachable(leases, other, now=0.0)
    leases.refused(p.LeaseRefused("lease:y", [], "revoked"))  # prunes: both are over
    held = leases.ended("lease:x")  # the scheduler's word comes later
    assert held is not None and held.calls == set()


def test_a_lost_lease_reports_only_the_calls_it_got_answers_for() -> None:
    leases = Leases()
    leases.observe("f1", 0.0)  # short calls: the full depth
    _reachable(leases, _grant(calls=10), now=0.0)
    for k in range(3):
        leases.take(leases.mark(p.Submit(f"i{k}", "f1", {})), 0.1)
    held = leases.ended("lease:x")
    assert held is not None and held.report() is None  # nothing answered: nothing to say
    again = Leases()
    again.observe("f1", 0.0)  # short calls: the full depth
    _reachable(again, _grant(calls=10), now=0.0)
    for k in range(3):
        again.take(again.mark(p.Submit(f"i{k}", "f1", {})), 0.1)
    again.answered("i0", ok=True)
    again.answered("i2", ok=False)
    held = again.ended("lease:x")
    assert held is not None
    report = held.report()
    assert report is not None and report.lease_id == "lease:x"
    assert report.items == [{"id": "i0", "ok": True}, {"id": "i2", "ok": False}]


def test_an_unreachable_worker_is_said_at_once_without_its_key(
        caplog: pytest.LogCaptureFixture) -> None:
    leases = Leases()
    with caplog.at_level(logging.WARNING, logger="gpufn.client"):
        leases.unreachable("tcp://10.0.0.9:7000?key=SECRETKEY")
        said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "tcp://10.0.0.9:7000" in said[0] and "SECRETKEY" not in said[0]


def test_a_probe_has_two_seconds_before_its_worker_counts_unreachable() -> None:
    import zmq

    from gpufn.client.direct import DirectSockets

    ctx = zmq.Context()
    try:
        leases = Leases()
        leases.granted(_grant(ep="tcp://127.0.0.1:9"), 0.0)
        direct = DirectSockets(ctx, leases)
        direct.start_probes()
        sent = direct.probing["tcp://127.0.0.1:9"]
        assert direct.overdue(sent + 1.5) == []  # a slow network's answer still counts
        assert direct.overdue(sent + 2.5) == ["tcp://127.0.0.1:9"]
        for s in direct.socks.values():
            s.close(0)
    finally:
        ctx.term()


def test_a_spent_lease_listed_first_passes_its_calls_to_the_next() -> None:
    leases = Leases()
    a = p.LeaseGrant("lease:1", "f1", "tcp://127.0.0.1:1", "s", 1.0, 1)
    b = p.LeaseGrant("lease:2", "f1", "tcp://127.0.0.1:2", "s", 1.0, 100)
    _reachable(leases, a, b, now=0.0)
    taken = [leases.take(leases.mark(p.Submit(f"i{k}", "f1", {})), 0.1) for k in range(3)]
    assert [h.grant.lease_id if h else None for h in taken] == ["lease:1", "lease:2", "lease:2"]
    assert leases.endpoint_of("i0") == "tcp://127.0.0.1:1"
    assert leases.endpoint_of("i1") == "tcp://127.0.0.1:2"
    assert leases.endpoint_of("never-sent") is None


def test_calls_refused_or_ended_under_a_lease_are_no_longer_in_flight_there() -> None:
    leases = Leases()
    leases.observe("f1", 0.0)  # short calls: the full depth
    _reachable(leases, _grant(calls=10), now=0.0)
    for k in range(3):
        leases.take(leases.mark(p.Submit(f"i{k}", "f1", {})), 0.1)
    leases.refused(p.LeaseRefused("lease:x", ["i1"], "revoked"))  # i1 goes to the scheduler
    assert not leases.in_flight("i1") and leases.in_flight("i2")
    held = leases.ended("lease:x")  # then lost: only i0 and i2 are its to retry or fail
    assert held is not None and held.calls == {"i0", "i2"}
    assert not leases.in_flight("i0") and not leases.in_flight("i2")
    assert leases.endpoint_of("i2") is None


def test_the_table_forgets_leases_that_are_over_and_does_not_probe_their_workers() -> None:
    leases = Leases()
    leases.granted(_grant(seconds=1.0, ep="tcp://127.0.0.1:7"), 0.0)  # over long ago
    now = time.monotonic()
    live = p.LeaseGrant("lease:y", "f1", "tcp://127.0.0.1:8", "s", 60.0, 10)
    leases.granted(live, now)
    leases.refused(p.LeaseRefused("lease:z", [], "no such lease here"))  # a pass of pruning
    assert leases.endpoints_to_probe() == ["tcp://127.0.0.1:8"]


def test_the_count_of_calls_at_the_scheduler_goes_down_to_zero_one_by_one() -> None:
    leases = Leases()
    leases.granted(_grant(seconds=60.0), 0.0)
    leases.to_head("f1", "a")
    leases.to_head("f1", "b")
    assert leases.from_head("a", 0.0)  # a lease is alive: no free pass
    for k in range(HEAD_WINDOW - 1):
        leases.to_head("f1", f"w{k}")
    assert leases.hold_back("f1", 0.0)  # b and 63 more: the window is full


def test_answers_while_a_lease_is_alive_start_no_spell_toward_a_free_pass() -> None:
    leases = Leases()
    _reachable(leases, _grant(seconds=60.0, calls=1), now=0.0)
    for k in range(HEAD_WINDOW + 2):
        leases.to_head("f1", f"w{k}")
    assert leases.from_head("w0", 0.0)  # a lease is alive (spent, not over): no spell
    leases.ended("lease:x")
    assert leases.from_head("w1", 0.0 + DENIED_AFTER_SECONDS + 1e-9)  # the spell starts
    assert leases.hold_back("f1", 0.2)  # not denied yet: the window holds


def test_a_spell_without_a_lease_goes_on_across_a_gap_of_exactly_its_free_pass() -> None:
    leases = Leases()
    for k in range(HEAD_WINDOW + 2):
        leases.to_head("f1", f"w{k}")
    assert leases.from_head("w0", 10.0)
    assert leases.from_head("w1", 10.0 + DENIED_SECONDS)  # the same spell: denied
    assert not leases.hold_back("f1", 10.0 + DENIED_SECONDS)


# ------------------------------------------------------- scheduler, mutation survivors


def test_a_lease_on_one_of_two_devices_takes_every_other_queued_call() -> None:
    h = Harness(devices=2, pipeline_depth=0)
    for i in (0, 1):
        h.hello(f"w{i}".encode(), p.Role.WORKER,
                info={"device": f"n:{i}", "incarnation": 1, "direct": f"tcp://127.0.0.1:59{i}0"})
    fid = h.register("f")
    calls = [_submit(h, fid) for _ in range(6)]  # two run, four wait
    running = [r.invocation_id for r in h.runs()]
    queued = [c for c in calls if c not in running]
    h.finish(b"w0", running[0])
    [grant] = _grants(h)
    assert grant.reclaimed == queued[::2]  # the lease and the other device share the queue
    assert [q for q in queued if q in h.core.invocations] == queued[1::2]


def test_no_lease_on_a_device_that_runs_another_clients_call() -> None:
    h, fid = _leasing()
    h.hello(b"bob", p.Role.CLIENT)
    g = h.register("g")
    mine = _submit(h, fid)
    theirs = _submit(h, g, client=b"bob", lease=False)  # another function: beside it
    assert {r.invocation_id for r in h.runs(b"w0")} == {mine, theirs}
    h.finish(b"w0", mine)
    assert not _grants(h)


def test_a_lease_does_not_send_its_worker_the_code_it_already_has() -> None:
    h, fid = _leasing()
    _granted(h, fid)
    loads = [s for s in h.sent if isinstance(s.msg, p.LoadCode) and s.peer == b"w0"]
    assert len(loads) == 1  # the first call's; the lease runs the same code


def test_calls_a_lease_ran_count_among_their_functions_calls_in_the_status() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    before = next(f["calls"] for f in h.core.status(h.now)["functions"] if f["name"] == "f")
    items = [{"id": f"d{i}", "ok": True, "s": 0.01} for i in range(3)]
    h.feed(b"w0", p.LeaseReport(grant.lease_id, items))
    after = next(f["calls"] for f in h.core.status(h.now)["functions"] if f["name"] == "f")
    assert after == before + 3


def test_the_scheduler_remembers_the_metered_calls_of_its_last_1024_leases() -> None:
    h, _ = _leasing()
    calls = h.core.ops.usage.calls_total

    def report(lease: str) -> None:
        h.feed(b"w0", p.LeaseReport(lease, [{"id": "d", "ok": True, "fn": "f", "s": 0.0}]))

    for i in range(1024):
        report(f"lease:{i}")
    assert sum(calls.values()) == 1024
    report("lease:0")  # repeated (a worker's restart): the 1024th lease back, still known
    assert sum(calls.values()) == 1024
    report("lease:new")  # 1025 leases: the oldest is forgotten
    report("lease:1")
    assert sum(calls.values()) == 1025
    report("lease:0")  # forgotten: metered again
    assert sum(calls.values()) == 1026


def test_the_status_counts_the_leases_granted() -> None:
    h, fid = _leasing()
    assert h.core.status(h.now)["leases"]["granted"] == 0
    _granted(h, fid)
    assert h.core.status(h.now)["leases"]["granted"] == 1


def test_a_waiting_call_revokes_a_newer_lease_past_one_already_revoked() -> None:
    h = _two_leasing()
    h.hello(b"bob", p.Role.CLIENT)
    fid = h.register("f")
    first, second = _submit(h, fid), _submit(h, fid)  # one on each device
    where = {r.invocation_id: r for r in h.runs()}
    w_first = b"w0" if where[first] in h.runs(b"w0") else b"w1"
    w_second = b"w1" if w_first == b"w0" else b"w0"
    h.finish(w_first, first)
    [a] = _grants(h)
    x = _submit(h, fid, client=b"bob", lease=False)  # waits: revokes lease a
    h.feed(b"bob", p.Cancel(x, "changed my mind"))  # and goes: nothing waits now
    h.finish(w_second, second)
    b = _grants(h)[-1]
    assert b.lease_id != a.lease_id
    _submit(h, fid, client=b"bob", lease=False)  # waits again: lease b is revoked too

    def cancels(lease_id: str) -> int:
        return len([s for s in h.sent if isinstance(s.msg, p.Cancel)
                    and s.msg.invocation_id == lease_id])
    assert cancels(a.lease_id) == 1 and cancels(b.lease_id) == 1


def test_no_lease_beside_the_clients_own_call_of_another_function() -> None:
    h, fid = _leasing()
    g = h.register("g")
    mine = _submit(h, fid)
    other = _submit(h, g, lease=False)  # the same client's other function, beside it
    assert {r.invocation_id for r in h.runs(b"w0")} == {mine, other}
    h.finish(b"w0", mine)
    assert not _grants(h)


def test_only_a_lost_leases_own_client_says_what_ran_under_it_with_no_run_time() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    usage = h.core.ops.usage
    h.feed(b"sup", p.WorkerExited("n:0", 1, -9, "killed by signal 9", 1))
    calls = sum(usage.calls_total.values())
    h.hello(b"bob", p.Role.CLIENT)
    h.feed(b"bob", p.LeaseReport(grant.lease_id, [{"id": "d9", "ok": True}]))
    assert sum(usage.calls_total.values()) == calls  # not bob's lease: nothing metered
    seconds = sum(hist.total for hist in usage.duration.values())
    h.feed(b"cli", p.LeaseReport(grant.lease_id, [{"id": "d1", "ok": True}]))
    assert sum(usage.calls_total.values()) == calls + 1
    assert sum(hist.total for hist in usage.duration.values()) == seconds  # unknown: 0 s


def test_a_leases_calls_count_in_the_schedulers_counters_by_outcome() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    before = dict(h.core.counters.as_dict())
    items = [{"id": "a", "ok": True, "s": 0.1}, {"id": "b", "ok": False, "kind": "UserError"},
             {"id": "c", "ok": False, "kind": "Cancelled"}, {"id": "d", "ok": True},
             {"id": "e", "ok": False, "kind": "WorkerLost"}]
    h.feed(b"w0", p.LeaseReport(grant.lease_id, items))
    after = h.core.counters.as_dict()
    delta = {k: after[k] - before[k] for k in ("submitted", "succeeded", "failed", "cancelled")}
    assert delta == {"submitted": 5, "succeeded": 2, "failed": 2, "cancelled": 1}


def test_a_leases_calls_are_metered_with_the_run_time_its_worker_measured() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    usage = h.core.ops.usage
    seconds = sum(hist.total for hist in usage.duration.values())
    h.feed(b"w0", p.LeaseReport(grant.lease_id, [{"id": "a", "ok": True, "s": 0.25,
                                                   "wall": h.core.wall(h.now)}]))
    assert sum(hist.total for hist in usage.duration.values()) - seconds == pytest.approx(0.25)


def test_no_lease_on_a_worker_without_a_direct_endpoint() -> None:
    h = Harness(devices=1)
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1})  # no `direct`
    fid = h.register("f")
    h.finish(b"w0", _submit(h, fid))
    assert not _grants(h)


def test_a_lease_is_dispatched_under_a_token_of_its_own_and_leaves_the_device_clean() -> None:
    h, fid = _leasing()
    _, grant, run = _granted(h, fid)
    tokens = [r.dispatch_token for r in h.runs(b"w0")]
    assert len(set(tokens)) == len(tokens)  # the call's and the lease's differ
    d = h.core.devices["n:0"]
    h.feed(b"w0", p.Result(grant.lease_id, True, "", "spent",
                           p.ResultMeta(dispatch_token=run.dispatch_token, batch_items=[])))
    assert not d.running and not d.running_by_fn  # nothing counted as running there


def test_a_higher_priority_call_revokes_a_lease_and_never_requeues_it() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    h.hello(b"bob", p.Role.CLIENT)
    urgent = h.register("f", priority=9)
    _submit(h, urgent, client=b"bob", lease=False)
    h.tick(1.0)
    lease = h.core.invocations[grant.lease_id]
    assert lease.state is InvState.RUNNING and lease not in list(h.core.queue)
    cancels = [s.msg for s in h.sent if isinstance(s.msg, p.Cancel)
               and s.msg.invocation_id == grant.lease_id]
    assert [c.reason for c in cancels] == ["revoked: a call waits"]


def test_the_scheduler_remembers_the_clients_of_its_latest_lost_leases(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufn.scheduler.desks import lease_desk

    monkeypatch.setattr(lease_desk, "ACCOUNTED_MEMORY", 2)  # the bound, made small
    h = Harness(devices=3)
    for i in range(3):
        h.hello(f"w{i}".encode(), p.Role.WORKER,
                info={"device": f"n:{i}", "incarnation": 1, "direct": f"tcp://127.0.0.1:59{i}0"})
    fid = h.register("f")
    lost = []
    for _ in range(3):  # a lease on each device in turn, each lost with its worker
        inv = _submit(h, fid)
        worker = next(s.peer for s in h.sent if isinstance(s.msg, p.Run)
                      and s.msg.invocation_id == inv)
        h.finish(worker, inv)
        lease_id = _grants(h)[-1].lease_id
        h.feed(b"sup", p.WorkerExited(f"n:{worker.decode()[1:]}", 1, -9, "killed by signal 9", 1))
        lost.append(lease_id)
    assert len(set(lost)) == 3
    calls = h.core.ops.usage.calls_total
    for k, lease_id in enumerate(lost):
        before = sum(calls.values())
        h.feed(b"cli", p.LeaseReport(lease_id, [{"id": f"d{k}", "ok": True}]))
        assert sum(calls.values()) - before == (0 if k == 0 else 1), k  # the oldest forgotten


def test_a_clients_own_waiting_call_goes_under_its_lease_and_revokes_no_other() -> None:
    h = _two_leasing()
    h.hello(b"bob", p.Role.CLIENT)
    fid = h.register("f")

    def lease_for(client: bytes) -> p.LeaseGrant:
        inv = _submit(h, fid, client=client)
        worker = next(s.peer for s in h.sent if isinstance(s.msg, p.Run)
                      and s.msg.invocation_id == inv)
        h.finish(worker, inv)
        return _grants(h, client)[-1]

    mine, theirs = lease_for(b"cli"), lease_for(b"bob")  # one on each device
    waiting = _submit(h, fid)  # cli's call waits (both devices leased): its lease takes it
    assert [g.lease_id for g in _grants(h) if waiting in g.reclaimed] == [mine.lease_id]
    assert not any(isinstance(s.msg, p.Cancel) for s in h.sent)  # nobody waits now
    _submit(h, fid, lease=False)  # one that takes no lease waits: both leases end
    revoked = {s.msg.invocation_id for s in h.sent if isinstance(s.msg, p.Cancel)}
    assert revoked == {mine.lease_id, theirs.lease_id}


def test_a_call_withdrawn_before_it_was_sent_is_not_reported_as_answered() -> None:
    """A call parked for a probe that never came back goes through the scheduler, which
    meters it; the lease, lost with its worker, must not report it as run there too."""
    leases = Leases()
    _reachable(leases, _grant(calls=10), now=0.0)
    for k in range(2):
        leases.take(leases.mark(p.Submit(f"i{k}", "f1", {})), 0.1)
    leases.answered("i0", ok=True)
    leases.withdraw("i1")  # parked, never sent
    assert not leases.in_flight("i1")
    held = leases.ended("lease:x")
    assert held is not None and held.calls == set()
    report = held.report()
    assert report is not None and report.items == [{"id": "i0", "ok": True}]


def test_a_new_lease_ends_the_free_pass_to_the_scheduler_a_denial_gave() -> None:
    leases = Leases()
    for k in range(HEAD_WINDOW + 2):
        leases.to_head("f1", f"i{k}")
    assert leases.from_head("i0", 0.0)  # answered with no lease...
    assert leases.from_head("i1", 0.1)  # ... for a while: to the scheduler a while
    assert not leases.hold_back("f1", 0.1)
    leases.granted(_grant(calls=100, seconds=10.0), 0.2)  # then a lease came after all
    assert leases.hold_back("f1", 0.3)  # 64 at the scheduler, a lease open: hold back
    leases.ended("lease:x")
    for k in range(3):
        leases.to_head("f1", f"j{k}")
    assert leases.from_head("i2", 0.4)  # the next spell without one starts afresh
    assert leases.hold_back("f1", 0.4)


def test_the_run_time_average_moves_part_of_the_way_to_each_new_one() -> None:
    leases = Leases()
    leases.observe("f1", 0.010)
    leases.observe("f1", 0.020)
    assert 0.010 < leases._run_time["f1"] < 0.015  # toward the new one, by less than half


def test_a_function_with_one_call_left_at_the_scheduler_still_counts_it() -> None:
    leases = Leases()
    _reachable(leases, _grant(calls=100, seconds=10.0), now=0.0)
    leases.to_head("f1", "a")
    leases.to_head("f1", "b")
    assert leases.from_head("a", 0.1)  # "b" is still at the scheduler
    for inv in ("c", "d"):
        leases.to_head("f1", inv)
    assert not leases.hold_back("f1", 0.1)  # three there: one more may go
    leases.to_head("f1", "e")
    assert leases.hold_back("f1", 0.1)  # LEASED_HEAD_WINDOW there: the rest wait


def test_a_clients_cancel_of_a_call_it_sent_under_a_lease_reaches_the_workers_control() -> None:
    """The worker's main thread reads a lease's calls (and their cancels) only between
    calls: a running inline one is interrupted from its control thread, as a scheduled
    call is. Only the client's own leases' devices are told, and only to stop a running
    call."""
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    h.hello(b"bob", p.Role.CLIENT)

    def cancels() -> list[tuple[bytes, p.Cancel]]:
        return [(s.peer, s.msg) for s in h.sent if isinstance(s.msg, p.Cancel)
                and s.msg.invocation_id == "leased-1"]

    h.feed(b"bob", p.Cancel("leased-1", "not theirs"))
    h.feed(b"cli", p.Cancel("leased-1", "only if waiting", include_running=False))
    assert cancels() == []
    h.feed(b"cli", p.Cancel("leased-1", "stop it"))
    assert [(peer, c.reason, c.include_running, c.dispatch_token) for peer, c in cancels()] == [
        (b"w0c", "stop it", True, 0)]
    h.feed(b"cli", p.Cancel("leased-2"))
    assert [c.reason for s in h.sent if isinstance(c := s.msg, p.Cancel)
            and c.invocation_id == "leased-2"] == ["cancelled by the caller"]
    assert grant.lease_id in h.core.leases.open  # the lease itself goes on


def test_a_call_of_another_client_that_runs_beside_a_lease_revokes_it() -> None:
    """Not waiting (the device had room), but the device is wanted by more than the
    lease's holder: the lease ends, and that other client's next call may get one."""
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    h.hello(b"bob", p.Role.CLIENT)

    def revoked() -> list[str]:
        return [s.msg.reason for s in h.sent if isinstance(s.msg, p.Cancel)
                and s.msg.invocation_id == grant.lease_id]

    mine = _submit(h, h.register("g"))  # its own client's other function, beside it
    assert mine in h.core.devices["n:0"].running
    h.finish(b"w0", mine)
    assert revoked() == ["its client's other calls want the device"]  # once idle only
    inv = _submit(h, h.register("b"), client=b"bob")
    assert inv in h.core.devices["n:0"].running  # beside the lease: the device had room
    h.finish(b"w0", inv)
    assert revoked()[1:] == ["revoked: another client's calls run beside it"]
    [hard] = [s.msg for s in h.sent if isinstance(s.msg, p.Cancel) and s.msg.reason.startswith(
        "revoked")]
    assert hard.include_running  # at once, busy or not
    assert not _grants(h, b"bob")  # not while the revoked one holds the device


def test_its_clients_other_function_ending_beside_a_lease_asks_it_to_end_once_idle() -> None:
    """A finished .map's leases, idle on every device, had kept the next function's calls
    off leases for up to their second. They end once idle now (a thread alternating the
    two keeps its lease: the worker ends it only after IDLE_SECONDS without a call); then
    the other function's next call there gets a lease."""
    h, fid = _leasing()
    _, grant, run = _granted(h, fid)
    g = h.register("g")

    def asked() -> list[p.Cancel]:
        return [s.msg for s in h.sent if isinstance(s.msg, p.Cancel)
                and s.msg.invocation_id == grant.lease_id]

    h.finish(b"w0", _submit(h, g))
    h.finish(b"w0", _submit(h, g))
    [ask] = asked()  # once
    assert not ask.include_running and ask.dispatch_token == run.dispatch_token
    assert [s.peer for s in h.sent if s.msg is ask] == [b"w0c"]  # its control channel
    lease = h.core.invocations[grant.lease_id]
    assert lease.preempt_asked is None and grant.lease_id in h.core.leases.open  # still open
    assert not _grants(h)[1:]
    h.feed(b"w0", p.Result(grant.lease_id, True, "", "idle", p.ResultMeta(
        dispatch_token=run.dispatch_token, batch_items=[])))
    assert grant.lease_id not in h.core.leases.open
    h.finish(b"w0", _submit(h, g))
    assert _grants(h)[-1].function_id == g


def test_another_clients_call_revokes_a_lease_that_runs_after_its_clients_own_call() -> None:
    """The device's running calls are looked at past a plain call (the lease's client's
    own call of its function, running there since before the lease)."""
    h, fid = _leasing()
    h.finish(b"w0", _submit(h, fid, lease=False), duration=0.0005)  # short: pipelined
    first, second = _submit(h, fid), _submit(h, fid)
    assert {first, second} <= {r.invocation_id for r in h.runs(b"w0")}
    h.finish(b"w0", first, duration=0.0005)
    [grant] = _grants(h)
    running = list(h.core.devices["n:0"].running)
    assert running == [second, grant.lease_id]  # the plain call first
    h.hello(b"bob", p.Role.CLIENT)
    theirs = _submit(h, h.register("b"), client=b"bob")
    h.finish(b"w0", theirs)
    assert [s.msg.reason for s in h.sent if isinstance(s.msg, p.Cancel)] == [
        "revoked: another client's calls run beside it"]


def test_the_leases_asked_to_end_once_idle_are_remembered_only_while_open() -> None:
    h, fid = _leasing()
    g = h.register("g")
    for _ in range(6):
        _, grant, run = _granted(h, fid)
        h.finish(b"w0", _submit(h, g))  # asks it to end once idle
        h.feed(b"w0", p.Result(grant.lease_id, True, "", "idle", p.ResultMeta(
            dispatch_token=run.dispatch_token, batch_items=[])))
        assert len(h.core.leases._idle_asked) <= len(h.core.leases.open) + 1
    asks = [s for s in h.sent if isinstance(s.msg, p.Cancel) and not s.msg.include_running]
    assert len(asks) == 6


def test_a_lease_in_its_last_quarter_is_not_asked_to_end_once_idle() -> None:
    h, fid = _leasing(lease_seconds=1.0)
    h.finish(b"w0", _submit(h, fid), duration=0.0005)
    [grant] = _grants(h)
    started = h.core.invocations[grant.lease_id].run_started
    assert started is not None
    g = h.register("g")
    _ends_at(h, g, started + 0.76)
    assert not [s for s in h.sent if isinstance(s.msg, p.Cancel)]  # it ends by itself soon


# ---------------------------------- scheduler, mutation survivors (renewal, hand-over)


def test_a_lost_leases_calls_its_client_reports_are_metered_in_the_minute_of_the_report() -> None:
    h, fid = _leasing()
    _, grant, _ = _granted(h, fid)
    h.feed(b"sup", p.WorkerExited("n:0", 1, -9, "killed by signal 9", 1))
    wall = h.core.wall(h.now)
    h.tick((wall // 60 + 1) * 60 + 0.5 - wall)  # half a second into a minute (wall clock)
    usage = h.core.ops.usage

    def this_minute() -> int:
        return sum(r["calls"] for r in usage.report(h.core.wall(h.now), since=0.25))

    before = this_minute()
    h.feed(b"cli", p.LeaseReport(grant.lease_id, [{"id": "d1", "ok": True}]))
    assert this_minute() == before + 1  # no run time: it ended as it was reported


def _ends_at(h: Harness, fid: str, at: float) -> None:
    """A call of cli's through the scheduler runs beside its lease and ends at `at`."""
    inv = _submit(h, fid)
    assert h.runs(b"w0")[-1].invocation_id == inv  # a free slot beside the lease
    h.now = at
    h.feed(b"w0", p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=h.token(inv),
                                                          duration=0.0005), (b"value",)))


@pytest.mark.parametrize("seconds, renewable", [(1.0, 0.25), (0.2, 0.1)])
def test_a_lease_is_renewed_from_its_last_quarter_or_last_tenth_of_a_second_to_the_tick(
        seconds: float, renewable: float) -> None:
    """The last quarter of a lease, but at least its last RENEW_SECONDS (0.1 s): a short
    lease's client stops using it 50 ms before its end."""
    h, fid = _leasing(lease_seconds=seconds)
    h.finish(b"w0", _submit(h, fid), duration=0.0005)
    [first] = _grants(h)
    started = h.core.invocations[first.lease_id].run_started
    assert started is not None
    _ends_at(h, fid, started + seconds - renewable - 0.01)
    assert len(_grants(h)) == 1
    _ends_at(h, fid, started + seconds - renewable)
    assert len(_grants(h)) == 2 and _grants(h)[1].lease_id != first.lease_id


def test_a_clients_waiting_calls_are_not_shared_with_its_lease_that_is_ending() -> None:
    h = _two_leasing(pipeline_depth=0, lease_seconds=1.0)
    fid = h.register("f")
    first, second, worker_of = _one_on_each(h, fid)
    h.finish(worker_of[first], first)
    [a] = _grants(h)
    waiting = [_submit(h, fid) for _ in range(4)]  # behind `second`, run without a lease
    assert len(h.core.queue) == 4
    h.tick(0.8)  # lease a is in its last quarter: its client stops using it soon
    h.finish(worker_of[second], second)
    b = _grants(h)[-1]
    assert b.lease_id != a.lease_id
    # b takes its share at its grant (every other call: two devices), then the rest, in
    # queue order: none is left for a.
    assert [i for g in _grants(h)[1:] for i in g.reclaimed] == waiting[::2] + waiting[1::2]
    assert all(g.lease_id == b.lease_id for g in _grants(h)[1:]) and len(h.core.queue) == 0


def test_a_clients_waiting_calls_are_shared_by_all_its_leases_in_one_pass() -> None:
    h = _two_leasing(pipeline_depth=0, lease_seconds=10.0)
    fid = h.register("f")
    first, second, worker_of = _one_on_each(h, fid)
    h.finish(worker_of[first], first)
    [a] = _grants(h)
    waiting = [_submit(h, fid) for _ in range(8)]  # behind `second`, run without a lease
    h.finish(worker_of[second], second)
    b = _grants(h)[-1]
    assert b.lease_id != a.lease_id
    # b's grant takes every other call; in the same pass a takes every other call of the
    # rest (two leases), and b the rest of those: nothing waits.
    taken: dict[str, list[str]] = {g.lease_id: [] for g in (a, b)}
    for g in _grants(h)[1:]:
        taken[g.lease_id] += g.reclaimed
    assert taken[a.lease_id] == [waiting[1], waiting[5]]
    assert taken[b.lease_id] == [*waiting[::2], waiting[3], waiting[7]]
    assert len(h.core.queue) == 0


def test_a_call_waiting_beside_its_clients_ending_lease_revokes_another_clients_lease() -> None:
    h = _two_leasing(pipeline_depth=0, lease_seconds=1.0)
    h.hello(b"bob", p.Role.CLIENT)
    fid = h.register("f")
    mine = _submit(h, fid)
    theirs = _submit(h, fid, client=b"bob")  # one on each device
    worker_of = {r.invocation_id: peer for peer in (b"w0", b"w1") for r in h.runs(peer)}
    h.finish(worker_of[mine], mine)
    [a] = _grants(h)
    h.tick(0.8)  # a is in its last quarter: it takes no more calls through the scheduler
    h.finish(worker_of[theirs], theirs)
    [b] = _grants(h, b"bob")
    _submit(h, fid)  # cli's call waits: a lets it wait for a device, b is revoked for it
    revoked = [s.msg.invocation_id for s in h.sent if isinstance(s.msg, p.Cancel)]
    assert revoked == [b.lease_id] and a.lease_id in h.core.leases.open


def test_no_lease_while_its_clients_own_call_that_takes_none_waits() -> None:
    h, fid = _leasing(pipeline_depth=0)
    first = _submit(h, fid)
    spawned = _submit(h, fid, lease=False)  # waits behind it (one slot)
    h.finish(b"w0", first)
    assert not _grants(h)
    assert h.runs(b"w0")[-1].invocation_id == spawned  # the device is its next


def test_a_clients_cancel_under_a_lease_reaches_its_lease_past_another_clients() -> None:
    h = _two_leasing()
    h.hello(b"bob", p.Role.CLIENT)
    fid = h.register("f")

    def lease_for(client: bytes) -> tuple[bytes, p.LeaseGrant]:
        inv = _submit(h, fid, client=client)
        worker = next(s.peer for s in h.sent if isinstance(s.msg, p.Run)
                      and s.msg.invocation_id == inv)
        h.finish(worker, inv)
        return worker, _grants(h, client)[-1]

    lease_for(b"bob")  # opened first: the first the cancel meets
    mine, _ = lease_for(b"cli")
    h.feed(b"cli", p.Cancel("leased-1", "stop it"))
    assert [s.peer for s in h.sent if isinstance(s.msg, p.Cancel)
            and s.msg.invocation_id == "leased-1"] == [mine]


def test_a_busy_leases_call_offered_at_the_graces_very_end_is_taken() -> None:
    book = LeaseBook()
    _open(book, seconds=1.0, max_calls=10)  # ends at 11.0; the grace runs to 11.25
    [first] = book.offer(b"c", _direct("i0"), 10.99)  # runs across the lease's end
    assert isinstance(first, Start)
    assert book.offer(b"c", _direct("i1"), 11.25) == []  # waits behind it: not refused
    [late] = book.offer(b"c", _direct("i2"), 11.2501)
    assert isinstance(late, Refuse) and late.msg.reason == "the lease ran out"


def test_a_lease_running_its_last_call_wakes_the_worker_at_the_graces_end_not_its_end() -> None:
    book = LeaseBook()
    _open(book, seconds=1.0, max_calls=10)  # ends at 11.0; the grace runs to 11.25
    [first] = book.offer(b"c", _direct("i0"), 10.99)  # nothing waits behind it
    assert isinstance(first, Start)
    assert book.next_deadline() == pytest.approx(11.25)  # busy: not at its end (11.0)
