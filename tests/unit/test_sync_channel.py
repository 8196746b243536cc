"""A blocking call's channel reads the scheduler's batches one message at a time and keeps
what its reader did not get to (`gpufn/client/sync_channel.py`), over a real socket pair
in one process: no scheduler, no handshake."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gpufn.client.leases import Leases, Reach
from gpufn.client.sync_channel import SyncChannel
from gpufn.net import sockets
from gpufn.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


class Owner:
    def __init__(self) -> None:
        self.printed: list[p.Output] = []

    def _print_output(self, msg: p.Output, name: str | None = None) -> None:
        self.printed.append(msg)


@pytest.fixture
def wired() -> Iterator[tuple[SyncChannel, zmq.Socket[Any]]]:
    """A channel whose socket is one end of a pair; the other end plays the scheduler."""
    ctx: zmq.Context[Any] = zmq.Context()
    head, mine = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    head.bind("inproc://sync-channel")
    mine.connect("inproc://sync-channel")
    ch = object.__new__(SyncChannel)
    ch.sock, ch._pending, ch.client = mine, deque(), Owner()  # type: ignore[assignment]
    ch.leases = Leases()
    ch.leases.on = True
    yield ch, head
    ctx.destroy(linger=0)


def lease(ch: SyncChannel, lease_id: str) -> None:
    grant = p.LeaseGrant(lease_id, "fn-1", f"tcp://127.0.0.1:1/{lease_id}", "s", 30.0, 10)
    assert ch.leases.granted(grant, time.monotonic())
    ch.leases.reach[grant.endpoint] = Reach.OK


def arrive(ch: SyncChannel, head: zmq.Socket[Any], msgs: list[p.Message]) -> None:
    sockets.send(head, p.encode_batch(msgs))
    assert ch.sock.poll(5000)


SUBMIT = p.Submit("call-2", "fn-1", {})


def test_the_rest_of_a_batch_waits_for_the_next_call_when_its_reader_returns(
        wired: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    """The call's Result and, behind it in one batch, the end of a lease: the reader
    returns on the Result; the lease's end is handled before the next call takes a lease
    (it was dropped, and the next call went to that lease's worker)."""
    ch, head = wired
    lease(ch, "lease:a")
    assert ch.leases.holds("lease:a")
    arrive(ch, head, [p.Result("call-1", True, "", ""), p.Result("lease:a", True, "", "ended"),
                      p.Output("call-1", "stdout", "late\n")])
    got = None
    for msg in ch._messages():
        if isinstance(msg, p.Result) and msg.invocation_id == "call-1":
            got = msg
            break
    assert got is not None and len(ch._pending) == 2
    assert ch.leases.holds("lease:a")  # not read yet
    ch._catch_up(None, SUBMIT, "f")
    assert not ch.leases.holds("lease:a") and not ch._pending
    assert [o.text for o in ch.client.printed] == ["late\n"]  # type: ignore[attr-defined]


def test_the_rest_of_a_batch_survives_a_reader_that_raises(
        wired: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    """One lease lost fails the call (its reader raises WorkerLost); another lost with the
    same worker, in the same batch, is still let go."""
    ch, head = wired
    lease(ch, "lease:a")
    lease(ch, "lease:b")
    arrive(ch, head, [p.Result("lease:a", False, "WorkerLost", "lost"),
                      p.Result("lease:b", False, "WorkerLost", "lost")])
    with pytest.raises(RuntimeError):
        for msg in ch._messages():
            if isinstance(msg, p.Result) and msg.invocation_id == "lease:a":
                ch.leases.ended("lease:a")
                raise RuntimeError("the call failed")
    assert [m.invocation_id for m in ch._pending] == ["lease:b"]  # type: ignore[attr-defined]
    ch._catch_up(None, SUBMIT, "f")
    assert not ch.leases.holds("lease:b") and not ch._pending


def test_messages_read_earlier_come_before_new_ones_and_each_once(
        wired: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    ch, head = wired
    arrive(ch, head, [p.Output("x", "stdout", "1"), p.Output("x", "stdout", "2")])
    for _ in ch._messages():
        break  # one taken, one left
    arrive(ch, head, [p.Output("x", "stdout", "3")])
    assert [m.text for m in ch._messages()] == ["2", "3"]  # type: ignore[attr-defined]
    assert not ch._pending


class Conn:
    """The channel's connection, as far as a rehello goes: its handshake is counted."""

    def __init__(self) -> None:
        from gpufn.net.connection import Connection

        self.needs_rehello = Connection.needs_rehello
        self.info = p.HelloInfo()
        self.handshakes = 0

    def handshake(self, timeout: float) -> None:
        self.handshakes += 1


def test_a_refusal_left_from_an_earlier_call_says_hello_again_but_sends_no_call(
        wired: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    """A "say Hello again" left unread by the last call is handled before the next call
    is sent: the channel announces itself, and sends nothing of the call yet (the call
    goes out once, after)."""
    from gpufn.net.connection import _FORGOTTEN

    ch, head = wired
    conn = Conn()
    ch.conn, ch.registered = conn, set()  # type: ignore[assignment]
    ch.client.info = p.HelloInfo()
    ch._pending.append(p.Error(_FORGOTTEN, "this connection has not said Hello"))
    register = p.Register("fn-1", "code-1", "f", {}, [])
    ch._catch_up(register, SUBMIT, "f")
    assert conn.handshakes == 1 and not ch._pending
    assert not head.poll(200)  # no Register, no Submit: the call itself is not sent yet


# ---------------------------------------------------------------- a lease's end, then silence

@pytest.fixture
def worker_end(wired: tuple[SyncChannel, zmq.Socket[Any]], monkeypatch: pytest.MonkeyPatch,
               ) -> Iterator[tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]]:
    """The channel, its scheduler end, and a ROUTER on loopback playing a leased worker."""
    from gpufn.client import direct as direct_mod

    monkeypatch.setattr(direct_mod, "SETTLE_SECONDS", 0.5)
    ch, head = wired
    ctx = zmq.Context.instance()
    worker = ctx.socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{worker.bind_to_random_port('tcp://127.0.0.1')}"
    ch.direct = direct_mod.DirectSockets(ctx, ch.leases)
    ch._pollers = {}
    ch.client.ping_seconds = 0.1  # type: ignore[attr-defined]
    yield ch, head, worker, endpoint
    ch.direct.close()
    worker.close(0)


def _leased_call(ch: SyncChannel, endpoint: str, retries: int, granted: bool = False,
                 ) -> tuple[list[p.Result | p.Submit | BaseException], Any]:
    """The call under a lease of `endpoint` (granted here unless `granted`), in a thread:
    (what it gave, the thread)."""
    import threading

    if not granted:
        grant = p.LeaseGrant("lease:w", "fn-1", endpoint, "s", 30.0, 10, retries, [], "cpu:0")
        assert ch.leases.granted(grant, time.monotonic())
        ch.leases.reach[endpoint] = Reach.OK
    submit = ch.leases.mark(SUBMIT)
    held = ch.leases.take(submit, time.monotonic())
    assert held is not None
    out: list[p.Result | p.Submit | BaseException] = []

    def run() -> None:
        try:
            out.append(ch._direct(held, None, submit, "f"))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)  # (a hung one must not keep pytest alive)
    t.start()
    return out, t


def _worker_reads(worker: zmq.Socket[Any]) -> tuple[bytes, list[p.Message]]:
    assert worker.poll(5000)
    peer, *frames = worker.recv_multipart()
    return peer, p.decode_all(frames)


def _end_the_lease(head: zmq.Socket[Any]) -> None:
    sockets.send(head, p.encode(p.Result("lease:w", True, "", "expired")))


@pytest.mark.parametrize("retries", [0, 1])
def test_a_worker_that_dies_after_its_lease_ended_fails_or_retries_the_call(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str],
        retries: int) -> None:
    """The lease ended (its worker said so through the scheduler) with the call sent and
    unanswered; the worker then died, so nobody would ever say more (the call waited
    forever). A probe behind the call goes unanswered: the call is lost with the worker
    and sent through the scheduler, with its attempt and lease (the scheduler reads the
    dead worker's journal: it runs again if it never started, or retries, else fails)."""
    ch, head, worker, endpoint = worker_end
    out, t = _leased_call(ch, endpoint, retries)
    _, got = _worker_reads(worker)
    assert isinstance(got[0], p.DirectRun) and got[0].invocation_id == SUBMIT.invocation_id
    _end_the_lease(head)
    _, probe = _worker_reads(worker)  # the settle probe, unanswered: the worker is "dead"
    assert isinstance(probe[0], p.Ping)
    t.join(10)
    assert not t.is_alive()
    [again] = out
    assert isinstance(again, p.Submit) and again.prior_attempts == 1
    assert not again.prior_raised and again.prior_device == "cpu:0"
    assert again.prior_lease == "lease:w"


def test_a_live_worker_answers_the_call_before_the_probe_after_its_lease_ended(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    """Its answer, or its refusal (the call goes through the scheduler, no attempt used),
    comes before the probe's: neither is taken for a loss."""
    ch, head, worker, endpoint = worker_end
    for answer in ("result", "refused"):
        out, t = _leased_call(ch, endpoint, 0)
        peer, _ = _worker_reads(worker)
        _end_the_lease(head)
        _, probe = _worker_reads(worker)
        ping = probe[0]
        assert isinstance(ping, p.Ping)
        time.sleep(0.2)  # a while: the channel waits (SETTLE_SECONDS is 0.5 here)
        first: p.Message = (p.Result(SUBMIT.invocation_id, True, "", "") if answer == "result"
                            else p.LeaseRefused("lease:w", [SUBMIT.invocation_id], "ended"))
        worker.send_multipart([peer, *p.encode_batch([first, p.Pong(ping.seq)])])
        t.join(10)
        [got] = out
        if answer == "result":
            assert isinstance(got, p.Result) and got.ok
        else:
            assert isinstance(got, p.Submit) and got.prior_attempts == 0


def test_a_leased_worker_silent_after_the_scheduler_forgot_us_loses_the_call(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    """The scheduler restarted (it forgot us: the channel said Hello again) and the
    leased worker died meanwhile: the next scheduler never knew the lease, so nobody
    would say so, and the call waited forever. A probe of the worker goes unanswered:
    the lease is over and the call lost (here: retried, its attempt counted)."""
    ch, _, worker, endpoint = worker_end
    out, t = _leased_call(ch, endpoint, 1)
    _worker_reads(worker)
    ch.leases.suspect_all()  # as `_hello` does
    _, probe = _worker_reads(worker)
    assert isinstance(probe[0], p.Ping)
    t.join(10)
    [again] = out
    assert isinstance(again, p.Submit) and again.prior_attempts == 1
    assert not ch.leases.holds("lease:w") and not ch.leases.suspect


def test_a_leased_worker_that_answers_after_the_scheduler_forgot_us_answers_the_call(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    """Alive: the probe's answer clears the doubt, and the call waits for its own answer
    however long it runs (past SETTLE_SECONDS here)."""
    ch, _, worker, endpoint = worker_end
    out, t = _leased_call(ch, endpoint, 0)
    peer, _ = _worker_reads(worker)
    ch.leases.suspect_all()
    _, probe = _worker_reads(worker)
    ping = probe[0]
    assert isinstance(ping, p.Ping)
    worker.send_multipart([peer, *p.encode(p.Pong(ping.seq))])
    time.sleep(0.8)
    assert not out and ch.leases.holds("lease:w")
    worker.send_multipart([peer, *p.encode(p.Result(SUBMIT.invocation_id, True, "", ""))])
    t.join(10)
    [got] = out
    assert isinstance(got, p.Result) and got.ok and not ch.leases.suspect


def _head_got(head: zmq.Socket[Any], wait: float = 0.2) -> list[p.Message]:
    got: list[p.Message] = []
    while head.poll(int(wait * 1000)):
        got += p.decode_all(head.recv_multipart())
    return got


def test_a_leased_call_waiting_pings_the_scheduler_once_a_ping_interval(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    """While its answer is out, the channel pings the scheduler (which keeps it, and
    says if the lease is lost) every ping interval (0.1 s here), not in a busy loop."""
    ch, head, worker, endpoint = worker_end
    out, t = _leased_call(ch, endpoint, 0)
    peer, _ = _worker_reads(worker)
    time.sleep(0.55)
    worker.send_multipart([peer, *p.encode(p.Result(SUBMIT.invocation_id, True, "", ""))])
    t.join(10)
    assert isinstance(out[0], p.Result)
    pings = [m for m in _head_got(head) if isinstance(m, p.Ping)]
    assert 3 <= len(pings) <= 7, len(pings)


def test_a_lease_lost_while_its_call_waits_tells_the_scheduler_what_ran_there(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    """Lost with its worker (the scheduler's word): the call goes to the scheduler with
    its lease (which judges from the worker's journal), and the scheduler hears which
    calls of the lease were answered (it meters them: the worker's own last reports died
    with it)."""
    from gpufn.client import direct as direct_mod

    ch, head, worker, endpoint = worker_end
    grant = p.LeaseGrant("lease:w", "fn-1", endpoint, "s", 30.0, 10, 0, [], "cpu:0")
    assert ch.leases.granted(grant, time.monotonic())
    ch.leases.reach[endpoint] = Reach.OK
    first = ch.leases.mark(p.Submit("call-1", "fn-1", {}))
    assert ch.leases.take(first, time.monotonic()) is not None
    ch.leases.answered("call-1", True)  # one answered under it already
    direct_mod.SETTLE_SECONDS = 5.0  # (monkeypatched by the fixture: restored after)
    out, t = _leased_call(ch, endpoint, 0, granted=True)
    _worker_reads(worker)
    sockets.send(head, p.encode(p.Result("lease:w", False, "WorkerLost", "lost during a lease")))
    lost = time.monotonic()
    t.join(10)
    assert time.monotonic() - lost < 2.5  # at once, not after a probe of the dead worker
    assert isinstance(out[0], p.Submit) and out[0].prior_lease == "lease:w"
    assert out[0].prior_attempts == 1
    [report] = [m for m in _head_got(head) if isinstance(m, p.LeaseReport)]
    assert report.lease_id == "lease:w" and [i["id"] for i in report.items] == ["call-1"]


def test_said_hello_again_while_a_leased_call_waits_the_call_is_not_sent_to_the_scheduler(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    """The scheduler forgot the channel (it asks for Hello again) while a leased call's
    answer is out: the channel says Hello, but does not submit the call there too (its
    worker answers it; sent again, it would run twice)."""
    from gpufn.net.connection import _FORGOTTEN

    ch, head, worker, endpoint = worker_end
    conn = Conn()
    ch.conn, ch.registered = conn, set()  # type: ignore[assignment]
    ch.client.info = p.HelloInfo()  # type: ignore[attr-defined]
    out, t = _leased_call(ch, endpoint, 0)
    peer, _ = _worker_reads(worker)
    sockets.send(head, p.encode(p.Error(_FORGOTTEN, "this connection has not said Hello")))
    time.sleep(0.3)
    _, probe = _worker_reads(worker)  # the worker is in doubt now: probed
    worker.send_multipart([peer, *p.encode_batch([p.Pong(probe[0].seq),  # type: ignore[attr-defined]
                                                  p.Result(SUBMIT.invocation_id, True, "", "")])])
    t.join(10)
    assert isinstance(out[0], p.Result) and out[0].ok and conn.handshakes == 1
    assert not [m for m in _head_got(head) if isinstance(m, (p.Submit, p.Register))]


def test_a_leased_answer_that_raised_an_exception_it_retries_on_goes_to_the_scheduler(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    """Marked retryable by its worker (and the function has retries): the call is sent
    through the scheduler with that attempt counted, as raised; the lease notes it as a
    failed attempt that is retried (not metered as a call)."""
    ch, _, worker, endpoint = worker_end
    out, t = _leased_call(ch, endpoint, 2)
    held = ch.leases._by_id["lease:w"]
    peer, _ = _worker_reads(worker)
    worker.send_multipart([peer, *p.encode(p.Result(SUBMIT.invocation_id, False, "", "boom",
                                                    p.ResultMeta(retryable=True)))])
    t.join(10)
    [again] = out
    assert isinstance(again, p.Submit)
    assert (again.prior_attempts, again.prior_raised, again.prior_device) == (1, True, "cpu:0")
    assert held.done == [{"id": SUBMIT.invocation_id, "ok": False, "retry": True}]


def test_a_lease_lost_while_its_call_waits_sends_the_call_again_when_it_retries(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str]) -> None:
    ch, head, worker, endpoint = worker_end
    out, t = _leased_call(ch, endpoint, 1)
    _worker_reads(worker)
    sockets.send(head, p.encode(p.Result("lease:w", False, "WorkerLost", "lost during a lease")))
    t.join(10)
    [again] = out
    assert isinstance(again, p.Submit)
    assert (again.prior_attempts, again.prior_raised, again.prior_lease) == (1, False, "lease:w")


@pytest.mark.parametrize("retries", [0, 1])
def test_a_leased_call_the_scheduler_fails_for_its_timeout_answers_and_is_not_lost(
        worker_end: tuple[SyncChannel, zmq.Socket[Any], zmq.Socket[Any], str],
        retries: int) -> None:
    """Its worker could not stop it at its timeout (worker/lease_clock.py): the scheduler
    fails it with Timeout, then the lease is lost with the killed worker. The call
    answers Timeout, never retried, and its lease no longer counts it in flight."""
    ch, head, worker, endpoint = worker_end
    out, t = _leased_call(ch, endpoint, retries)
    _worker_reads(worker)
    sockets.send(head, p.encode_batch([
        p.Result(SUBMIT.invocation_id, False, "Timeout", "f call ran longer than its timeout"),
        p.Result("lease:w", False, "WorkerLost", "the worker of cpu:0 was lost")]))
    t.join(10)
    [got] = out
    assert isinstance(got, p.Result) and got.error_kind == "Timeout"
    assert not ch.leases.in_flight(SUBMIT.invocation_id)


# ---------------------------------------------------------------- a call through the scheduler

class Caller(Owner):
    """What `call` reads of its client, with short intervals."""

    def __init__(self, grace: float = 30.0) -> None:
        super().__init__()
        self.ping_seconds, self.head_grace, self.idle_rehello = 0.1, grace, 3600.0
        self.info = p.HelloInfo(instance="me")

    def _grace_over(self, silent: float) -> str:
        return f"no word from the scheduler for {silent:.1f}s"


def _calling(ch: SyncChannel, register: p.Register | None = None,
             ) -> tuple[list[p.Result | BaseException], Any]:
    """`ch.call` of SUBMIT in a thread: (what it gave, the thread)."""
    import threading

    out: list[p.Result | BaseException] = []

    def run() -> None:
        try:
            out.append(ch.call(register, SUBMIT, "f"))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return out, t


def _head_reads(head: zmq.Socket[Any], n: int) -> list[p.Message]:
    got: list[p.Message] = []
    while len(got) < n:
        assert head.poll(5000), got
        got += p.decode_all(head.recv_multipart())
    return got


def _answered(head: zmq.Socket[Any], out: list[p.Result | BaseException], t: Any) -> None:
    """The scheduler answers SUBMIT: the call returns that Result."""
    sockets.send(head, p.encode(p.Result(SUBMIT.invocation_id, True, "", "")))
    t.join(5)
    assert isinstance(out[0], p.Result)


@pytest.fixture
def calling(wired: tuple[SyncChannel, zmq.Socket[Any]]) -> tuple[SyncChannel, zmq.Socket[Any]]:
    ch, head = wired
    ch.client = Caller()  # type: ignore[assignment]
    ch.conn, ch.registered, ch.last_heard = Conn(), set(), time.monotonic()  # type: ignore[assignment]
    return ch, head


def test_a_call_through_the_scheduler_waits_for_its_own_result_and_pings_meanwhile(
        calling: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    """Its function is registered once, then the call sent; while it waits it pings
    every ping interval; what else comes is handled (its output printed, another call's
    Result passed over) and the call returns its own Result."""
    ch, head = calling
    register = p.Register("fn-1", "code-1", "f", {}, [])
    out, t = _calling(ch, register)
    sent = _head_reads(head, 2)
    assert [type(m) for m in sent] == [p.Register, p.Submit]
    time.sleep(0.35)
    pings = [m for m in _head_reads(head, 1) if isinstance(m, p.Ping)]
    while head.poll(0):
        pings += [m for m in p.decode_all(head.recv_multipart()) if isinstance(m, p.Ping)]
    assert 2 <= len(pings) <= 5, len(pings)
    sockets.send(head, p.encode_batch([p.Output(SUBMIT.invocation_id, "stdout", "hi\n"),
                                       p.Result("call-other", True, "", "")]))
    time.sleep(0.2)
    assert not out and t.is_alive()  # another call's Result is not this one's
    sockets.send(head, p.encode(p.Result(SUBMIT.invocation_id, True, "", "", frames=(b"v",))))
    t.join(5)
    [result] = out
    assert isinstance(result, p.Result) and [bytes(f) for f in result.frames] == [b"v"]
    assert [o.text for o in ch.client.printed] == ["hi\n"]  # type: ignore[attr-defined]
    assert ch.registered == {"fn-1"}
    out, t = _calling(ch, register)  # registered once: the next call sends only itself
    kinds: list[type] = []
    while p.Submit not in kinds:
        kinds += [type(m) for m in _head_reads(head, 1)]
    assert p.Register not in kinds
    _answered(head, out, t)


def test_a_call_through_a_silent_scheduler_fails_connection_lost_after_the_grace(
        calling: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    from gpufn.exceptions import ConnectionLost

    ch, _ = calling
    ch.client.head_grace = 0.4  # type: ignore[misc]
    began = time.monotonic()
    out, t = _calling(ch)
    t.join(5)
    [error] = out
    assert isinstance(error, ConnectionLost), error
    assert "no word from the scheduler" in str(error) and f"f call {SUBMIT.invocation_id}" in str(error)
    assert 0.4 <= time.monotonic() - began < 2.0


def test_a_call_the_scheduler_refused_for_a_missing_hello_says_hello_and_goes_again(
        calling: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    """The scheduler forgot this connection (a restart): its refusal makes the channel say
    Hello again, marked as resubmitting (the call may have run: recovery.py) and with the
    client's instance, then send the function and the call again, once."""
    from gpufn.net.connection import _FORGOTTEN

    ch, head = calling
    conn = ch.conn
    seen: list[tuple[int, str]] = []
    conn.handshake = lambda timeout: seen.append(  # type: ignore[attr-defined]
        (conn.info.resubmit, conn.info.instance))
    register = p.Register("fn-1", "code-1", "f", {}, [])
    out, t = _calling(ch, register)
    _head_reads(head, 2)
    sockets.send(head, p.encode(p.Error(_FORGOTTEN, "this connection has not said Hello")))
    again = _head_reads(head, 2)
    assert [type(m) for m in again] == [p.Register, p.Submit]
    assert seen == [(1, "me")] and conn.info.resubmit == 0  # only that Hello says it
    _answered(head, out, t)


def test_a_call_waiting_when_the_scheduler_stops_for_good_fails_connection_lost(
        calling: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    from gpufn.exceptions import ConnectionLost

    ch, head = calling
    out, t = _calling(ch)
    _head_reads(head, 1)
    sockets.send(head, p.encode(p.Shutdown("operator said so", final=False)))
    time.sleep(0.2)
    assert not out  # a restart is not the end: it waits on
    sockets.send(head, p.encode(p.Shutdown("operator said so", final=True)))
    t.join(5)
    [error] = out
    assert isinstance(error, ConnectionLost) and "operator said so" in str(error)


def test_a_grant_of_an_unreachable_worker_is_given_back(
        calling: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    """A lease granted while the call waits, of a worker this client cannot reach (its
    probe is not answered), is cancelled at once, once (it was cancelled a second time,
    as if leases were off); with leases off, any grant is."""
    from gpufn.client import direct as direct_mod

    ch, head = calling
    ch.direct = direct_mod.DirectSockets(zmq.Context.instance(), ch.leases)
    ch.direct.probe_now = lambda endpoint: False  # type: ignore[method-assign]
    try:
        ch._granted(p.LeaseGrant("lease:x", "fn-1", "tcp://127.0.0.1:9/x", "s", 30.0, 10))
        [cancel] = _head_reads(head, 1)
        assert isinstance(cancel, p.Cancel) and cancel.invocation_id == "lease:x"
        assert cancel.reason == "unreachable from the client" and not head.poll(100)
        ch.leases.on = False
        ch._granted(p.LeaseGrant("lease:y", "fn-1", "tcp://127.0.0.1:9/y", "s", 30.0, 10))
        [cancel] = _head_reads(head, 1)
        assert isinstance(cancel, p.Cancel) and cancel.invocation_id == "lease:y"
        assert cancel.reason == "leases are off"
    finally:
        ch.direct.close()


def test_a_lease_that_ended_says_nothing_and_one_lost_says_what_ran_under_it(
        wired: tuple[SyncChannel, zmq.Socket[Any]]) -> None:
    """Read between calls: a lease its worker ended is let go; one lost with its worker
    is let go and the scheduler hears which of its calls were answered."""
    ch, head = wired
    for name in ("ended", "lost"):  # of two functions: each call under its own lease
        grant = p.LeaseGrant(f"lease:{name}", f"fn-{name}", f"tcp://127.0.0.1:1/{name}", "s",
                             30.0, 10)
        assert ch.leases.granted(grant, time.monotonic())
        ch.leases.reach[grant.endpoint] = Reach.OK
        call = ch.leases.mark(p.Submit(f"call-{name}", f"fn-{name}", {}))
        assert ch.leases.take(call, time.monotonic()) is not None
        ch.leases.answered(call.invocation_id, True)
    ch._pending.extend([p.Result("lease:ended", True, "", "expired"),
                        p.Result("lease:lost", False, "WorkerLost", "lost")])
    ch._catch_up(None, SUBMIT, "f")
    assert not ch.leases.holds("lease:ended") and not ch.leases.holds("lease:lost")
    [report] = p.decode_all(head.recv_multipart()) if head.poll(2000) else [None]
    assert isinstance(report, p.LeaseReport) and report.lease_id == "lease:lost"
    assert [i["id"] for i in report.items] == ["call-lost"] and not head.poll(100)
