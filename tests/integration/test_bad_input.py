"""Payloads over GPUFN_MAX_PAYLOAD are refused before they are buffered whole, and a
result that cannot be pickled fails its call without harming the worker."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.utils.monitor

import gpufn
from gpufn.wire import protocol as p

MiB = 2**20


@gpufn.gpu
def echo(x: object) -> object:
    return x


@gpufn.gpu
def big_result(n: int) -> bytes:
    return b"r" * n


@gpufn.gpu
def returns_a_lock() -> object:
    return threading.Lock()


@gpufn.gpu
def pid() -> int:
    return os.getpid()


def test_arguments_over_the_limit_are_refused_at_the_call_site(fresh_cluster: Any) -> None:
    fresh_cluster(GPUFN_MAX_PAYLOAD="1MiB", GPUFN_CPU_DEVICES=1)
    assert len(echo.remote(b"a" * (MiB // 2))) == MiB // 2  # under the limit: fine
    with pytest.raises(gpufn.PayloadTooLarge, match="echo"):
        echo.spawn(b"a" * (2 * MiB))
    with pytest.raises(gpufn.PayloadTooLarge, match="GPUFN_MAX_PAYLOAD"):
        echo.remote(b"a" * (2 * MiB))
    with pytest.raises(gpufn.PayloadTooLarge):
        list(echo.map([b"a", b"a" * (2 * MiB)]))


def test_a_result_over_the_limit_fails_naming_the_function(fresh_cluster: Any) -> None:
    fresh_cluster(GPUFN_MAX_PAYLOAD="1MiB", GPUFN_CPU_DEVICES=1)
    before = pid.remote()
    with pytest.raises(gpufn.PayloadTooLarge, match="big_result"):
        big_result.remote(2 * MiB)
    assert len(big_result.remote(1000)) == 1000
    assert pid.remote() == before


@gpufn.gpu
def yields_big(n: int) -> Iterator[bytes]:
    yield b"a"
    yield b"b"
    yield b"c" * n
    yield b"d"


@pytest.mark.timeout(60)
def test_a_yielded_value_over_the_limit_ends_its_stream_and_the_worker_serves_on(
        fresh_cluster: Any) -> None:
    fresh_cluster(GPUFN_MAX_PAYLOAD="1MiB", GPUFN_CPU_DEVICES=1)
    before = pid.remote()
    got = []
    with pytest.raises(gpufn.PayloadTooLarge, match="yields_big"):
        for v in yields_big.remote_gen(2 * MiB):
            got.append(v)
    assert got == [b"a", b"b"]  # the values before it arrived
    assert pid.remote() == before
    assert list(yields_big.remote_gen(10)) == [b"a", b"b", b"c" * 10, b"d"]


def test_a_peer_that_bypasses_the_client_is_disconnected(fresh_cluster: Any) -> None:
    """A frame over the limit never reaches the scheduler's handlers: ZeroMQ drops the
    connection when the frame's declared size arrives (MAXMSGSIZE)."""
    c = fresh_cluster(GPUFN_MAX_PAYLOAD="1MiB", GPUFN_CPU_DEVICES=1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
    try:
        sock.connect(c.address)
        sock.send_multipart(p.encode(p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, c.token, 1)))
        assert sock.poll(10_000), "no Welcome"
        assert isinstance(p.decode(sock.recv_multipart()), p.Welcome)
        # Under the limit: processed (the scheduler does not know this function).
        sock.send_multipart(p.encode(p.Submit("small", "nofn", {}, frames=(b"s" * 1000,))))
        assert sock.poll(10_000)
        reply = p.decode(sock.recv_multipart())
        assert isinstance(reply, p.Result) and reply.invocation_id == "small"
        # Over the limit: the connection is dropped, nothing is answered.
        sock.send_multipart(p.encode(p.Submit("huge", "nofn", {}, frames=(b"h" * (3 * MiB),))))
        deadline = time.monotonic() + 10
        events = []
        while time.monotonic() < deadline and zmq.EVENT_DISCONNECTED not in events:
            if monitor.poll(100):
                events.append(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
        assert zmq.EVENT_DISCONNECTED in events, events
        assert not sock.poll(500), "the over-limit message was answered"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()
    assert echo.remote(5) == 5  # the scheduler serves on


def test_an_unpicklable_result_fails_the_call_and_the_worker_lives_on(fresh_cluster: Any) -> None:
    fresh_cluster(GPUFN_CPU_DEVICES=1)
    before = pid.remote()
    with pytest.raises(gpufn.SerializationError, match="returns_a_lock"):
        returns_a_lock.remote()
    with pytest.raises(gpufn.SerializationError, match="returns_a_lock"):
        returns_a_lock.spawn().get(timeout=60)
    assert echo.remote(3) == 3
    assert pid.remote() == before
