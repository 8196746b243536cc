"""Sockets to workers for calls under a lease (see `leases.py`): one DEALER per worker
endpoint, CURVE when the endpoint names a key, and the probe that tells whether this
client can reach it. Used by the client's I/O thread and by each blocking-call channel,
each with its own `DirectSockets` (ZeroMQ sockets stay in the thread that made them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from enum import Enum
from typing import Any

import zmq

from gpufn.client.leases import PROBE_SECONDS, Leases, Reach
from gpufn.net import curve as security
from gpufn.net import sockets
from gpufn.wire import config
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.client")


# A live worker answers a probe within this even when busy; a settle probe (below) that
# goes unanswered this long says the worker is gone.
SETTLE_SECONDS = 10.0
PROBE_SEQ = 1  # the reachability probe's Ping; settle probes count up from 2


class Probe(Enum):
    """Where a settle probe (`DirectSockets.settle`) stands."""

    WAITING = "waiting"
    ANSWERED = "answered"
    SILENT = "silent"  # unanswered for SETTLE_SECONDS: the worker is gone


class DirectSockets:
    def __init__(self, ctx: zmq.Context[Any], leases: Leases) -> None:
        self.ctx = ctx
        self.leases = leases
        self.socks: dict[str, zmq.Socket[Any]] = {}
        self.probing: dict[str, float] = {}  # endpoint -> when its probe went
        self.ponged: dict[str, int] = {}  # endpoint -> the highest probe seq it answered
        self._seq = PROBE_SEQ
        self.answered_probe = False  # a probe was answered since the owner last looked
        self.closed = False

    def sock(self, endpoint: str) -> zmq.Socket[Any]:
        if self.closed:  # as a closed socket would say it (the caller's ZMQError path)
            raise zmq.ZMQError(zmq.ENOTSOCK, "the client's direct sockets are closed")
        s = self.socks.get(endpoint)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            sockets.configure(s)
            where, key = config.split_address(endpoint)
            if key is not None:
                mine = security.client_keys()
                s.curve_serverkey = key.encode()
                s.curve_publickey = mine.public
                s.curve_secretkey = mine.secret
            s.connect(where)
            self.socks[endpoint] = s
        return s

    def send(self, endpoint: str, frames: list[Any]) -> None:
        sockets.send(self.sock(endpoint), frames, zmq.NOBLOCK)

    def start_probes(self) -> list[zmq.Socket[Any]]:
        """Probe the endpoints granted since the last look; their sockets (to poll)."""
        out = []
        for ep in self.leases.endpoints_to_probe():
            s = self.sock(ep)
            try:
                sockets.send(s, p.encode(p.Ping(PROBE_SEQ)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.probing[ep] = time.monotonic()
            out.append(s)
        return out

    def settle(self, endpoint: str) -> int:
        """A probe to a leased worker that says more than "reachable": its seq, for
        `probe_state`. The worker reads its socket in order, so a live one handles (answers
        or refuses) every call sent before the probe before it answers it. Sent when a
        lease ended (the worker said so through the scheduler) with calls unanswered: once
        the probe is answered, or `SETTLE_SECONDS` passed, what is still unanswered was
        lost with a worker that died since (nobody else would say so). Sent too when the
        scheduler forgot us (it restarted, and the worker may have died meanwhile): an
        answer says the worker lives; silence, that its lease's calls are lost."""
        self._seq += 1
        try:
            sockets.send(self.sock(endpoint), p.encode(p.Ping(self._seq)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # unanswered, as a dead worker's
        return self._seq

    def probe_state(self, endpoint: str, seq: int, sent: float, now: float) -> Probe:
        if self.ponged.get(endpoint, 0) >= seq:
            return Probe.ANSWERED
        return Probe.SILENT if now - sent > SETTLE_SECONDS else Probe.WAITING

    def overdue(self, now: float) -> list[str]:
        """Endpoints whose probe went unanswered: unreachable (leases off)."""
        late = [ep for ep, t in self.probing.items() if now - t > PROBE_SECONDS]
        for ep in late:
            del self.probing[ep]
        return late

    def received(self, endpoint: str, ready: bool = False) -> Iterator[p.Message]:
        """What waits on an endpoint's socket (`ready`: a poll just said something does);
        a Pong marks it reachable."""
        s = self.sock(endpoint)
        for msg in sockets.received(s, log, ready):
            if isinstance(msg, p.Pong):
                if msg.seq > self.ponged.get(endpoint, 0):
                    self.ponged[endpoint] = msg.seq
                self.probing.pop(endpoint, None)  # any answer says it is reachable
                self.leases.reach[endpoint] = Reach.OK
                self.answered_probe = True
                continue
            yield msg

    def probe_now(self, endpoint: str) -> bool:
        """A blocking probe (a blocking-call channel): reachable within PROBE_SECONDS."""
        s = self.sock(endpoint)
        sockets.send(s, p.encode(p.Ping(PROBE_SEQ)), zmq.NOBLOCK)
        deadline = time.monotonic() + PROBE_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            if not s.poll(max(1, int(left * 1000))):
                break
            for msg in sockets.received(s, log):
                if isinstance(msg, p.Pong):
                    self.leases.reach[endpoint] = Reach.OK
                    return True
        return False

    def close(self) -> None:
        self.closed = True
        for s in list(self.socks.values()):
            s.close(0)
        self.socks.clear()
