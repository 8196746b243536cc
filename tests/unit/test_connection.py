"""`Connection` and `WakePipe` against a real ZeroMQ ROUTER acting as a tiny scheduler."""

from __future__ import annotations

import itertools
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import gpufn
from gpufn.client.client import Client
from gpufn.net.cluster_file import saved_token, write_cluster_file
from gpufn.net.connection import Backoff, Connection, ConnectionConfig, WakePipe
from gpufn.wire import protocol as p
from gpufn.wire.versions import runtime_info

_names = itertools.count()


class FakeScheduler:
    """A ROUTER bound on inproc:// (shares the test's context) that answers by hand."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.address = f"inproc://fake-scheduler-{os.getpid()}-{next(_names)}"
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind(self.address)

    def recv(self, timeout: float = 5.0) -> tuple[bytes, list[p.Message]]:
        assert self.sock.poll(int(timeout * 1000)), "the fake scheduler received nothing"
        peer, *frames = self.sock.recv_multipart()
        return peer, p.decode_all(frames)

    def send(self, peer: bytes, *msgs: p.Message) -> None:
        self.sock.send_multipart([peer, *p.encode_batch(list(msgs))])

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def sched(ctx: zmq.Context[Any]) -> Iterator[FakeScheduler]:
    s = FakeScheduler(ctx)
    yield s
    s.close()


@pytest.fixture
def conn(ctx: zmq.Context[Any], sched: FakeScheduler) -> Iterator[Connection]:
    c = Connection(ctx, ConnectionConfig(sched.address, "tok"), "w/test", p.Role.WORKER,
                   p.HelloInfo(device="n:0", channel="work"))
    yield c
    c.close()


def _handshake_in_thread(conn: Connection, timeout: float = 5.0) -> Callable[[], list[p.Message]]:
    """Run conn.handshake in a thread; the returned function joins it and re-raises."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["msgs"] = conn.handshake(timeout)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> list[p.Message]:
        t.join(timeout + 5)
        assert not t.is_alive()
        if "error" in out:
            raise out["error"]
        return out["msgs"]

    return join


def _welcome(**info: Any) -> p.Welcome:
    return p.Welcome(True, info=p.WelcomeInfo(**info))


def test_handshake_sends_hello_and_returns_on_welcome(conn: Connection, sched: FakeScheduler) -> None:
    join = _handshake_in_thread(conn)
    peer, msgs = sched.recv()
    assert peer == b"w/test"
    [hello] = msgs
    assert isinstance(hello, p.Hello)
    assert (hello.role, hello.version, hello.token, hello.pid) == (
        p.Role.WORKER, p.PROTOCOL_VERSION, "tok", os.getpid())
    assert hello.info == p.HelloInfo(device="n:0", channel="work", **runtime_info())
    sched.send(peer, _welcome(client_timeout=7))
    assert join() == []
    assert conn.welcome is not None and conn.welcome.info.client_timeout == 7


@pytest.mark.parametrize("kind", [gpufn.AuthenticationError, gpufn.ProtocolMismatch])
def test_a_refusal_raises_its_typed_error(conn: Connection, sched: FakeScheduler,
                                         kind: type[gpufn.GpufnError]) -> None:
    join = _handshake_in_thread(conn)
    peer, _ = sched.recv()
    sched.send(peer, p.Welcome(False, kind.__name__, "go away: set GPUFN_TOKEN"))
    with pytest.raises(kind, match="go away"):
        join()
    assert conn.welcome is None


def test_messages_batched_after_the_welcome_are_returned(conn: Connection,
                                                         sched: FakeScheduler) -> None:
    join = _handshake_in_thread(conn)
    peer, _ = sched.recv()
    early = [p.Cancel("inv1", "x"), p.Shutdown("bye")]
    sched.send(peer, _welcome(), *early)
    assert join() == early


def test_stale_answers_before_the_welcome_are_dropped(conn: Connection,
                                                      sched: FakeScheduler) -> None:
    # Saying Hello again after being forgotten: the refusals of what was sent before
    # the Hello arrive ahead of the Welcome and must not count as a refusal.
    join = _handshake_in_thread(conn)
    peer, _ = sched.recv()
    forgot = p.Error("AuthenticationError", "this connection has not said Hello")
    sched.send(peer, forgot)
    sched.send(peer, forgot, _welcome(), p.Cancel("inv2", ""))
    assert join() == [p.Cancel("inv2", "")]


def test_no_answer_names_the_address_and_the_fix(conn: Connection, sched: FakeScheduler) -> None:
    with pytest.raises(gpufn.ConnectionLost) as e:
        conn.handshake(0.2)
    text = str(e.value)
    assert sched.address in text and "gpufn serve" in text and "GPUFN_ADDRESS" in text


def test_processes_that_need_the_scheduler_exit_with_the_reason(conn: Connection,
                                                                sched: FakeScheduler) -> None:
    with pytest.raises(SystemExit, match="no answer from a gpufn scheduler"):
        conn.handshake_or_exit(0.1, "worker")
    sched.recv()  # that Hello
    out: dict[str, BaseException] = {}

    def run() -> None:
        try:
            conn.handshake_or_exit(5, "supervisor")
        except BaseException as e:
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    peer, _ = sched.recv()
    sched.send(peer, p.Welcome(False, "ProtocolMismatch", "speaks protocol 0"))
    t.join(5)
    assert isinstance(out.get("e"), SystemExit)
    assert str(out["e"]) == "scheduler refused this supervisor: speaks protocol 0"


def test_forgotten_peer_says_hello_again(conn: Connection, sched: FakeScheduler) -> None:
    join = _handshake_in_thread(conn)
    peer, _ = sched.recv()
    sched.send(peer, _welcome())
    join()
    forgot = p.Error("AuthenticationError", "this connection has not said Hello; reconnect")
    other = p.Error("GpufnError", "a worker may not send Submit")
    assert Connection.needs_rehello(forgot) and not Connection.needs_rehello(other)
    assert not conn.needs_rehello(p.Shutdown("x"))
    # Any other error is only reported: what the scheduler gets next is our marker.
    assert conn.on_error(other) is False
    conn.sock.send_multipart(p.encode(p.Ping(41)))
    assert sched.recv()[1] == [p.Ping(41)]
    assert conn.on_error(forgot) is True
    _, [hello] = sched.recv()
    assert isinstance(hello, p.Hello) and hello.token == "tok"
    assert hello.info == p.HelloInfo(device="n:0", channel="work", **runtime_info())


def test_wake_pipe_coalesces_and_wakes_after_a_drain() -> None:
    w = WakePipe()
    try:
        def readable() -> bool:
            return bool(select.select([w.fileno()], [], [], 0)[0])

        assert not readable()
        for _ in range(5):
            w.wake()
        assert readable()
        assert os.read(w.fileno(), 100) == b"x"  # one byte for five wake-ups
        w.drain()
        assert not readable()
        w.wake()  # a wake-up after the drain is seen again
        assert readable()
        w.drain()
        w.drain()  # draining an empty pipe is harmless
        assert not readable()
        poller = zmq.Poller()
        poller.register(w.fileno(), zmq.POLLIN)
        w.wake()
        assert dict(poller.poll(1000)).get(w.fileno())
    finally:
        w.close()


def test_backoff_is_exponential_bounded_and_resets() -> None:
    b = Backoff(initial=0.1, maximum=1.0)
    assert [round(b.next(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.delay(1000) == 1.0
    b.reset()
    assert b.next() == pytest.approx(0.1)
    j = Backoff(initial=1.0, maximum=4.0, jitter=0.5)
    for attempt in range(5):
        d = j.delay(attempt)
        assert 0.5 * min(4.0, 2.0**attempt) <= d <= 4.0


def test_saved_token_only_for_the_saved_address(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_HOME", str(tmp_path))
    assert saved_token("tcp://127.0.0.1:7555") is None
    write_cluster_file("tcp://127.0.0.1:7555", "s3cret")
    assert saved_token("tcp://127.0.0.1:7555") == "s3cret"
    assert saved_token("127.0.0.1:7555") == "s3cret"  # normalized like the client does
    assert saved_token("tcp://127.0.0.1:7556") is None


# --------------------------------------------------------------------------- the client's use


class TcpScheduler:
    """A loopback TCP ROUTER in its own context (the client has a context of its own),
    answering from a thread with `answer(peer, msg) -> replies`."""

    def __init__(self, answer: Callable[[bytes, p.Message], list[p.Message]]) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.answer = answer
        self.seen: list[p.Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, *frames = self.sock.recv_multipart()
            for msg in p.decode_all(frames):
                self.seen.append(msg)
                replies = self.answer(peer, msg)
                if replies:
                    self.sock.send_multipart([peer, *p.encode_batch(replies)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def test_client_raises_the_refusal_and_names_the_address_on_silence() -> None:
    refuse = TcpScheduler(lambda peer, msg: [p.Welcome(False, "AuthenticationError", "wrong token")]
                          if isinstance(msg, p.Hello) else [])
    try:
        with pytest.raises(gpufn.AuthenticationError, match="wrong token"):
            Client(refuse.address, "bad", connect_timeout=5)
    finally:
        refuse.close()
    silent = TcpScheduler(lambda peer, msg: [])
    try:
        with pytest.raises(gpufn.ConnectionLost, match=silent.address):
            Client(silent.address, "t", connect_timeout=0.3)
    finally:
        silent.close()


def test_blocking_call_says_hello_again_when_forgotten_and_resubmits() -> None:
    """The `.remote()` channel: a Submit refused because the scheduler forgot us is sent
    again after a new Hello/Welcome, and its result comes back."""
    known: set[bytes] = set()
    forget_once = threading.Event()

    def answer(peer: bytes, msg: p.Message) -> list[p.Message]:
        if isinstance(msg, p.Hello):
            known.add(peer)
            return [p.Welcome(True, info=p.WelcomeInfo(client_timeout=120))]
        if isinstance(msg, p.Submit) and not forget_once.is_set():
            forget_once.set()
            known.clear()  # "restarted": this submit and everything after is refused
        if peer not in known:
            return [p.Error("AuthenticationError", "this connection has not said Hello")]
        if isinstance(msg, p.Submit):
            return [p.Result(msg.invocation_id, True, "", "")]
        return []

    sched = TcpScheduler(answer)
    client = Client(sched.address, "t", connect_timeout=5)
    try:
        reg = p.Register("f1", "c1", "f", {}, [])
        sub = p.Submit(client.new_id(), "f1", {})
        result = client.call(reg, sub, "f")
        assert result.ok and result.invocation_id == sub.invocation_id
        submits = [m for m in sched.seen if isinstance(m, p.Submit)]
        hellos = [m for m in sched.seen if isinstance(m, p.Hello)]
        assert len(submits) == 2  # refused once, then accepted
        assert len(hellos) == 3  # the I/O thread's, the channel's, the channel's again
    finally:
        client.close()
        sched.close()


def test_a_refused_rehello_fails_every_pending_call_at_once() -> None:
    """The head came back with another token: the client, forgotten, says Hello again and
    is refused. Its pending calls and requests fail with AuthenticationError naming the
    fix, instead of waiting forever (the refusing Welcome used to be dropped)."""
    hellos: list[p.Hello] = []

    def answer(peer: bytes, msg: p.Message) -> list[p.Message]:
        if isinstance(msg, p.Hello):
            hellos.append(msg)
            if len(hellos) == 1:
                return [p.Welcome(True, info=p.WelcomeInfo(devices=1))]
            return [p.Welcome(False, "AuthenticationError", "wrong, missing or revoked token")]
        if isinstance(msg, p.Submit):  # "restarted": it does not know this client any more
            return [p.Error("AuthenticationError", "this connection has not said Hello")]
        return []

    sched = TcpScheduler(answer)
    client = Client(sched.address, "old-token", connect_timeout=5)
    try:
        futs = client.submit_many([(p.Submit(f"i{n}", "f", {}, frames=(b"a",)), "f")
                                   for n in range(3)])
        for fut in futs:
            with pytest.raises(gpufn.AuthenticationError, match="--new-token") as e:
                fut.result(timeout=10)
        assert "refused this client when it reconnected" in str(e.value)
        assert "3 outstanding call(s) failed" in str(e.value)
        assert len(hellos) >= 2
    finally:
        client.close()
        sched.close()


def test_calls_made_while_saying_hello_again_wait_for_their_functions() -> None:
    """The forgotten-client race: a call submitted after the client's new Hello but before
    its Welcome used to reach the scheduler ahead of its function's Register (refused
    before the Hello) and fail with "the scheduler does not know this function". Calls
    made while the Hello is unanswered are held and sent after the Registers, once."""
    known: set[bytes] = set()
    functions: set[str] = set()
    hellos: list[bytes] = []
    forgotten = threading.Event()
    hold_welcome = threading.Event()
    release_welcome = threading.Event()

    def answer(peer: bytes, msg: p.Message) -> list[p.Message]:
        if isinstance(msg, p.Hello):
            hellos.append(peer)
            if len(hellos) > 1:  # the re-hello: answer once the test made more calls
                hold_welcome.set()
                release_welcome.wait(10)
            known.add(peer)
            return [p.Welcome(True, info=p.WelcomeInfo(client_timeout=120))]
        if isinstance(msg, p.Register) and not forgotten.is_set():
            forgotten.set()
            known.clear()  # forgets the client: this Register is refused
        if peer not in known:
            return [p.Error("AuthenticationError", "this connection has not said Hello")]
        if isinstance(msg, p.Register):
            functions.add(msg.function_id)
        elif isinstance(msg, p.Submit):
            if msg.function_id not in functions:
                return [p.Result(msg.invocation_id, False, "GpufnError",
                                 "the scheduler does not know this function")]
            return [p.Result(msg.invocation_id, True, "", "")]
        return []

    sched = TcpScheduler(answer)
    client = Client(sched.address, "t", connect_timeout=5)
    try:
        reg = p.Register("f1", "c1", "f", {}, [])
        client.ensure_registered(reg)
        first = client.submit(p.Submit(client.new_id(), "f1", {}), "f")
        assert hold_welcome.wait(10), "the client did not say Hello again"
        later = [client.submit(p.Submit(client.new_id(), "f1", {}), "f") for _ in range(3)]
        time.sleep(0.3)  # time for those to reach the wire, were they sent now
        release_welcome.set()
        for fut in [first, *later]:
            res = fut.result(10)
            assert res.ok, res.message
        submits = [m.invocation_id for m in sched.seen if isinstance(m, p.Submit)]
        assert submits.count(later[0].result().invocation_id) == 1  # held, sent once
    finally:
        release_welcome.set()
        client.close()
        sched.close()


def test_a_hello_lost_with_a_dying_head_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head died after the client's new Hello reached it and before it answered: no
    Welcome ever comes. The next refusal (here: of a Ping) after a few seconds sends the
    Hello again, and the outstanding call is resubmitted and answered (it used to wait
    until GPUFN_HEAD_GRACE ran out and fail)."""
    import gpufn.client.client as client_module

    monkeypatch.setattr(client_module, "HELLO_AGAIN_SECONDS", 0.3)
    known: set[bytes] = set()
    hellos: list[p.Hello] = []

    def answer(peer: bytes, msg: p.Message) -> list[p.Message]:
        if isinstance(msg, p.Hello):
            hellos.append(msg)
            if len(hellos) == 2:
                return []  # the head that got it died
            known.add(peer)
            return [p.Welcome(True, info=p.WelcomeInfo(client_timeout=120))]
        if isinstance(msg, p.Submit) and len(hellos) == 1:
            known.clear()  # a restart: this Submit is refused, the client says Hello
        if peer not in known:
            return [p.Error("AuthenticationError", "this connection has not said Hello")]
        if isinstance(msg, p.Submit):
            return [p.Result(msg.invocation_id, True, "", "")]
        return []

    sched = TcpScheduler(answer)
    client = Client(sched.address, "t", connect_timeout=5)
    client.ping_seconds = 0.1
    try:
        fut = client.submit(p.Submit(client.new_id(), "f1", {}), "f")
        res = fut.result(10)
        assert res.ok, res.message
        assert len(hellos) == 3
    finally:
        client.close()
        sched.close()
