"""The socket helpers every process uses (`gpufn/net/sockets.py`) and the client's sockets
to leased workers (`gpufn/client/direct.py`), over real ZeroMQ sockets in one process."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gpufn.client import direct as direct_mod
from gpufn.client.direct import DirectSockets
from gpufn.client.leases import Leases, Reach
from gpufn.net import sockets
from gpufn.wire import config
from gpufn.wire import protocol as p

pytestmark = pytest.mark.timeout(30)

log = logging.getLogger("test.sockets")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


_pair_ids = iter(range(10**9))


def pair(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    name = f"inproc://pair-{next(_pair_ids)}"
    a.bind(name)
    b.connect(name)
    return a, b


# ------------------------------------------------------------------ configure


def test_a_router_refuses_unknown_peers_and_lets_a_peer_take_its_identity_over(
        ctx: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_HWM", "1234")
    hwm = config.high_water_mark()
    r = ctx.socket(zmq.ROUTER)
    sockets.configure(r, router=True)
    assert (r.getsockopt(zmq.SNDHWM), r.getsockopt(zmq.RCVHWM)) == (hwm, hwm)
    assert r.getsockopt(zmq.LINGER) == 0
    # ROUTER_MANDATORY: a message to a peer that is not there raises, not dropped
    with pytest.raises(zmq.ZMQError) as e:
        r.send_multipart([b"nobody", b"x"], zmq.NOBLOCK)
    assert e.value.errno == zmq.EHOSTUNREACH
    # ROUTER_HANDOVER: a second peer under a taken identity gets it (the old one does not)
    r.bind("inproc://handover")
    first, second = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (first, second):
        s.setsockopt(zmq.IDENTITY, b"peer")
        s.connect("inproc://handover")
        s.send(b"hello")
        assert r.poll(2000)
        assert r.recv_multipart()[0] == b"peer"
    r.send_multipart([b"peer", b"to the newer"])
    assert second.poll(2000) and second.recv() == b"to the newer"
    assert not first.poll(100)


def test_a_dealer_reconnects_with_bounded_backoff_and_queues_before_connecting(
        ctx: zmq.Context[Any]) -> None:
    d = ctx.socket(zmq.DEALER)
    sockets.configure(d)
    hwm = config.high_water_mark()
    assert (d.getsockopt(zmq.SNDHWM), d.getsockopt(zmq.RCVHWM)) == (hwm, hwm)
    assert d.getsockopt(zmq.LINGER) == 0
    assert d.getsockopt(zmq.IMMEDIATE) == 0
    assert d.getsockopt(zmq.RECONNECT_IVL) == sockets.RECONNECT_MS == 100
    assert d.getsockopt(zmq.RECONNECT_IVL_MAX) == sockets.RECONNECT_MAX_MS == 2000


# ------------------------------------------------------------------ send / recv


def test_a_multipart_message_arrives_whole_and_in_order(ctx: zmq.Context[Any]) -> None:
    a, b = pair(ctx)
    sockets.send(a, [b"one", memoryview(b"two"), bytearray(b"three")])
    frames = sockets.recv(b)
    assert [f.bytes for f in frames] == [b"one", b"two", b"three"]
    assert all(isinstance(f, zmq.Frame) for f in frames)
    sockets.send(a, [b"alone"])
    assert [f.bytes for f in sockets.recv(b)] == [b"alone"]
    assert not b.poll(0)  # nothing more: the parts were not sent as messages of their own


def test_frames_go_zero_copy_from_64_kib_and_by_copy_below(ctx: zmq.Context[Any]) -> None:
    """Over inproc a zero-copy frame is the sender's buffer itself: a change to it after
    the send shows at the receiver; a copied one does not."""
    a, b = pair(ctx)
    for n, zero_copy in ((sockets.ZERO_COPY_MIN - 1, False), (sockets.ZERO_COPY_MIN, True)):
        assert sockets.ZERO_COPY_MIN == 64 * 1024
        for make in (bytearray, lambda k: memoryview(bytearray(k))):
            small, big = bytearray(b"head"), make(n)
            sockets.send(a, [small, big])
            big[0] = small[0] = 7
            head, body = sockets.recv(b)
            assert (body.bytes[0] == 7) is zero_copy, (n, make)
            assert head.bytes == b"head"  # pyzmq copies a small frame either way


class Recorder:
    """Stands in for a socket to see how each part is handed to zmq (pyzmq copies a part
    under 64 KiB either way, so the copy flag shows only in what it costs)."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, int, bool]] = []  # (size, flags, copy)

    def send(self, data: Any, flags: int, copy: bool) -> None:
        self.parts.append((memoryview(data).nbytes, flags, copy))


def test_every_part_goes_zero_copy_when_one_reaches_64_kib_else_by_copy() -> None:
    n = sockets.ZERO_COPY_MIN
    for sizes, copy in (([4, n - 1], True), ([4, n], False), ([n, 4], False),
                        ([n + 1], False), ([3, 4, 5], True)):
        r = Recorder()
        sockets.send(r, [bytes(k) for k in sizes], zmq.NOBLOCK)  # type: ignore[arg-type]
        more = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
        flags = [more] * (len(sizes) - 1) + [int(zmq.NOBLOCK)]
        assert r.parts == [(k, f, copy) for k, f in zip(sizes, flags, strict=True)], sizes
    r = Recorder()
    doubles = memoryview(bytearray(n)).cast("d")  # n // 8 items
    sockets.send(r, [doubles])  # type: ignore[arg-type]
    assert r.parts == [(n, 0, False)]  # a memoryview measured in bytes, not items


def test_send_and_recv_block_by_default(ctx: zmq.Context[Any]) -> None:
    d = ctx.socket(zmq.DEALER)  # no peer: a blocking send waits for one
    d.setsockopt(zmq.SNDTIMEO, 300)
    d.setsockopt(zmq.RCVTIMEO, 300)
    for op in (lambda: sockets.send(d, [b"x"]), lambda: sockets.recv(d)):
        start = time.monotonic()
        with pytest.raises(zmq.Again):
            op()
        assert time.monotonic() - start > 0.2


def test_a_non_blocking_send_or_read_raises_again_instead_of_waiting(
        ctx: zmq.Context[Any]) -> None:
    d = ctx.socket(zmq.DEALER)  # connected to nothing: no peer to queue for
    with pytest.raises(zmq.Again):
        sockets.send(d, [b"a", b"b"], zmq.NOBLOCK)
    with pytest.raises(zmq.Again):
        sockets.recv(d, zmq.NOBLOCK)
    _, b = pair(ctx)
    start = time.monotonic()
    with pytest.raises(zmq.Again):
        sockets.recv(b, zmq.NOBLOCK)
    assert time.monotonic() - start < 1.0


# ------------------------------------------------------------------ waiting / received


def test_waiting_says_whether_a_message_can_be_read(ctx: zmq.Context[Any]) -> None:
    a, b = pair(ctx)
    assert sockets.waiting(b) is False
    sockets.send(a, p.encode(p.Ping(1)))
    deadline = time.monotonic() + 5
    while not sockets.waiting(b):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert sockets.waiting(b) is True
    sockets.recv(b)
    assert sockets.waiting(b) is False


def settle(sock: zmq.Socket[Any]) -> None:
    """Until the socket says a message waits (inproc hands it over asynchronously)."""
    assert sock.poll(5000)


def test_received_yields_every_waiting_message_then_stops(ctx: zmq.Context[Any]) -> None:
    a, b = pair(ctx)
    assert list(sockets.received(b, log)) == []
    sockets.send(a, p.encode(p.Ping(1)))
    sockets.send(a, p.encode_batch([p.Ping(2), p.Pong(3)]))
    sockets.send(a, p.encode(p.Pong(4)))
    deadline = time.monotonic() + 5
    got: list[p.Message] = []
    while len(got) < 4 and time.monotonic() < deadline:
        settle(b)
        got += sockets.received(b, log)
    assert got == [p.Ping(1), p.Ping(2), p.Pong(3), p.Pong(4)]
    assert list(sockets.received(b, log)) == []
    assert list(sockets.received(b, log, ready=True)) == []  # a poll that was wrong


def test_received_after_a_poll_reads_at_once_and_then_whatever_else_waits(
        ctx: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair(ctx)
    sockets.send(a, p.encode(p.Ping(1)))
    sockets.send(a, p.encode(p.Ping(2)))
    settle(b)
    time.sleep(0.05)  # both handed over
    asked: list[bool] = []
    real = sockets.waiting

    def counting(sock: zmq.Socket[Any]) -> bool:
        answer = real(sock)
        asked.append(answer)
        return answer

    monkeypatch.setattr(sockets, "waiting", counting)
    assert list(sockets.received(b, log, ready=True)) == [p.Ping(1), p.Ping(2)]
    assert asked == [True, False]  # not asked before the first read
    asked.clear()
    sockets.send(a, p.encode(p.Ping(3)))
    settle(b)
    assert list(sockets.received(b, log)) == [p.Ping(3)]
    assert asked == [True, False]


def test_an_undecodable_message_is_logged_and_skipped_not_the_ones_after_it(
        ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture) -> None:
    a, b = pair(ctx)
    sockets.send(a, [b"\xfe", b"junk"])  # no message has tag 254
    sockets.send(a, p.encode(p.Ping(5)))
    settle(b)
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger=log.name):
        got = list(sockets.received(b, log))
    assert got == [p.Ping(5)]
    said = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert len(said) == 1 and said[0].startswith("undecodable message from the scheduler")
    assert "254" in said[0] or "tag" in said[0]
    assert [r.levelno for r in caplog.records if r.name == log.name] == [logging.WARNING]


# ------------------------------------------------------------------ DirectSockets


class Worker:
    """A worker's direct ROUTER (CURVE or not) that answers a Ping with a Pong."""

    def __init__(self, ctx: zmq.Context[Any], curve: bool = False) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        key = None
        if curve:
            public, secret = zmq.curve_keypair()
            self.sock.curve_server = True
            self.sock.curve_secretkey = secret
            key = public.decode()
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = config.join_address(f"tcp://127.0.0.1:{port}", key)

    def take(self, timeout_ms: int = 5000) -> tuple[bytes, list[p.Message]]:
        assert self.sock.poll(timeout_ms), "nothing reached the worker"
        frames = sockets.recv(self.sock)
        return frames[0].bytes, p.decode_all(frames[1:])

    def answer(self, peer: bytes, msg: p.Message) -> None:
        sockets.send(self.sock, [peer, *p.encode(msg)])


def grant(endpoint: str, lease_id: str = "lease:1") -> p.LeaseGrant:
    return p.LeaseGrant(lease_id, "fn-1", endpoint, "secret", 10.0, 100)


@pytest.fixture
def leases(monkeypatch: pytest.MonkeyPatch) -> Leases:
    monkeypatch.delenv("GPUFN_LEASE_SECONDS", raising=False)
    out = Leases()
    out.on = True
    return out


@pytest.mark.parametrize("curve", [False, True])
def test_one_socket_per_endpoint_reaching_the_worker_with_or_without_curve(
        ctx: zmq.Context[Any], leases: Leases, curve: bool) -> None:
    w = Worker(ctx, curve)
    d = DirectSockets(ctx, leases)
    s = d.sock(w.endpoint)
    assert d.sock(w.endpoint) is s and d.socks == {w.endpoint: s}
    assert s.getsockopt(zmq.TYPE) == zmq.DEALER and s.getsockopt(zmq.LINGER) == 0
    assert bool(s.getsockopt(zmq.CURVE_SERVER)) is False
    d.send(w.endpoint, p.encode(p.Ping(7)))
    peer, msgs = w.take()
    assert msgs == [p.Ping(7)]
    w.answer(peer, p.Pong(7))
    w.answer(peer, p.Ping(8))
    assert s.poll(5000)
    time.sleep(0.05)
    assert list(d.received(w.endpoint, ready=True)) == [p.Ping(8)]  # the Pong is a probe's
    assert leases.reach[w.endpoint] is Reach.OK and d.answered_probe
    d.close()


def test_a_curve_endpoint_with_the_wrong_key_is_not_reached(
        ctx: zmq.Context[Any], leases: Leases) -> None:
    w = Worker(ctx, curve=True)
    wrong = config.join_address(w.endpoint.split("?key=")[0], zmq.curve_keypair()[0].decode())
    d = DirectSockets(ctx, leases)
    d.send(wrong, p.encode(p.Ping(1)))
    assert not w.sock.poll(500)
    d.close()


def test_probes_go_once_per_granted_endpoint_and_a_pong_marks_it_reachable(
        ctx: zmq.Context[Any], leases: Leases) -> None:
    w, silent = Worker(ctx), Worker(ctx)
    d = DirectSockets(ctx, leases)
    assert d.start_probes() == []
    before = time.monotonic()
    assert leases.granted(grant(w.endpoint), before)
    assert leases.granted(grant(silent.endpoint, "lease:2"), before)
    probed = d.start_probes()
    assert set(probed) == {d.sock(w.endpoint), d.sock(silent.endpoint)}
    assert set(d.probing) == {w.endpoint, silent.endpoint}
    assert all(before <= t <= time.monotonic() for t in d.probing.values())
    assert d.start_probes() == []  # each endpoint once
    peer, msgs = w.take()
    assert msgs == [p.Ping(1)]
    assert silent.take()[1] == [p.Ping(1)]
    w.answer(peer, p.Pong(1))
    assert d.sock(w.endpoint).poll(5000)
    assert list(d.received(w.endpoint)) == []
    assert leases.reach[w.endpoint] is Reach.OK and d.answered_probe
    assert set(d.probing) == {silent.endpoint}
    assert leases.reach[silent.endpoint] is Reach.PROBING
    d.close()


def test_a_probe_is_overdue_only_after_probe_seconds_and_said_once(
        ctx: zmq.Context[Any], leases: Leases) -> None:
    d = DirectSockets(ctx, leases)
    d.probing = {"tcp://a:1": 100.0, "tcp://b:2": 101.0}
    assert d.overdue(100.0 + direct_mod.PROBE_SECONDS) == []  # exactly at the bound: not yet
    assert d.overdue(100.0 + direct_mod.PROBE_SECONDS + 0.001) == ["tcp://a:1"]
    assert d.overdue(100.0 + direct_mod.PROBE_SECONDS + 0.001) == []
    assert d.overdue(1000.0) == ["tcp://b:2"]
    assert d.probing == {}


def test_a_blocking_probe_is_true_when_answered_and_false_after_probe_seconds(
        ctx: zmq.Context[Any], leases: Leases, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    w = Worker(ctx)
    d = DirectSockets(ctx, leases)

    def answer_late() -> None:
        peer, msgs = w.take()
        assert msgs == [p.Ping(1)]
        w.answer(peer, p.Ping(2))  # not an answer to the probe: it goes on waiting
        time.sleep(0.2)
        w.answer(peer, p.Pong(1))

    t = threading.Thread(target=answer_late)
    t.start()
    assert d.probe_now(w.endpoint) is True
    t.join()
    assert leases.reach[w.endpoint] is Reach.OK

    monkeypatch.setattr(direct_mod, "PROBE_SECONDS", 0.3)
    silent = Worker(ctx)
    start = time.monotonic()
    assert d.probe_now(silent.endpoint) is False
    assert 0.25 < time.monotonic() - start < 2.0
    assert silent.endpoint not in leases.reach
    d.close()


def test_a_blocking_probe_answered_only_by_other_messages_ends_at_its_deadline(
        ctx: zmq.Context[Any], leases: Leases, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(direct_mod, "PROBE_SECONDS", 0.3)
    w = Worker(ctx)
    d = DirectSockets(ctx, leases)
    stop = threading.Event()

    def chatter() -> None:  # answers the probe with anything but a Pong, on and on
        peer, _ = w.take()
        while not stop.is_set():
            w.answer(peer, p.Ping(9))
            time.sleep(0.001)

    t = threading.Thread(target=chatter)
    t.start()
    try:
        start = time.monotonic()
        assert d.probe_now(w.endpoint) is False
        assert 0.25 < time.monotonic() - start < 0.7
    finally:
        stop.set()
        t.join()
    assert w.endpoint not in leases.reach
    d.close()


def test_a_probe_that_cannot_be_queued_is_still_waited_for(
        ctx: zmq.Context[Any], leases: Leases, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_HWM", "1")
    d = DirectSockets(ctx, leases)
    assert d.probing == {} and d.answered_probe is False and not d.closed
    ep = "tcp://127.0.0.1:9"  # nothing listens: what is sent waits in the queue
    s = d.sock(ep)
    for _ in range(50):  # fill the send queue to its high-water mark
        try:
            d.send(ep, p.encode(p.Ping(0)))
        except zmq.Again:
            break
    else:
        pytest.fail("the queue never filled")
    assert leases.granted(grant(ep), time.monotonic())
    assert d.start_probes() == [s]  # the send was refused, not raised
    assert set(d.probing) == {ep}
    d.close()


def test_closed_direct_sockets_refuse_as_a_closed_socket_would(
        ctx: zmq.Context[Any], leases: Leases) -> None:
    w = Worker(ctx)
    d = DirectSockets(ctx, leases)
    s = d.sock(w.endpoint)
    d.close()
    assert s.closed and d.socks == {} and d.closed
    with pytest.raises(zmq.ZMQError) as e:
        d.sock(w.endpoint)
    assert e.value.errno == zmq.ENOTSOCK
    with pytest.raises(zmq.ZMQError):
        d.send(w.endpoint, p.encode(p.Ping(1)))
