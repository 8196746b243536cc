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
