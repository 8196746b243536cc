"""Calls left unanswered when their lease ended (`Client._lease_ended`, `_settle`): a probe
behind them tells a live worker, which answers them first, from a dead one, whose calls
are lost. The client's I/O-thread side, over a real loopback socket; no scheduler."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import zmq

from gpufn.client import direct as direct_mod
from gpufn.client.client import Client, _Pending
from gpufn.client.leases import Leases, Reach
from gpufn.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def io(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Client, direct_mod.DirectSockets,
                                                         zmq.Socket[Any], str]]:
    """A client's I/O-thread state, its direct sockets, and a ROUTER playing the worker."""
    monkeypatch.setattr(direct_mod, "SETTLE_SECONDS", 0.3)
    ctx: zmq.Context[Any] = zmq.Context()
    worker = ctx.socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{worker.bind_to_random_port('tcp://127.0.0.1')}"
    c = object.__new__(Client)
    c._lock, c._outbox, c._calls = threading.Lock(), deque(), {}
    c._held_back, c._to_settle, c._settles, c._checks = {}, {}, {}, {}
    c._streams, c._shm_files = {}, {}
    c._resubmit, c._rehello_at, c._conn = False, 0.0, None  # (no connection: no Hello sent)
    c._direct_box, c._parked = deque(), {}
    c.leases = Leases()
    c.leases.on = True
    direct = direct_mod.DirectSockets(ctx, c.leases)
    yield c, direct, worker, endpoint
    direct.close()
    ctx.destroy(linger=0)


def _in_flight(c: Client, endpoint: str, retries: int, n: int = 2) -> tuple[p.LeaseGrant,
                                                                            list[str]]:
    """`n` calls sent under a lease of `endpoint`, unanswered."""
    grant = p.LeaseGrant("lease:w", "fn-1", endpoint, "s", 30.0, 10, retries, [], "cpu:0")
    assert c.leases.granted(grant, time.monotonic())
    c.leases.reach[endpoint] = Reach.OK
    ids = []
    for i in range(n):
        sub = c.leases.mark(p.Submit(f"call-{i}", "fn-1", {}, frames=(b"args",)))
        assert c.leases.take(sub, time.monotonic()) is not None
        c._calls[sub.invocation_id] = _Pending(Future(), "f", "fn-1", submit=sub)
        ids.append(sub.invocation_id)
    return grant, ids


def _probe(worker: zmq.Socket[Any]) -> tuple[bytes, p.Ping]:
    assert worker.poll(5000)
    peer, *frames = worker.recv_multipart()
    [ping] = p.decode_all(frames)
    assert isinstance(ping, p.Ping)
    return peer, ping


def _until(c: Client, direct: direct_mod.DirectSockets, done: Any) -> None:
    deadline = time.monotonic() + 5
    while not done() and time.monotonic() < deadline:
        for ep in list(direct.socks):
            for msg in direct.received(ep):
                c._dispatch_direct(msg)
        c._settle(direct)
        time.sleep(0.02)


@pytest.mark.parametrize("retries", [0, 1])
def test_calls_unanswered_by_a_worker_that_died_after_its_lease_ended_are_lost(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str],
        retries: int) -> None:
    """Their lease ended OK, then nothing: the probe goes unanswered, so each call is sent
    through the scheduler with that attempt and the lease (the scheduler reads the dead
    worker's journal: runs it again if it never started or retries, else fails it)."""
    c, direct, worker, endpoint = io
    _, ids = _in_flight(c, endpoint, retries)
    futures = [c._calls[i].future for i in ids]
    c._lease_ended(p.Result("lease:w", True, "", "expired"))
    assert sorted(c._to_settle) == ids and not c._outbox
    c._settle(direct)
    _probe(worker)  # and no answer
    _until(c, direct, lambda: not c._settles)
    again = [p.decode(frames) for frames in c._outbox]
    assert [(s.invocation_id, s.prior_attempts, s.prior_raised, s.prior_device, s.prior_lease)
            for s in again] == [(i, 1, False, "cpu:0", "lease:w") for i in ids]
    assert not any(f.done() for f in futures)
    assert not c._to_settle


def test_a_live_worker_answers_first_and_nothing_is_lost(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """One call answered, one refused (it goes through the scheduler as it was), then the
    probe's answer: no call is taken for lost."""
    c, direct, worker, endpoint = io
    _, (answered, refused) = _in_flight(c, endpoint, 0)
    futures = {i: c._calls[i].future for i in (answered, refused)}
    c._lease_ended(p.Result("lease:w", True, "", "expired"))
    c._settle(direct)
    peer, ping = _probe(worker)
    worker.send_multipart([peer, *p.encode_batch([
        p.Result(answered, True, "", ""), p.LeaseRefused("lease:w", [refused], "ended"),
        p.Pong(ping.seq)])])
    _until(c, direct, lambda: not c._settles)
    assert futures[answered].done() and futures[answered].result().ok
    assert not futures[refused].done()
    [again] = [p.decode(frames) for frames in c._outbox]
    assert isinstance(again, p.Submit) and again.invocation_id == refused
    assert again.prior_attempts == 0
    assert not c._to_settle


def test_a_refusal_after_the_call_was_sent_to_the_scheduler_sends_nothing_again(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """Its lease was lost with its worker, so the call went to the scheduler; a refusal
    of it that comes later (a new worker on the old endpoint, reached by a reconnecting
    socket's queued DirectRun) must not send it a second time: it would run twice."""
    c, _, _, endpoint = io
    _, ids = _in_flight(c, endpoint, 0)
    c._lease_ended(p.Result("lease:w", False, "WorkerLost", "lost during a lease"))
    assert sorted(s.invocation_id for s in _sent(c) if isinstance(s, p.Submit)) == ids
    c._outbox.clear()
    c._dispatch_direct(p.LeaseRefused("lease:w", ids, "no such lease"))
    assert not c._outbox
    assert all(not c._calls[i].future.done() for i in ids)  # the scheduler answers them


def test_a_lease_whose_worker_is_silent_after_the_scheduler_forgot_us_is_over(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """The scheduler restarted (it forgot us) and the leased worker died meanwhile: no
    one would ever say so (the next scheduler never knew the lease), so the calls sent
    there waited forever and the lease took more. A probe of each held lease's worker
    goes unanswered: the lease is over here and its calls go to the scheduler as lost."""
    c, direct, worker, endpoint = io
    _, ids = _in_flight(c, endpoint, 0)
    futures = [c._calls[i].future for i in ids]
    c._dispatch(p.Error(_forgotten(), "this connection has not said Hello"))
    assert c._checks == {endpoint: (0, 0.0)} and c.leases.suspect == {endpoint}
    c._settle(direct)
    _probe(worker)  # and no answer
    _until(c, direct, lambda: not c._checks)
    assert not c.leases.holds("lease:w") and not c.leases.suspect
    assert not any(f.done() for f in futures)
    assert sorted((s.invocation_id, s.prior_lease) for s in _sent(c)
                  if isinstance(s, p.Submit)) == [(i, "lease:w") for i in ids]


def test_a_lease_whose_worker_answers_after_the_scheduler_forgot_us_goes_on(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    c, direct, worker, endpoint = io
    _, ids = _in_flight(c, endpoint, 0)
    c._dispatch(p.Error(_forgotten(), "this connection has not said Hello"))
    c._settle(direct)
    peer, ping = _probe(worker)
    worker.send_multipart([peer, *p.encode(p.Pong(ping.seq))])
    _until(c, direct, lambda: not c._checks)
    time.sleep(0.4)  # past SETTLE_SECONDS: nothing more happens
    c._settle(direct)
    assert c.leases.holds("lease:w") and not c.leases.suspect
    assert all(not c._calls[i].future.done() for i in ids)  # their answers will come


def _forgotten() -> str:
    from gpufn.net.connection import _FORGOTTEN

    return _FORGOTTEN


def _sent(c: Client) -> list[p.Message]:
    return [p.decode(frames) for frames in c._outbox]


def test_a_leased_answer_that_raised_an_exception_it_retries_on_goes_to_the_scheduler(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """Marked retryable by its worker: not its caller's answer yet; sent again through
    the scheduler with the attempt it used (raised, on the lease's device). Any other
    failure is the caller's answer."""
    c, _, _, endpoint = io
    _, (retried, failed) = _in_flight(c, endpoint, 2)
    futures = {i: c._calls[i].future for i in (retried, failed)}
    held = c.leases._by_id["lease:w"]
    c._dispatch_direct(p.Result(retried, False, "", "boom", p.ResultMeta(retryable=True)))
    c._dispatch_direct(p.Result(failed, False, "", "boom"))
    # (what a lost lease's report says: the retried attempt is not metered as a call)
    assert held.done == [{"id": retried, "ok": False, "retry": True},
                         {"id": failed, "ok": False}]
    [again] = _sent(c)
    assert isinstance(again, p.Submit) and again.invocation_id == retried
    assert (again.prior_attempts, again.prior_raised, again.prior_device) == (1, True, "cpu:0")
    assert not futures[retried].done()
    assert futures[failed].done() and not futures[failed].result().ok


def test_a_lease_lost_with_its_worker_sends_its_calls_again_and_reports_what_ran(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """The scheduler says the lease was lost: the calls in flight there go to it again,
    the attempt counted (not raised) and the lease named, whatever their retries (it
    judges from the dead worker's journal); the calls answered under the lease are
    reported for metering."""
    for retries in (1, 0):
        c, _, _, endpoint = io
        c._outbox.clear()
        c._calls.clear()
        c.leases = Leases()
        c.leases.on = True
        _, (answered, *lost) = _in_flight(c, endpoint, retries)
        c._dispatch_direct(p.Result(answered, True, "", ""))
        futures = [c._calls[i].future for i in lost]
        c._calls["a-gone"] = _Pending(Future(), "f", "fn-1")  # no Submit kept (an Attach):
        c.leases._by_id["lease:w"].calls.add("a-gone")  # never sent again
        c._lease_ended(p.Result("lease:w", False, "WorkerLost", "lost during a lease"))
        sent = _sent(c)
        [report] = [m for m in sent if isinstance(m, p.LeaseReport)]
        assert [i["id"] for i in report.items] == [answered]
        again = [m for m in sent if isinstance(m, p.Submit)]
        assert sorted(s.invocation_id for s in again) == sorted(lost)
        assert all(s.prior_attempts == 1 and not s.prior_raised and s.prior_lease == "lease:w"
                   for s in again)
        assert not any(f.done() for f in futures)


def test_probes_go_to_every_endpoint_in_doubt_at_once(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    c, direct, worker, endpoint = io
    other = worker.context.socket(zmq.ROUTER)
    try:
        ep2 = f"tcp://127.0.0.1:{other.bind_to_random_port('tcp://127.0.0.1')}"
        c._checks = {endpoint: (0, 0.0), ep2: (0, 0.0)}
        c._settle(direct)
        _probe(worker)  # (this one stays silent)
        peer, ping = _probe(other)
        assert all(seq for seq, _ in c._checks.values())
        other.send_multipart([peer, *p.encode(p.Pong(ping.seq))])
        _until(c, direct, lambda: ep2 not in c._checks)  # not behind the silent one
        assert set(c._checks) == {endpoint} and c.leases.suspect == set()
    finally:
        other.close(0)


def test_answered_probes_of_several_endpoints_clear_in_one_round(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    c, direct, worker, endpoint = io
    other = worker.context.socket(zmq.ROUTER)
    try:
        ep2 = f"tcp://127.0.0.1:{other.bind_to_random_port('tcp://127.0.0.1')}"
        c.leases.suspect = {endpoint, ep2}
        c._checks = {endpoint: (0, 0.0), ep2: (0, 0.0)}
        c._settle(direct)
        for sock in (worker, other):
            peer, ping = _probe(sock)
            sock.send_multipart([peer, *p.encode(p.Pong(ping.seq))])
        for ep in (endpoint, ep2):
            s = direct.sock(ep)
            assert s.poll(5000)
            assert not list(direct.received(ep))  # (the Pong, taken)
        c._settle(direct)
        assert not c._checks and not c.leases.suspect
    finally:
        other.close(0)


def test_a_probe_waits_behind_calls_still_to_go_to_its_worker(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """A call queued for the worker (not sent yet) when its lease ended: the probe must
    not overtake it, else its answer (a refusal) would come after the probe's and the
    call be taken for lost."""
    c, direct, _, endpoint = io
    _, ids = _in_flight(c, endpoint, 0, n=1)
    c._direct_box.append((endpoint, p.encode(p.DirectRun("lease:w", "s", ids[0], (b"a",)))))
    c._lease_ended(p.Result("lease:w", True, "", "expired"))
    c._settle(direct)
    assert c._settles == {endpoint: (0, 0.0)}  # not sent: a call waits to go there
    c._direct_box.clear()
    c._settle(direct)
    assert c._settles[endpoint][0] > 0


def test_the_answer_to_the_reachability_probe_does_not_settle_a_later_probe(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """The worker answered the probe that found it reachable (seq 1) long before; a
    settle probe has a seq of its own, so that old answer does not count for it (else a
    lease ending with a call in flight lost the call at once)."""
    c, direct, worker, endpoint = io
    _, ids = _in_flight(c, endpoint, 0, n=1)
    direct.sock(endpoint).send_multipart(p.encode(p.Ping(direct_mod.PROBE_SEQ)))
    peer, ping = _probe(worker)
    worker.send_multipart([peer, *p.encode(p.Pong(ping.seq))])
    assert direct.sock(endpoint).poll(5000)
    assert not list(direct.received(endpoint))  # (the Pong, taken)
    c._lease_ended(p.Result("lease:w", True, "", "expired"))
    c._settle(direct)
    _probe(worker)  # the settle probe, not answered yet
    c._settle(direct)
    assert ids[0] in c._to_settle and not c._calls[ids[0]].future.done()


def test_a_leased_call_the_scheduler_fails_for_its_timeout_is_answered_once_not_lost(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """Its worker could not stop it at its timeout (worker/lease_clock.py): the
    scheduler's Timeout for it comes first, then the lease lost with the killed worker.
    The call fails Timeout and is neither retried nor failed again; the other call in
    flight is retried; what the client reports for metering names the timed-out call."""
    c, _, _, endpoint = io
    _, (timed, other) = _in_flight(c, endpoint, retries=1)
    future = c._calls[timed].future
    c._dispatch(p.Result(timed, False, "Timeout", "f call ran longer than its timeout"))
    assert future.result(0).error_kind == "Timeout"
    assert not c.leases.in_flight(timed) and c.leases.in_flight(other)
    c._lease_ended(p.Result("lease:w", False, "WorkerLost", "lost during a lease"))
    sent = _sent(c)
    [report] = [m for m in sent if isinstance(m, p.LeaseReport)]
    assert [(i["id"], i["ok"]) for i in report.items] == [(timed, False)]
    assert [m.invocation_id for m in sent if isinstance(m, p.Submit)] == [other]


def test_a_probe_that_cannot_be_sent_is_taken_for_silence(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A send that fails (its pipe full: a worker that stopped reading) raises nothing
    to the I/O thread; the probe stays unanswered, and after SETTLE_SECONDS the calls
    left to settle are lost, as with a dead worker."""
    c, direct, _, endpoint = io
    _, ids = _in_flight(c, endpoint, 0, n=1)
    future = c._calls[ids[0]].future
    c._lease_ended(p.Result("lease:w", True, "", "expired"))
    direct.sock(endpoint)

    def full(*_: Any, **__: Any) -> None:
        raise zmq.Again()

    monkeypatch.setattr(direct_mod.sockets, "send", full)
    c._settle(direct)  # the probe "goes", raising nothing
    assert endpoint in c._settles and c._settles[endpoint][0] > direct_mod.PROBE_SEQ
    _until(c, direct, lambda: not c._settles)
    assert not future.done()
    [again] = [m for m in _sent(c) if isinstance(m, p.Submit)]
    assert again.invocation_id == ids[0] and again.prior_lease == "lease:w"


def test_a_call_unanswered_when_its_lease_ended_is_not_sent_again_on_a_hello_again(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """Its lease ended (its worker said so through the scheduler) while it ran; then the
    scheduler forgot us (a restart, or a cut longer than the client timeout) and we say
    Hello again: what is outstanding goes again, but not this call, whose worker answers
    it (or a probe says it was lost). Sent again, it ran twice as its first attempt (a
    client cut off past the client timeout in the middle of a leased `.map`)."""
    c, _, _, endpoint = io
    _, (running, answered) = _in_flight(c, endpoint, 0)
    c._dispatch_direct(p.Result(answered, True, "", ""))
    waiting = p.Submit("call-head", "fn-1", {}, frames=(b"args",))  # one at the scheduler
    c._calls[waiting.invocation_id] = _Pending(Future(), "f", "fn-1", submit=waiting)
    c._lease_ended(p.Result("lease:w", True, "", "expired"))
    assert running in c._to_settle and not c.leases.in_flight(running)
    c._front, c._register_frames, c._status_frames = deque(), {}, {}
    c._held_ids, c._resubmit = set(), True
    c._wake = lambda: None  # type: ignore[method-assign]
    c._send_again()
    again = [p.decode(frames) for frames in c._front]
    assert [m.invocation_id for m in again if isinstance(m, p.Submit)] == ["call-head"]
    assert not c._resubmit  # once: a later Welcome sends nothing again


def test_a_hello_again_fails_a_generator_call_that_streamed_values_and_sends_the_rest(
        io: tuple[Client, direct_mod.DirectSockets, zmq.Socket[Any], str]) -> None:
    """Forgotten by the scheduler (a restart) while calls were out: a generator call that
    has streamed values cannot resume there (run again from its start, it would repeat
    them), so it fails WorkerLost, saying to call it again; a generator call that streamed
    nothing yet, and a plain call, are sent again, each once."""
    from gpufn.client.items import ItemQueue
    from gpufn.exceptions import WorkerLost

    c = io[0]
    subs = {name: p.Submit(f"call-{name}", "fn-1", {}, frames=(b"args",))
            for name in ("streamed", "not-yet", "plain")}
    for name, sub in subs.items():
        c._calls[sub.invocation_id] = _Pending(Future(), name, "fn-1", submit=sub)
    for name in ("streamed", "not-yet"):
        c._streams[subs[name].invocation_id] = ItemQueue()
    c._streams["call-streamed"].put(p.Item("call-streamed", 1, 0, [], (b"v",)))
    streamed = c._calls["call-streamed"].future
    c._front, c._register_frames, c._status_frames = deque(), {}, {}
    c._held_ids, c._resubmit = set(), True
    c._wake = lambda: None  # type: ignore[method-assign]
    c._send_again()
    again = [p.decode(frames) for frames in c._front]
    assert sorted(m.invocation_id for m in again if isinstance(m, p.Submit)) == [
        "call-not-yet", "call-plain"]
    with pytest.raises(WorkerLost, match=r"streamed values.*Call it again"):
        streamed.result(timeout=0)
    assert "call-streamed" not in c._calls and "call-streamed" not in c._streams
    assert "call-not-yet" in c._streams and "call-plain" in c._calls
