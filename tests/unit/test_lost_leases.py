"""Calls in flight under a lease lost with its worker: the scheduler reads the dead
worker's journal (`WorkerExited.started`) and runs again, as if first sent, those that
never started there (scheduler/desks/lost_leases.py), over the core's harness."""

from __future__ import annotations

import pytest

from gpufn.scheduler.desks.lost_leases import JOURNAL_WAIT_SECONDS, LostLeases, Verdict
from gpufn.wire import protocol as p

from .core_harness import Harness

pytestmark = pytest.mark.timeout(30)


def _leased(retries: int = 0) -> tuple[Harness, str, p.LeaseGrant]:
    h = Harness(devices=1)
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1,
                                        "direct": "tcp://127.0.0.1:5999"}, pid=41)
    h.hello(b"w0c", p.Role.WORKER, info={"device": "n:0", "incarnation": 1,
                                         "channel": "control"}, pid=41)
    fid = h.register("f", retries=retries)
    h.feed(b"cli", p.Submit("first", fid, {}, lease=True, frames=(b"args",)))
    h.finish(b"w0", "first")
    [grant] = [s.msg for s in h.sent if isinstance(s.msg, p.LeaseGrant)]
    return h, fid, grant


def _again(h: Harness, fid: str, grant: p.LeaseGrant, inv: str) -> None:
    """What the client sends for a call in flight under the lost lease (`leases.lost`)."""
    h.feed(b"cli", p.Submit(inv, fid, {}, lease=True, prior_attempts=1, prior_device="n:0",
                            prior_lease=grant.lease_id, frames=(b"args",)))


def _exited(started: list[str], journaled: bool = True) -> p.WorkerExited:
    return p.WorkerExited("n:0", 41, -9, "killed by signal 9", 1, started, journaled)


def _new_worker(h: Harness) -> None:
    h.hello(b"w1", p.Role.WORKER, info={"device": "n:0", "incarnation": 2,
                                        "direct": "tcp://127.0.0.1:5998"}, pid=42)


def test_a_call_that_never_started_on_the_lost_worker_runs_as_if_first_sent() -> None:
    """retries=0: the call the journal holds fails WorkerLost (it may have run, and says
    how to have such calls retried); the one queued behind it, not in the journal, runs
    on the next worker as attempt 1."""
    h, fid, grant = _leased(retries=0)
    h.feed(b"sup", _exited(["ran-1"]))
    _again(h, fid, grant, "ran-1")
    _again(h, fid, grant, "queued-1")
    ran = h.results()["ran-1"]
    assert not ran.ok and ran.error_kind == "WorkerLost"
    assert "killed by signal 9" in ran.message and "Set retries=N" in ran.message
    assert "queued-1" not in h.results()
    _new_worker(h)
    [run] = [r for r in h.runs(b"w1") if r.invocation_id == "queued-1"]
    assert run.meta.attempt_number == 1
    assert h.core.counters.retried == 0


def test_with_retries_the_call_that_ran_is_retried_and_the_other_not_counted() -> None:
    h, fid, grant = _leased(retries=1)
    h.feed(b"sup", _exited(["ran-1"]))
    _again(h, fid, grant, "ran-1")
    _again(h, fid, grant, "queued-1")
    _new_worker(h)
    h.tick(5.0)  # past the retry's backoff
    h.finish(b"w1", "queued-1")  # (one device: one call at a time)
    h.tick(0.1)
    attempts = {r.invocation_id: r.meta.attempt_number for r in h.runs(b"w1")}
    assert attempts == {"ran-1": 2, "queued-1": 1}
    assert h.core.counters.retried == 1


def test_a_resubmit_before_the_journal_waits_for_it() -> None:
    """The scheduler killed the worker (a call past its timeout): the lease is lost at
    once, its calls come back before the supervisor's exit notice with the journal."""
    h, fid, grant = _leased()
    h.core.leases.lost(h.core.invocations[grant.lease_id], h.core.devices["n:0"], h.now,
                       "killed: a call ran past its timeout")
    for _ in h.core.members.lose_worker(h.core.devices["n:0"], h.now, "killed"):
        pass
    _again(h, fid, grant, "queued-1")
    _again(h, fid, grant, "queued-1")  # said again (a Hello again): one call
    assert "queued-1" not in h.results() and "queued-1" not in h.core.invocations
    assert h.core.leases.lost_calls.waiting() == 1
    h.feed(b"sup", _exited(["stuck"]))
    assert h.core.leases.lost_calls.waiting() == 0
    assert h.core.invocations["queued-1"].attempts == 0  # not counted
    _new_worker(h)
    assert [r.meta.attempt_number for r in h.runs(b"w1") if r.invocation_id == "queued-1"] == [1]


def test_a_journal_that_never_comes_counts_the_attempt() -> None:
    h, fid, grant = _leased()
    for _ in h.core.members.lose_worker(h.core.devices["n:0"], h.now, "unreachable"):
        pass
    h.core.leases.lost(h.core.invocations[grant.lease_id], h.core.devices["n:0"], h.now,
                       "unreachable")
    _again(h, fid, grant, "queued-1")
    h.tick(JOURNAL_WAIT_SECONDS - 0.5)
    assert "queued-1" not in h.results()
    h.tick(1.0)
    assert not h.results()["queued-1"].ok  # retries=0: it may have run
    assert h.core.leases.lost_calls.waiting() == 0


@pytest.mark.parametrize("case", ["not journaled", "worker alive", "unknown lease",
                                  "another pid", "id too long"])
def test_without_a_whole_journal_of_that_worker_the_attempt_counts(case: str) -> None:
    h, fid, grant = _leased()
    inv = "x" * (p.JOURNAL_ID_MAX + 1) if case == "id too long" else "queued-1"
    if case == "not journaled":
        h.feed(b"sup", _exited([], journaled=False))
    elif case in ("unknown lease", "id too long"):
        h.feed(b"sup", _exited([]))
    elif case == "another pid":
        # another process's notice (stale: the device's worker lives), its journal empty
        h.feed(b"sup", p.WorkerExited("n:0", 40, -9, "killed", 0, [], True))
    if case == "unknown lease":
        grant = p.LeaseGrant("lease:other", fid, "", "", 1.0, 1, 0)
    _again(h, fid, grant, inv)
    result = h.results()[inv]
    assert not result.ok and result.error_kind == "WorkerLost"


def test_a_waiting_call_its_client_cancels_is_cancelled_and_never_runs() -> None:
    h, fid, grant = _leased()
    for _ in h.core.members.lose_worker(h.core.devices["n:0"], h.now, "killed"):
        pass
    _again(h, fid, grant, "queued-1")
    h.hello(b"other", p.Role.CLIENT)
    h.feed(b"other", p.Cancel("queued-1", "not its caller", request_id=5))
    [reply] = [s.msg for s in h.sent if isinstance(s.msg, p.QueryReply) and s.peer == b"other"]
    assert reply.data == {"cancelled": False}  # only its caller's counts
    h.feed(b"cli", p.Cancel("queued-1", "interrupted by the caller", request_id=6))
    result = h.results()["queued-1"]
    assert not result.ok and result.error_kind == "Cancelled"
    [reply] = [s.msg for s in h.sent if isinstance(s.msg, p.QueryReply) and s.peer == b"cli"]
    assert reply.ok and reply.data == {"cancelled": True}
    h.feed(b"sup", _exited([]))
    _new_worker(h)
    assert not [r for r in h.runs(b"w1") if r.invocation_id == "queued-1"]


def test_only_the_devices_own_supervisor_says_what_its_worker_started() -> None:
    h, fid, grant = _leased()
    for _ in h.core.members.lose_worker(h.core.devices["n:0"], h.now, "killed"):
        pass
    _again(h, fid, grant, "queued-1")
    h.hello(b"sup2", p.Role.SUPERVISOR, info={"node": "m", "devices": []})
    h.feed(b"sup2", _exited([]))  # not its device's supervisor
    assert h.core.leases.lost_calls.waiting() == 1
    h.feed(b"sup", _exited([]))
    assert h.core.leases.lost_calls.waiting() == 0 and "queued-1" in h.core.invocations


def test_a_waiting_call_whose_client_left_is_dropped() -> None:
    h, fid, grant = _leased()
    for _ in h.core.members.lose_worker(h.core.devices["n:0"], h.now, "killed"):
        pass
    _again(h, fid, grant, "queued-1")
    h.feed(b"cli", p.Goodbye("closed"))
    h.feed(b"sup", _exited([]))
    assert "queued-1" not in h.core.invocations


def test_the_verdicts() -> None:
    lost = LostLeases()
    lost.opened("lease:a", "n:0", 7)
    sub = p.Submit("c1", "f", {}, prior_attempts=2, prior_device="n:0", prior_lease="lease:a")
    assert lost.verdict(sub, alive=True) is Verdict.MAY_HAVE_RUN
    assert lost.verdict(sub, alive=False) is Verdict.WAIT
    raised = p.Submit("c1", "f", {}, prior_attempts=1, prior_raised=True, prior_lease="lease:a")
    assert lost.verdict(raised, alive=False) is Verdict.MAY_HAVE_RUN  # it ran: it raised
    lost.journal(p.WorkerExited("n:0", 7, -9, "", 1, ["c2"], True))
    assert lost.verdict(sub, alive=False) is Verdict.NEVER_STARTED
    again = LostLeases.decided(sub, Verdict.NEVER_STARTED)
    assert (again.prior_attempts, again.prior_lease, again.prior_device) == (1, "", "n:0")
    first = LostLeases.decided(p.Submit("c1", "f", {}, prior_attempts=1, prior_device="n:0",
                                        prior_lease="lease:a"), Verdict.NEVER_STARTED)
    assert (first.prior_attempts, first.prior_device) == (0, "")
    assert LostLeases.decided(sub, Verdict.MAY_HAVE_RUN) is sub
    assert lost.verdict(p.Submit("c2", "f", {}, prior_attempts=1, prior_lease="lease:a"),
                        alive=False) is Verdict.MAY_HAVE_RUN


def _sub(inv: str = "c1", lease: str = "lease:a", attempts: int = 1) -> p.Submit:
    return p.Submit(inv, "f", {}, prior_attempts=attempts, prior_device="n:0", prior_lease=lease)


def test_a_call_waits_for_the_journal_exactly_its_wait_and_is_given_once() -> None:
    lost = LostLeases()
    lost.opened("lease:a", "n:0", 7)
    lost.park(b"cli", _sub(), 100.0)
    assert lost.expired(100.0 + JOURNAL_WAIT_SECONDS - 0.01) == [] and lost.waiting() == 1
    [given] = lost.expired(100.0 + JOURNAL_WAIT_SECONDS)
    assert given.msg.invocation_id == "c1" and lost.waiting() == 0
    assert lost.expired(200.0) == []


def test_the_oldest_leases_and_journals_are_forgotten_first() -> None:
    from gpufn.scheduler.desks.lost_leases import REMEMBERED

    lost = LostLeases()
    for i in range(REMEMBERED):
        lost.opened(f"lease:{i}", "n:0", i)
        lost.journal(p.WorkerExited("n:0", i, -9, "", 1, [], True))
    assert lost.worker("lease:0") == ("n:0", 0)  # all remembered
    assert lost.verdict(_sub(lease="lease:0"), alive=False) is Verdict.NEVER_STARTED
    lost.opened("lease:new", "n:1", 5000)
    lost.journal(p.WorkerExited("n:1", 5000, -9, "", 1, [], True))
    assert lost.worker("lease:0") is None and lost.worker("lease:new") == ("n:1", 5000)
    assert lost.worker("lease:1") == ("n:0", 1)
    assert lost.verdict(_sub(lease="lease:1"), alive=False) is Verdict.NEVER_STARTED
    lost.opened("lease:again", "n:0", 0)  # the first worker's journal went
    assert lost.verdict(_sub(lease="lease:again"), alive=False) is Verdict.WAIT


def test_an_id_of_the_longest_journaled_length_is_judged_by_the_journal() -> None:
    lost = LostLeases()
    lost.opened("lease:a", "n:0", 7)
    lost.journal(p.WorkerExited("n:0", 7, -9, "", 1, [], True))
    longest = "i" * p.JOURNAL_ID_MAX
    assert lost.verdict(_sub(longest), alive=False) is Verdict.NEVER_STARTED
    assert lost.verdict(_sub(longest + "i"), alive=False) is Verdict.MAY_HAVE_RUN


def test_a_submit_that_names_a_lease_but_used_no_attempt_has_nothing_to_forgive() -> None:
    lost = LostLeases()
    lost.opened("lease:a", "n:0", 7)
    lost.journal(p.WorkerExited("n:0", 7, -9, "", 1, [], True))
    assert lost.verdict(_sub(attempts=0), alive=False) is Verdict.MAY_HAVE_RUN


def test_unpark_drops_only_that_call_of_that_client() -> None:
    lost = LostLeases()
    lost.opened("lease:a", "n:0", 7)
    lost.park(b"cli", _sub("c1"), 0.0)
    lost.park(b"cli", _sub("c2"), 0.0)
    assert not lost.unpark(b"other", "c1")  # another client's cancel
    assert not lost.unpark(b"cli", "c3")
    assert lost.unpark(b"cli", "c1") and lost.waiting() == 1
    assert not lost.unpark(b"cli", "c1")
    [left] = lost.journal(p.WorkerExited("n:0", 7, -9, "", 1, [], True))
    assert left.msg.invocation_id == "c2"
    lost.park(b"cli", _sub("c4"), 0.0)
    assert lost.unpark(b"cli", "c4") and lost.waiting() == 0 and lost.expired(99.0) == []
