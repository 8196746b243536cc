"""A calling thread's own connection for blocking `.remote()`: it sends and waits itself
(no I/O-thread hand-off), and under a lease sends straight to the worker and waits there.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

import zmq

from gpufn.client import leases as leasing
from gpufn.client.direct import DirectSockets, Probe
from gpufn.exceptions import ConnectionLost
from gpufn.net import sockets
from gpufn.net.connection import Connection
from gpufn.wire import protocol as p


class Owner(Protocol):
    """What a channel uses of its `Client` (gpufn/client/client.py)."""

    head_grace: float
    ping_seconds: float
    idle_rehello: float
    info: Any
    _ctx: zmq.Context[Any]
    _prefix: str

    def _connection(self, identity: str, channel: str = "") -> Connection: ...

    def _grace_over(self, silent: float) -> str: ...

    def _print_output(self, msg: p.Output, name: str | None = None) -> None: ...

log = logging.getLogger("gpufn.client")

HANDSHAKE_SECONDS = 30.0  # a blocking-call channel's Hello/Welcome


class SyncChannel:
    """A calling thread's own socket for blocking `.remote()`: the caller sends and waits
    itself, saving the two thread hand-offs of the I/O-thread path (the scheduler sees
    it as one more client connection of this process)."""

    def __init__(self, client: Owner, number: int) -> None:
        self.client = client
        self.conn = client._connection(f"c/{os.getpid()}/{client._prefix}/t{number}", "sync")
        self.sock = self.conn.sock
        self.registered: set[str] = set()
        self.last_heard = 0.0
        self.leases = leasing.Leases()  # this channel's own: its socket hears their ends
        self.direct = DirectSockets(client._ctx, self.leases)
        self._pollers: dict[str, zmq.Poller] = {}
        # What the scheduler sent that no one handled yet: a read that returned or raised
        # on one message of a batch leaves the rest here (a lease lost beside the one
        # that failed the call: dropped, the next call went to its dead worker and hung).
        self._pending: deque[p.Message] = deque()
        try:
            self._hello()
        except BaseException:
            self.conn.close()
            raise

    def _send(self, msg: p.Message) -> None:
        sockets.send(self.sock, p.encode(msg))

    def _messages(self) -> Iterator[p.Message]:
        """The scheduler's messages (a poll just said some wait), one at a time: each is
        taken off before its reader handles it, so the rest of its batch stays for the
        next read when the reader returns or raises."""
        self._pending.extend(sockets.received(self.sock, log, ready=True))
        while self._pending:
            yield self._pending.popleft()

    def _catch_up(self, register: p.Register | None, submit: p.Submit, name: str) -> None:
        """Before a call: what an earlier call left unread (a lease's end, a grant)."""
        while self._pending:
            self._other(self._pending.popleft(), register, submit, name, resend=False)

    def _hello(self) -> None:
        self.registered.clear()
        self.conn.handshake(HANDSHAKE_SECONDS)  # nothing else is addressed to us yet
        self.last_heard = time.monotonic()
        self.leases.suspect_all()  # forgotten, maybe restarted: were workers lost meanwhile?

    def call(self, register: p.Register | None, submit: p.Submit, name: str) -> p.Result:
        self._catch_up(register, submit, name)  # before a lease is taken: it may be gone
        if time.monotonic() - self.last_heard > self.client.idle_rehello:
            self._hello()  # the scheduler forgets silent clients; announce ourselves again
        submit = self.leases.mark(submit)
        held = self.leases.take(submit, time.monotonic())
        if held is not None:
            answer = self._direct(held, register, submit, name)
            if isinstance(answer, p.Result):
                return answer
            submit = answer
        if register is not None and register.function_id not in self.registered:
            self._send(register)
            self.registered.add(register.function_id)
        self._send(submit)
        inv = submit.invocation_id
        grace = self.client.head_grace
        try:
            while True:
                # poll, then read without blocking: a blocking recv on a socket that another
                # thread closes at interpreter exit can abort inside libzmq
                if not self.sock.poll(int(self.client.ping_seconds * 1000)):
                    silent = time.monotonic() - self.last_heard
                    if silent > grace:
                        raise ConnectionLost(self.client._grace_over(silent)
                                             + f" ({name} call {inv})")
                    self._send(p.Ping(0))
                    continue
                self.last_heard = time.monotonic()
                for msg in self._messages():
                    if isinstance(msg, p.Result) and msg.invocation_id == inv:
                        return msg
                    self._other(msg, register, submit, name)
        except KeyboardInterrupt:
            self._send(p.Cancel(inv, "interrupted by the caller"))
            raise

    def _direct(self, held: leasing.Held, register: p.Register | None, submit: p.Submit,
                name: str) -> p.Result | p.Submit:
        """The call under a lease, straight to its worker: its Result, or the Submit that
        sends it through the scheduler (the lease ended first; or its worker was lost, or
        it raised an exception it retries on, and the function retries: that attempt
        counted, `leasing.retried`)."""
        g, inv = held.grant, submit.invocation_id
        # The socket object itself, held here: another thread may close the channel (the
        # interpreter exits) meanwhile, and then its use raises ZMQError (ConnectionLost).
        dsock = self.direct.sock(g.endpoint)
        sockets.send(dsock, p.encode(p.DirectRun(g.lease_id, g.secret, inv, submit.frames)),
                     zmq.NOBLOCK)
        poller = self._pollers.get(g.endpoint)
        if poller is None:  # one per endpoint, kept: a call under a lease is ~100 us
            poller = self._pollers[g.endpoint] = zmq.Poller()
            poller.register(dsock, zmq.POLLIN)
            poller.register(self.sock, zmq.POLLIN)
        try:
            return self._wait_direct(held, dsock, poller, register, submit, name)
        except KeyboardInterrupt:
            # Dropped by its worker if it waits there; a running (inline) one is
            # interrupted from the worker's control thread, through the scheduler.
            cancel = p.Cancel(inv, "interrupted by the caller")
            try:
                sockets.send(dsock, p.encode(cancel), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._send(cancel)
            raise

    def _wait_direct(self, held: leasing.Held, dsock: zmq.Socket[Any], poller: zmq.Poller,
                     register: p.Register | None, submit: p.Submit,
                     name: str) -> p.Result | p.Submit:
        g, inv = held.grant, submit.invocation_id
        # Probes behind the call (`DirectSockets.settle`), as (seq, sent): once its lease
        # ended with the call unanswered; once the scheduler forgot us (a restart: the
        # worker may have died meanwhile, which nobody would say).
        settle: tuple[int, float] | None = None
        check: tuple[int, float] | None = None
        while True:
            now = time.monotonic()
            if settle is None and not self.leases.holds(g.lease_id):
                settle = (self.direct.settle(g.endpoint), now)
            if check is None and g.endpoint in self.leases.suspect:
                check = (self.direct.settle(g.endpoint), now)
            ready = dict(poller.poll(int(min(self.client.ping_seconds,
                                             1.0 if settle or check else 3600.0) * 1000)))
            if not ready:
                self._send(p.Ping(0))  # the scheduler keeps us (and says if the lease is lost)
            if ready.get(dsock):
                for msg in self.direct.received(g.endpoint, ready=True):
                    if isinstance(msg, p.Result) and msg.invocation_id == inv:
                        if leasing.should_retry(msg, g):
                            self.leases.answered(inv, False, retry=True)
                            return leasing.retried(submit, g, raised=True)
                        self.leases.answered(inv, msg.ok)
                        return msg
                    if isinstance(msg, p.LeaseRefused):
                        self.leases.refused(msg)
                        if inv in msg.invocation_ids:
                            return submit
                    elif isinstance(msg, p.Output):
                        self.client._print_output(msg, name)
            if ready.get(self.sock):
                self.last_heard = time.monotonic()
                for msg in self._messages():
                    if isinstance(msg, p.Result) and msg.invocation_id == inv:
                        self.leases.answered(inv, msg.ok)  # ended by the scheduler: it ran
                        return msg  # past its timeout and did not stop (worker/lease_clock.py)
                    if (isinstance(msg, p.Result) and msg.invocation_id == g.lease_id
                            and not msg.ok and inv in held.calls):
                        self._lease_lost(g.lease_id)
                        return leasing.lost(submit, g)  # the scheduler reads its journal
                    self._other(msg, register, submit, name, resend=False)
            # The probes, judged after reading what came (a thread that was not scheduled
            # for a while finds the answer waiting, not a silence).
            why = ""
            if settle and self.direct.probe_state(g.endpoint, *settle, now) is not Probe.WAITING:
                why = "its worker did not answer after its lease ended"
            if check:
                state = self.direct.probe_state(g.endpoint, *check, now)
                if state is Probe.ANSWERED:  # it lives: the call's answer will come
                    self.leases.suspect.discard(g.endpoint)
                    check = None
                elif state is Probe.SILENT:
                    self.leases.dead_worker(g.endpoint)
                    why = "its worker did not answer after the scheduler restarted"
            if why:
                log.info("%s call %s under lease %s: %s; sent to the scheduler", name, inv,
                         g.lease_id, why)
                return leasing.lost(submit, g)

    def _other(self, msg: p.Message, register: p.Register | None, submit: p.Submit,
               name: str, resend: bool = True) -> None:
        if isinstance(msg, p.Result) and leasing.is_lease(msg.invocation_id):
            if msg.ok:
                self.leases.ended(msg.invocation_id)
            else:
                self._lease_lost(msg.invocation_id)
        elif isinstance(msg, p.LeaseGrant):
            self._granted(msg)
        elif isinstance(msg, p.Output):
            self.client._print_output(msg, name)
        elif isinstance(msg, p.Shutdown) and msg.final:
            raise ConnectionLost(f"the scheduler stopped ({msg.reason}); the {name} call "
                                 "was failed")
        elif self.conn.needs_rehello(msg):
            self.conn.info.resubmit = 1  # it may have run (scheduler/calls/recovery.py)
            self.conn.info.instance = self.client.info.instance
            self._hello()  # forgotten meanwhile: the submit was refused, send again
            self.conn.info.resubmit = 0
            if not resend:  # the call runs under a lease: its worker answers it
                return
            if register is not None:
                self._send(register)
                self.registered.add(register.function_id)
            self._send(submit)

    def _lease_lost(self, lease_id: str) -> None:
        """Lost with its worker: tell the scheduler what ran there (for its metering)."""
        held = self.leases.ended(lease_id)
        report = held.report() if held is not None else None
        if report is not None:
            self._send(report)

    def _granted(self, grant: p.LeaseGrant) -> None:
        """Take a lease (probing its worker first); give it back if we cannot use it."""
        if self.leases.holds(grant.lease_id):
            return  # handing over queued calls: a blocking channel has none queued
        if self.leases.granted(grant, time.monotonic()):
            for ep in self.leases.endpoints_to_probe():
                if not self.direct.probe_now(ep):  # every lease held goes back, this one too
                    for lease_id in self.leases.unreachable(ep):
                        self._send(p.Cancel(lease_id, "unreachable from the client"))
            return
        self._send(p.Cancel(grant.lease_id, "leases are off"))

    def close(self) -> None:
        self.direct.close()
        self.conn.close()
