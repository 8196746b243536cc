"""The client: one I/O thread owns the DEALER socket; callers get futures.

Calls are pickled in the caller's thread (so a bad argument fails at the call site),
queued to the I/O thread, and matched to results by invocation id. The client holds its
calls through a scheduler restart: ZeroMQ reconnects (with backoff), the new scheduler
says it does not know us, and we say Hello again and resubmit what is outstanding. Only
a final stop (`gpufn shutdown`) or a scheduler silent longer than the grace
(`GPUFN_HEAD_GRACE`) fails the outstanding calls, with `ConnectionLost` saying which.
"""

from __future__ import annotations

import getpass
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from gpufn.client import leases as leasing
from gpufn.client.direct import DirectSockets, Probe
from gpufn.client.futures import CallFuture
from gpufn.client.items import ItemQueue
from gpufn.client.sync_channel import SyncChannel
from gpufn.exceptions import (
    AuthenticationError,
    Cancelled,
    ConnectionLost,
    GpufnError,
    ProtocolMismatch,
    WorkerLost,
    from_wire,
    kind_of,
)
from gpufn.net import sockets
from gpufn.net.connection import HELLO_AGAIN_SECONDS, Connection, ConnectionConfig, WakePipe
from gpufn.net.discovery import Target
from gpufn.wire import config, shm
from gpufn.wire import protocol as p
from gpufn.wire.versions import runtime_info, skew

log = logging.getLogger("gpufn.client")

PING_SECONDS = 2.0
BATCH_MAX = 256
HELD_LOOK_MS = 50  # calls held back for a lease are looked at again at least this often


@dataclass(slots=True)
class _Pending:
    future: Future[p.Result]
    name: str
    function_id: str = ""
    frames: list[Any] | None = None  # the encoded Submit, sent again if the scheduler forgets us
    # The Submit itself, encoded only when it goes to the scheduler (most of a leased
    # .map's calls never do: they leave as DirectRuns).
    submit: p.Submit | None = None

    def encoded(self) -> list[Any] | None:
        if self.frames is None and self.submit is not None:
            self.frames = p.encode(self.submit)
        return self.frames


class Client:
    """A connection to a gpufn scheduler (remote, or the embedded local cluster)."""

    def __init__(self, address: str, token: str | None = None, *, cluster: Any = None,
                 connect_timeout: float = 30.0, target: Target | None = None) -> None:
        self.address = config.normalize_address(address)
        self.token = token or ""
        self.cluster = cluster
        self.target = target  # where the address came from (gpufn.net.discovery)
        self.pid = os.getpid()
        self.head_grace = config.head_grace()  # a scheduler away longer fails our calls
        self._print_calls = config.print_call_output()  # off in the HTTP gateway
        self._prefix = os.urandom(4).hex()
        self._counter = itertools.count(1)
        self._calls: dict[str, _Pending] = {}
        self._streams: dict[str, ItemQueue] = {}  # generator calls' values, by call id
        self._status: dict[int, Future[Any]] = {}  # status and app requests, by id
        self._status_frames: dict[int, list[Any]] = {}
        self.ping_seconds = PING_SECONDS
        self._registered: set[str] = set()
        self._register_frames: dict[str, list[Any]] = {}
        self._resubmit = False  # forgotten: a new Hello is out, its Welcome not yet in
        self._rehello_at = 0.0  # when that Hello went (one lost with a dying head is sent again)
        self._lock = threading.Lock()
        self._outbox: deque[list[Any]] = deque()
        # Repeat calls straight to a worker under a lease (leases.py): (endpoint, frames).
        self.leases = leasing.Leases()
        self._direct_box: deque[tuple[str, list[Any]]] = deque()
        self._parked: dict[str, list[tuple[str, list[Any]]]] = {}  # until its probe answers
        # Calls unanswered when their lease ended (I/O thread only): the grant, until the
        # settle probe of its endpoint (`DirectSockets.settle`) says they are lost.
        self._to_settle: dict[str, p.LeaseGrant] = {}
        # endpoint -> its probe (`DirectSockets.settle`) as (seq, sent); (0, 0): to send.
        self._settles: dict[str, tuple[int, float]] = {}  # behind calls of ended leases
        self._checks: dict[str, tuple[int, float]] = {}  # of suspect workers (a restart)
        # Calls of a function kept here while a few of it go to the scheduler, until it
        # grants a lease (they go to the worker) or answers without one (to the scheduler).
        self._held_back: dict[str, deque[p.Submit]] = {}
        self._held_ids: set[str] = set()
        # Sent before the outbox: the new Hello, then what the Welcome makes us send again.
        # While `_resubmit` is set the outbox is held (see `_send_again`).
        self._front: deque[list[Any]] = deque()
        self._wake_pipe = WakePipe()
        # Closed once nothing can reach this client (not at exit: its thread may still poll).
        weakref.finalize(self, self._wake_pipe.close).atexit = False
        self._connect_timeout = connect_timeout
        self._welcome: Future[p.Welcome] = Future()
        self._conn: Connection | None = None  # the I/O thread's, once it is welcomed
        self._sync = threading.local()
        self._channel_ids = itertools.count(1)
        self._channels: list[SyncChannel] = []
        self.idle_rehello = config.env_float("GPUFN_CLIENT_TIMEOUT", 120.0) / 2
        self._shm_files: dict[str, tuple[list[str], int]] = {}  # call id -> its argument files, bytes
        self._closed = threading.Event()
        self._io_done = threading.Event()
        self._last_heard = time.monotonic()
        self._ctx = zmq.Context()
        self._io = threading.Thread(target=self._loop, name="gpufn-client-io", daemon=True)
        self._io.start()
        try:
            # The I/O thread's handshake gives up after connect_timeout itself.
            welcome = self._welcome.result(connect_timeout + 10)
        except GpufnError:
            self.close()
            raise
        except BaseException:  # interrupted: the I/O thread ends once its handshake does
            self._closed.set()
            raise
        self.info = welcome.info
        # Big values through shared memory (gpufn/wire/shm.py): results whenever this
        # host has /dev/shm; arguments only when every device host is this one (and user).
        threshold = config.shm_threshold()
        host = shm.host_id()
        self.shm_results = bool(threshold and host)
        # (The embedded cluster's devices are this host's by construction; its supervisor
        # may not have announced them yet when we are welcomed.)
        local = cluster is not None or (welcome.info.hosts and all(
            h == host for h in welcome.info.hosts))
        self._shm_args = threshold if threshold and host and local else None

    # ------------------------------------------------------------------ public

    @property
    def closed(self) -> bool:
        """Closed (by `close()`, or its I/O thread failed): a new Client is needed."""
        return self._closed.is_set()

    def shm_outgoing(self) -> shm.Outgoing | None:
        """Where a call's big arguments go: shared-memory files owned by this process, or
        None to send them through the socket."""
        if self._shm_args is None:
            return None
        return shm.Outgoing(os.getpid(), self._shm_args, pool=shm.pool())

    def track_shm(self, invocation_id: str, out: shm.Outgoing) -> None:
        """The call's argument files: removed when it ends, whether a worker read them or not."""
        with self._lock:
            self._shm_files[invocation_id] = (out.names, out.nbytes)

    def shm_bytes(self, invocation_id: str) -> int:
        """Bytes of the call's arguments that travel through shared memory."""
        entry = self._shm_files.get(invocation_id)
        return entry[1] if entry else 0

    @staticmethod
    def shm_reusable(meta: p.ResultMeta | None) -> list[str]:
        """The call's pooled argument files its worker let go of or sent the result back
        in: reusable (once its result is gone) when one run on one device read them
        (another attempt or rank may still map them)."""
        if meta is None or len(meta.devices) > 1 or meta.attempts > 1:
            return []
        return shm.owned((meta.shm_freed or []) + (meta.shm or []))

    def _release_shm(self, invocation_id: str, meta: p.ResultMeta | None, taken: bool) -> None:
        """The call ended: its argument files go; so do its result's if nobody reads them."""
        with self._lock:
            entry = self._shm_files.pop(invocation_id, None)
        if entry:
            if taken and meta is not None and meta.shm:  # the result is in one: kept to be read
                shm.hold(set(entry[0]) & set(meta.shm))
            shm.release(entry[0], self.shm_reusable(meta))
        if meta is not None and meta.shm and not taken:
            shm.release(shm.owned(meta.shm))

    def new_id(self) -> str:
        return f"{self._prefix}{next(self._counter):08x}"

    def ensure_registered(self, register: p.Register) -> None:
        if register.function_id in self._registered:  # (once registered, always: no lock)
            return
        with self._lock:
            if register.function_id in self._registered:
                return
            self._registered.add(register.function_id)
            frames = self._register_frames[register.function_id] = p.encode(register)
        self._enqueue(frames)

    def submit(self, submit: p.Submit, name: str) -> Future[p.Result]:
        fut: Future[p.Result] = CallFuture()
        if self._closed.is_set():
            fut.set_exception(ConnectionLost("this gpufn client is closed; call gpufn.connect() again"))
            return fut
        submit = self.leases.mark(submit, submit.invocation_id in self._streams)
        with self._lock:  # in `_calls` and the outbox together (see `_send_again`)
            self._calls[submit.invocation_id] = _Pending(fut, name, submit.function_id,
                                                         None, submit)
            self._route(submit)
        self._wake()
        return fut

    def _route(self, submit: p.Submit) -> None:
        """To the worker under a lease when one with room is held for its function, else
        to the scheduler, else (enough of its calls are there, and a lease may come) kept
        here for now (under `_lock`). Behind calls of its function held back already
        it waits too (in order; the answers that make room release them)."""
        held = self._held_back.get(submit.function_id)
        if held or not self._send_now(submit):
            self._held_back.setdefault(submit.function_id, deque()).append(submit)
            self._held_ids.add(submit.invocation_id)

    def _send_now(self, submit: p.Submit) -> bool:
        """`_route` but for holding back: False when the call should wait here."""
        now = time.monotonic()
        held = self.leases.take(submit, now)
        if held is None:
            fid = submit.function_id
            if submit.lease and self.leases.hold_back(fid, now):
                return False
            if submit.lease:
                self.leases.to_head(fid, submit.invocation_id)
            pend = self._calls.get(submit.invocation_id)
            frames = pend.encoded() if pend is not None else None
            self._outbox.append(frames if frames is not None else p.encode(submit))
            return True
        g = held.grant
        self._direct_box.append((g.endpoint, p.encode(p.DirectRun(
            g.lease_id, g.secret, submit.invocation_id, submit.frames))))
        return True

    def submit_stream(self, submit: p.Submit, name: str) -> tuple[Future[p.Result], ItemQueue]:
        """Submit a generator call: its values go to the queue, which ends with the call."""
        items = ItemQueue()
        with self._lock:
            self._streams[submit.invocation_id] = items
        fut = self.submit(submit, name)
        fut.add_done_callback(items.end)
        return fut, items

    def credit(self, invocation_id: str, allowed: int) -> None:
        """A stream's consumer read more: its producer may send `allowed` values in all."""
        self._enqueue(p.encode(p.Credit(invocation_id, 0, allowed)))

    def attach(self, invocation_id: str, name: str = "call") -> Future[p.Result]:
        """The Result of a call made by another client (`FunctionCall.from_id`)."""
        fut: Future[p.Result] = Future()
        frames = p.encode(p.Attach(invocation_id))
        with self._lock:
            mine = self._calls.get(invocation_id)
            if mine is not None:  # made (or attached to) by this client: the same result
                return mine.future
            self._calls[invocation_id] = _Pending(fut, name, "", frames)
            self._outbox.append(frames)
        self._wake()
        return fut

    def submit_many(self, items: list[tuple[p.Submit, str]],
                    lease: bool = True) -> list[Future[p.Result]]:
        """Submit calls together; `lease=False`: all through the scheduler (a .map whose
        order across devices is the scheduler's to keep: `cost=`)."""
        futs: list[Future[p.Result]] = []
        submits: list[p.Submit] = []
        closed = self._closed.is_set()
        with self._lock:
            for submit, name in items:
                fut: Future[p.Result] = CallFuture()
                submit = self.leases.mark(submit) if lease else submit
                self._calls[submit.invocation_id] = _Pending(fut, name, submit.function_id,
                                                             None, submit)
                futs.append(fut)
                submits.append(submit)
            if not closed:
                for submit in submits:
                    self._route(submit)
        if closed:
            for f in futs:
                f.set_exception(ConnectionLost("this gpufn client is closed"))
            return futs
        self._wake()
        return futs

    def call(self, register: p.Register | None, submit: p.Submit, name: str) -> p.Result:
        """Submit and wait in the calling thread (the blocking `.remote()` path)."""
        if self._closed.is_set():
            raise ConnectionLost("this gpufn client is closed; call gpufn.connect() again")
        ch: SyncChannel | None = getattr(self._sync, "channel", None)
        if ch is None:
            ch = self._sync.channel = SyncChannel(self, next(self._channel_ids))
            with self._lock:
                self._channels.append(ch)
            # A finished thread's socket is closed (thread ids are reused; sockets are not).
            weakref.finalize(threading.current_thread(), self._drop_channel, ch)
        try:
            return ch.call(register, submit, name)
        except zmq.ZMQError:
            if self._closed.is_set():  # closed by another thread (exit, connect()) meanwhile
                raise ConnectionLost(f"the gpufn client was closed while a {name} call was "
                                     "waiting; call again (a new connection is made)") from None
            raise

    def _drop_channel(self, ch: SyncChannel) -> None:
        with self._lock:
            if ch not in self._channels:
                return
            self._channels.remove(ch)
        ch.close()

    def cancel(self, invocation_id: str, reason: str = "", include_running: bool = True) -> None:
        """Stop a call of this client: dropped if it waits (here, at the scheduler or
        at its worker under a lease), interrupted if it runs and `include_running`."""
        with self._lock:  # still here, waiting for a lease: it ends here, never sent
            waiting = invocation_id in self._held_ids
            if waiting:
                self._held_ids.discard(invocation_id)
                pend = self._calls.pop(invocation_id, None)
        if waiting:
            if pend is not None and not pend.future.done():
                pend.future.set_result(p.Result(invocation_id, False, kind_of(Cancelled),
                                                f"cancelled before it was sent ({reason})"))
            return
        endpoint = self.leases.endpoint_of(invocation_id)
        if endpoint is not None:  # under a lease: its worker drops it if it waits there
            with self._lock:
                self._direct_box.append((endpoint, p.encode(p.Cancel(
                    invocation_id, reason, include_running))))
            if not include_running:
                self._wake()
                return
            # A running one (inline on the worker's main thread, which reads the lease's
            # socket only between calls) is interrupted through the scheduler: below.
        self._enqueue(p.encode(p.Cancel(invocation_id, reason, include_running)))

    def cancel_checked(self, invocation_id: str, reason: str = "",
                       timeout: float = 10.0) -> bool:
        """Cancel and wait for the scheduler's answer: True if it stopped the call, False
        if it had ended, or is unknown to it (another user's call looks unknown)."""
        data = self._request(lambda rid: p.Cancel(invocation_id, reason, True, 0, rid),
                             "the cancel", timeout)
        return bool(data.get("cancelled"))

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        return self._request(lambda rid: p.StatusRequest(rid), "a status request", timeout)

    def query(self, kind: str, args: dict[str, Any] | None = None,
              timeout: float = 10.0) -> dict[str, Any]:
        """Read an operational book of the scheduler (`p.QueryKind`: logs, usage)."""
        return self._request(lambda rid: p.Query(rid, kind, args or {}), f"a {kind} query",
                             timeout)

    def drain(self, grace: float, reason: str = "", timeout: float = 10.0) -> dict[str, Any]:
        """Ask the scheduler to stop cleanly (see `p.Drain`); returns its acknowledgement."""
        return self._request(lambda rid: p.Drain(rid, grace, reason), "the shutdown request",
                             timeout)

    def ask(self, make: Any, timeout: float = 60.0) -> dict[str, Any]:
        """Send a Deploy/Lookup/AppCommand built by `make(request_id)`; the reply's data,
        or its gpufn error (NotFound, AppStopped, ...) raised here."""
        return self._request(make, "the request", timeout)

    def _request(self, make: Any, what: str, timeout: float) -> dict[str, Any]:
        """Send `make(request_id)` and wait for its reply's data (see `_dispatch`)."""
        rid, fut = self.request(make)
        try:
            data: dict[str, Any] = fut.result(timeout)
            return data
        except TimeoutError:
            raise ConnectionLost(f"the scheduler at {self.address} did not answer {what} "
                                 f"within {timeout:.0f}s") from None
        finally:
            self.forget(rid)

    def request(self, make: Any) -> tuple[int, Future[Any]]:
        """Send a request built by `make(request_id)` (StatusRequest, Query, Drain, Deploy,
        Lookup, AppCommand) without waiting: its id and the future of its reply's data (a
        refusal is the future's exception). Call `forget(id)` once it is answered or
        abandoned (until then it is sent again if the scheduler forgets this client)."""
        rid = next(self._counter)
        fut: Future[Any] = Future()
        self._status[rid] = fut
        frames = self._status_frames[rid] = p.encode(make(rid))
        self._enqueue(frames)
        return rid, fut

    def forget(self, request_id: int) -> None:
        self._status.pop(request_id, None)
        self._status_frames.pop(request_id, None)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        if threading.current_thread() is not self._io:
            self._io_done.wait(5)
        self._fail_all(ConnectionLost("the gpufn client was closed"))
        with self._lock:
            channels, self._channels = self._channels, []
        for ch in channels:
            ch.close()
        # Its file descriptors go back (a process that connects many times ran out of
        # them): the context once its sockets are closed, in a thread of its own so that a
        # socket still open elsewhere cannot hang close(); the wake pipe once nothing can
        # reach this client any more (a late wake-up must not write to a reused fd).
        if self._io_done.is_set():  # else its I/O thread still uses its socket
            threading.Thread(target=self._ctx.term, name="gpufn-client-term",
                             daemon=True).start()

    # ------------------------------------------------------------------ I/O thread

    def _enqueue(self, frames: list[Any]) -> None:
        self._outbox.append(frames)
        self._wake()

    def _wake(self) -> None:
        self._wake_pipe.wake()  # coalesced: the I/O thread drains the whole outbox

    def _fail_all(self, exc: GpufnError) -> None:
        with self._lock:
            calls, self._calls = self._calls, {}
            self._streams.clear()  # their queues end with their calls' futures
            files, self._shm_files = self._shm_files, {}
            self._held_back.clear()
            self._held_ids.clear()
        for names, _ in files.values():
            shm.release(names)
        for pend in calls.values():
            if not pend.future.done():
                pend.future.set_exception(exc)
        for fut in list(self._status.values()):
            if not fut.done():
                fut.set_exception(exc)

    def __repr__(self) -> str:
        target = getattr(self, "target", None)
        origin = f" from {target.origin()}" if target is not None else ""
        closed = getattr(self, "_closed", None)
        state = " closed" if closed is not None and closed.is_set() else ""
        return f"<gpufn.Client {self.address}{origin}{state}>"

    def _connection(self, identity: str, channel: str = "") -> Connection:
        info = p.HelloInfo(user=_os_user(), channel=channel, host=shm.host_id())
        hint = self.target.unreachable_hint() if self.target is not None else ""
        return Connection(self._ctx, ConnectionConfig(self.address, self.token, hint), identity,
                          p.Role.CLIENT, info)

    def _connect(self) -> Connection | None:
        """The I/O thread's handshake; its outcome goes to the constructor's future."""
        try:  # a malformed address fails here, in connect()
            conn = self._connection(f"c/{os.getpid()}/{self._prefix}")
        except BaseException as e:
            self._ctx.destroy(linger=0)  # the half-made socket would block the context's exit
            self._welcome.set_exception(e)
            return None
        try:
            early = conn.handshake(self._connect_timeout)
        except BaseException as e:
            conn.close()
            self._welcome.set_exception(e)
            return None
        welcome = conn.welcome
        assert welcome is not None
        skewed = skew(runtime_info(), welcome.info.runtimes)
        if skewed is not None:  # now, not as an unpickling error in the middle of a call
            conn.close()
            self._welcome.set_exception(ProtocolMismatch(skewed))
            return None
        # Ping well within the time after which the scheduler forgets a silent client.
        client_timeout = welcome.info.client_timeout
        self.ping_seconds = min(PING_SECONDS, client_timeout / 4)
        self.idle_rehello = client_timeout / 2
        self._last_heard = time.monotonic()
        self._conn = conn
        self._welcome.set_result(welcome)
        for msg in early:
            self._dispatch(msg)
        return conn

    def _loop(self) -> None:
        conn = self._connect()
        if conn is None:
            self._io_done.set()
            return
        sock = conn.sock
        wake_fd = self._wake_pipe.fileno()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_fd, zmq.POLLIN)
        pending_send: list[Any] | None = None
        direct = DirectSockets(self._ctx, self.leases)
        polled: set[Any] = set()
        try:
            last_ping = held_look = time.monotonic()
            while not self._closed.is_set():
                now = time.monotonic()
                next_ping = last_ping + self.ping_seconds  # ping_seconds may change
                blocked = pending_send is not None
                wait_ms = 5 if blocked else max(0, int((next_ping - now) * 1000))
                if direct.probing or self._held_back or self._settles or self._checks:
                    wait_ms = min(wait_ms, HELD_LOOK_MS)
                ready = dict(poller.poll(wait_ms))
                if ready.get(wake_fd):
                    self._wake_pipe.drain()  # before draining the outbox below
                if ready.get(sock):
                    self._receive(sock)
                self._direct_io(direct, ready)
                if self._held_back and time.monotonic() >= held_look:
                    # calls held back for a lease's room look again now and then, also
                    # when no answer came to move them (a hand-over's hold ran out)
                    self._release_held()
                    held_look = time.monotonic() + HELD_LOOK_MS / 1000
                for s in direct.socks.values():
                    if s not in polled:
                        poller.register(s, zmq.POLLIN)
                        polled.add(s)
                # Send what callers queued, batched; a full socket (HWM) keeps the rest here.
                # While a new Hello is unanswered the outbox waits (see `_send_again`).
                while pending_send is not None or self._front or (
                        self._outbox and not self._resubmit):
                    if pending_send is not None:
                        frames = pending_send
                    else:
                        queue = self._front or self._outbox
                        parts = [queue.popleft()]
                        while queue and len(parts) < BATCH_MAX:
                            parts.append(queue.popleft())
                        frames = p.batch_frames(parts)
                    try:
                        sockets.send(sock, frames, zmq.NOBLOCK)
                        pending_send = None
                    except zmq.Again:
                        pending_send = frames
                        break
                now = time.monotonic()
                if now >= next_ping:
                    last_ping = now
                    try:
                        sock.send_multipart(p.encode(p.Ping(int(now))), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                    if self._calls and now - self._last_heard > self.head_grace:
                        self._fail_all(ConnectionLost(self._grace_over(now - self._last_heard)))
            try:
                sock.send_multipart(p.encode(p.Goodbye("client closing")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        except Exception as e:  # never leave callers hanging on a dead I/O thread
            log.exception("gpufn client I/O thread failed")
            self._closed.set()  # the next call connects afresh
            self._fail_all(ConnectionLost(f"the gpufn client I/O thread failed: {e}; "
                                          "call again (a new connection is made)"))
        finally:
            direct.close()
            sock.close(100)
            self._io_done.set()

    def _direct_io(self, direct: DirectSockets, ready: dict[Any, int]) -> None:
        """The lease side of one I/O round: answers from workers, probes of newly granted
        endpoints (and the unreachable ones given back), then the DirectRuns queued."""
        for ep, s in list(direct.socks.items()):
            if ready.get(s):
                for msg in direct.received(ep):
                    self._dispatch_direct(msg)
        direct.start_probes()
        for ep in direct.overdue(time.monotonic()):
            for lease_id in self.leases.unreachable(ep):
                self._outbox.append(p.encode(p.Cancel(lease_id, "unreachable from the client")))
            parked = self._parked.pop(ep, [])
            for inv, _ in parked:
                self.leases.withdraw(inv)
            self._lease_fallback([inv for inv, _ in parked])
            if self._held_back:
                self._release_held()
        for ep in [e for e in self._parked if self.leases.reach.get(e) is leasing.Reach.OK]:
            self._direct_box.extend((ep, frames) for _, frames in self._parked.pop(ep))
        if direct.answered_probe and self._held_back:  # a lease became usable
            self._release_held()
        direct.answered_probe = False
        # The calls for one worker leave as one message (a batch, as to the scheduler):
        # a message each cost its own send, and off loopback its own encryption.
        box = self._direct_box
        while box:
            ep = box[0][0]
            n = 1
            while n < len(box) and n < BATCH_MAX and box[n][0] == ep:
                n += 1
            parts = [box[i][1] for i in range(n)]
            try:
                direct.send(ep, p.batch_frames(parts))
            except zmq.Again:  # the worker reads slowly: the rest waits for the next round
                break
            for _ in range(n):
                box.popleft()
        if self._settles or self._checks:  # after the DirectRuns: a probe goes behind them
            self._settle(direct)

    def _release_held(self) -> None:
        """Send the calls held back, in order, as far as the leases' room and the
        scheduler's window allow now; the rest wait for the next answer or grant."""
        with self._lock:
            for fid in list(self._held_back):
                queue = self._held_back[fid]
                while queue:
                    submit = queue[0]
                    inv = submit.invocation_id
                    if inv in self._held_ids:  # else cancelled meanwhile
                        if not self._send_now(submit):
                            break
                        self._held_ids.discard(inv)
                    queue.popleft()
                if not queue:
                    del self._held_back[fid]

    def _take_over(self, grant: p.LeaseGrant, handed: bool = False) -> None:
        """Send the calls the scheduler handed to the lease to its worker (once its
        endpoint answered the probe); those past its depth are routed as new calls
        (another lease with room, else they wait here: see `Leases.hold_back`).
        `handed`: a lease of ours took them after the grant (no device did)."""
        ep = grant.endpoint
        if handed and grant.reclaimed:
            self.leases.handed(grant.function_id, time.monotonic())
        for inv in grant.reclaimed:
            pend = self._calls.get(inv)
            sub = pend.submit if pend is not None else None
            if sub is None:  # not ours any more (or an Attach): off the scheduler's count
                self.leases.left_head(inv)
                continue
            if self.leases.adopt(grant.lease_id, inv) is None:
                with self._lock:
                    if inv in self._calls:  # (not cancelled meanwhile)
                        self._route(sub)
                continue
            frames = p.encode(p.DirectRun(grant.lease_id, grant.secret, inv, sub.frames))
            if self.leases.reach.get(ep) is leasing.Reach.OK:
                self._direct_box.append((ep, frames))
            else:
                self._parked.setdefault(ep, []).append((inv, frames))

    def _dispatch_direct(self, msg: p.Message) -> None:
        """A worker's answer to a call under a lease."""
        if isinstance(msg, p.Result):
            self._to_settle.pop(msg.invocation_id, None)
            retry = msg.meta.retryable and not msg.ok
            held = self.leases.answered(msg.invocation_id, msg.ok, msg.meta.duration, retry)
            if self._held_back:  # its lease has room again
                self._release_held()
            if held is not None and retry and leasing.should_retry(msg, held.grant):
                self._lease_retry([msg.invocation_id], held.grant, raised=True)
                return
            self._dispatch(msg)
        elif isinstance(msg, p.LeaseRefused):
            # Only calls still waiting on that worker: one sent to the scheduler since (its
            # lease lost with the worker) would run twice (a late refusal: a new worker
            # on the old endpoint, which a reconnecting socket's queued DirectRun reached).
            ours = [inv for inv in msg.invocation_ids
                    if self.leases.in_flight(inv) or inv in self._to_settle]
            self.leases.refused(msg)
            for inv in ours:
                self._to_settle.pop(inv, None)
            self._lease_fallback(ours)
            if self._held_back:  # the lease is over: what waited for it moves on
                self._release_held()
        elif isinstance(msg, p.Output):
            self._dispatch(msg)

    def _lease_fallback(self, ids: list[str]) -> None:
        """These calls did not run under their lease: through the scheduler, as usual."""
        with self._lock:
            for inv in ids:
                pend = self._calls.get(inv)
                frames = pend.encoded() if pend is not None else None
                if frames is not None:
                    self._outbox.append(frames)

    def _lease_retry(self, ids: list[str], grant: p.LeaseGrant, raised: bool) -> None:
        """These calls used an attempt under `grant` (lost with its worker, or `raised`
        an exception they retry on): again through the scheduler, that attempt counted
        (lost: unless its worker's journal says it never started)."""
        with self._lock:
            for inv in ids:
                pend = self._calls.get(inv)
                if pend is None or pend.submit is None:
                    continue
                pend.submit = (leasing.retried(pend.submit, grant, raised) if raised
                               else leasing.lost(pend.submit, grant))
                pend.frames = None  # a resubmit after a restart carries the attempt too
                frames = pend.encoded()
                if frames is not None:
                    self._outbox.append(frames)

    def _lease_ended(self, msg: p.Result) -> None:
        """The scheduler ended a lease of ours. Lost with its worker: the calls in flight
        there are sent again through the scheduler if their function retries, else fail."""
        held = self.leases.ended(msg.invocation_id)
        if self._held_back:  # what waited for its room moves on
            self._release_held()
        if held is None:
            return
        if msg.ok:  # calls still unanswered: their answers are on the way, or their
            for inv in held.calls:  # worker died since (`_settle`)
                self._to_settle[inv] = held.grant
                self._settles[held.grant.endpoint] = (0, 0.0)
            return
        report = held.report()  # what ran there, for the scheduler's metering
        if report is not None:
            self._outbox.append(p.encode(report))
        if not held.calls:
            return
        self._lost(sorted(held.calls), held.grant)

    def _lost(self, ids: list[str], grant: p.LeaseGrant) -> None:
        """Calls under `grant` lost with its worker: the scheduler runs them again if they
        never started there or have retries left, else fails them."""
        self._lease_retry(ids, grant, raised=False)

    def _settle(self, direct: DirectSockets) -> None:
        """Probes of leased workers (`DirectSockets.settle`): behind calls unanswered when
        their lease ended (answered or silent, what is still unanswered was lost); and of
        workers in doubt since the scheduler forgot us (silent: their leases are over and
        the calls in flight there lost)."""
        now = time.monotonic()
        for probes in (self._settles, self._checks):
            for ep, (seq, sent) in list(probes.items()):
                if not seq:
                    # behind every call sent there: none may still wait here to go
                    if ep not in self._parked and all(e != ep for e, _ in self._direct_box):
                        probes[ep] = (direct.settle(ep), now)
                    continue
                state = direct.probe_state(ep, seq, sent, now)
                if state is Probe.WAITING:
                    continue
                del probes[ep]
                if probes is self._checks:
                    self.leases.suspect.discard(ep)
                    if state is Probe.ANSWERED:
                        continue
                    for held in self.leases.dead_worker(ep):
                        for inv in held.calls:
                            self._to_settle[inv] = held.grant
                    why = "its worker did not answer after the scheduler restarted"
                else:
                    why = "its worker did not answer after its lease ended"
                self._lost_at(ep, why)

    def _lost_at(self, endpoint: str, why: str) -> None:
        """The calls left to settle at `endpoint` were lost with its worker."""
        left = [(inv, g) for inv, g in self._to_settle.items() if g.endpoint == endpoint]
        by_lease: dict[str, tuple[p.LeaseGrant, list[str]]] = {}
        for inv, g in left:
            del self._to_settle[inv]
            by_lease.setdefault(g.lease_id, (g, []))[1].append(inv)
        for g, ids in by_lease.values():
            log.info("%d call(s) under lease %s at %s: %s; sent to the scheduler, which "
                     "runs them again if they never started there or retry", len(ids),
                     g.lease_id, endpoint, why)
            self._lost(sorted(ids), g)

    def _grace_over(self, silent: float) -> str:
        return (f"the scheduler at {self.address} has not answered for {silent:.0f}s, longer "
                f"than the grace for a restart ({self.head_grace:g}s, GPUFN_HEAD_GRACE); "
                "outstanding calls were failed. Start it again (gpufn serve) and call again")

    def _receive(self, sock: zmq.Socket[Any]) -> None:
        for msg in sockets.received(sock, log):
            if not isinstance(msg, p.Error):  # refusals are not signs of life
                self._last_heard = time.monotonic()
            self._dispatch(msg)

    def _dispatch(self, msg: p.Message) -> None:
        if isinstance(msg, p.Result) and leasing.is_lease(msg.invocation_id):
            self._lease_ended(msg)
        elif isinstance(msg, p.LeaseGrant):
            if self.leases.holds(msg.lease_id):  # more of our queued calls for it
                self._take_over(msg, handed=True)
            elif self.leases.granted(msg, time.monotonic()):
                self._take_over(msg)
                if self._held_back:
                    self._release_held()
            else:  # off: give it back, and what it took over goes through the scheduler
                self._outbox.append(p.encode(p.Cancel(msg.lease_id, "leases are off")))
                self._lease_fallback(msg.reclaimed)
        elif isinstance(msg, p.Item):
            items = self._streams.get(msg.invocation_id)
            if items is not None:
                items.put(msg)
        elif isinstance(msg, p.Result):
            if self.leases.in_flight(msg.invocation_id):  # a leased call the scheduler ended:
                self.leases.answered(msg.invocation_id, msg.ok)  # it ran past its timeout
                self._to_settle.pop(msg.invocation_id, None)  # (worker/lease_clock.py)
            if (self.leases.from_head(msg.invocation_id, time.monotonic(), msg.meta.duration,
                                      msg.meta.devices)
                    and self._held_back):
                self._release_held()
            with self._lock:
                pend = self._calls.pop(msg.invocation_id, None)
                self._streams.pop(msg.invocation_id, None)
            waiting = pend is not None and not pend.future.done()
            if self._shm_files or msg.meta.shm:
                self._release_shm(msg.invocation_id, msg.meta, taken=waiting)
            if pend is not None and not pend.future.done():
                pend.future.set_result(msg)
        elif isinstance(msg, p.Output):
            self._print_output(msg)
        elif isinstance(msg, p.Welcome):
            if not msg.ok:
                self._refused(msg)
            elif self._resubmit:
                self.info = msg.info  # the scheduler we now talk to (a restart tells)
                self._send_again()
        elif isinstance(msg, (p.StatusReply, p.QueryReply, p.AppReply)):
            fut = self._status.get(msg.request_id)
            if fut is None or fut.done():
                return
            if isinstance(msg, p.StatusReply):
                fut.set_result(msg.status)
            elif msg.ok:
                fut.set_result(msg.data)
            elif isinstance(msg, p.QueryReply):
                fut.set_exception(GpufnError(msg.error))
            else:
                fut.set_exception(from_wire(msg.error_kind, msg.message))
        elif isinstance(msg, p.Shutdown):
            if msg.final:
                self._fail_all(ConnectionLost(f"the scheduler stopped ({msg.reason}); "
                                              "outstanding calls were failed"))
            else:  # restarting: ZeroMQ reconnects, the next scheduler gets our calls
                log.warning("the scheduler %s; %d outstanding call(s) wait for the next one "
                            "up to %gs (GPUFN_HEAD_GRACE)", msg.reason, len(self._calls),
                            self.head_grace)
        elif isinstance(msg, p.Error):
            if Connection.needs_rehello(msg):
                # Forgotten (restart, long silence): announce again; a Hello unanswered
                # for a while went to a head that died before it answered: again.
                if not self._resubmit or time.monotonic() - self._rehello_at > HELLO_AGAIN_SECONDS:
                    if not self._resubmit:
                        log.warning("the scheduler forgot this client; reconnecting and "
                                    "sending %d outstanding call(s) again", len(self._calls))
                        for ep in self.leases.suspect_all():  # workers lost meanwhile?
                            self._checks.setdefault(ep, (0, 0.0))
                    self._resubmit = True
                    self._rehello_at = time.monotonic()
                    # Ahead of the outbox, which waits for the Welcome: a call sent between
                    # this Hello and its Welcome would reach the scheduler before the
                    # Register of its function (refused before the Hello) and fail.
                    if self._conn is not None:
                        # The scheduler holds our calls briefly so that workers can say
                        # which of them they ran (see scheduler/calls/recovery.py).
                        self._conn.info.resubmit = len(self._calls)
                        self._conn.info.instance = self.info.instance
                        self._front.append(self._conn.hello_frames())
                        self._conn.info.resubmit = 0
                        self._wake()
            else:
                log.warning("scheduler: %s", msg.message)

    def _refused(self, msg: p.Welcome) -> None:
        """Saying Hello again (the scheduler restarted, or forgot us) was refused: with a
        token that no longer holds, nothing outstanding can ever be answered, so it all
        fails now, with the scheduler's reason and the fix."""
        self._resubmit = False  # a later Hello (the next call) may be welcomed again
        with self._lock:
            n = len(self._calls)
        why = (f"the scheduler at {self.address} refused this client when it reconnected "
               f"({msg.message}); {n} outstanding call(s) failed")
        if msg.error_kind == kind_of(AuthenticationError):
            why += (". Was the scheduler restarted with a new token (`gpufn serve "
                    "--new-token`), or this token revoked or rotated (`gpufn token "
                    "revoke|rotate`)? Connect again with the current token")
        error = from_wire(msg.error_kind, why)
        log.warning("%s", error)
        self._fail_all(error)

    def _send_again(self) -> None:
        """Welcomed again after being forgotten: register every function, then submit what
        is outstanding (the scheduler dropped those calls with the connection, so none runs
        twice), then what waited in the outbox meanwhile, each once."""
        broken: list[_Pending] = []
        with self._lock:  # callers add a call to `_calls` and the outbox under it
            # A generator call that streamed values cannot resume on the next scheduler
            # (a run from the start would repeat them): it fails, the others go again.
            for inv, items in list(self._streams.items()):
                pend = self._calls.get(inv)
                if pend is not None and items.received:
                    broken.append(self._calls.pop(inv))
                    del self._streams[inv]
            held = []
            while self._outbox:
                held.append(self._outbox.popleft())
            self._held_back.clear()  # in `_calls`: sent again below
            self._held_ids.clear()
            # Every function this client registered, not only those of pending calls: a
            # call being submitted right now needs its function known when it arrives.
            self._registered = set(self._register_frames)
            again = list(self._register_frames.values())
            # Not a call in flight under a lease, nor one whose lease ended with it
            # unanswered (`_to_settle`: its worker answers it, or a probe says it was
            # lost): sent again here, it ran twice.
            again += [f for inv, c in self._calls.items()
                      if not self.leases.in_flight(inv) and inv not in self._to_settle
                      and (f := c.encoded()) is not None]
            again += list(self._status_frames.values())
            sent = {id(f) for f in again}
            self._front.extend(again)
            self._front.extend(f for f in held if id(f) not in sent)
            self._resubmit = False
        self._wake()
        for pend in broken:
            if not pend.future.done():
                pend.future.set_exception(WorkerLost(
                    f"the scheduler restarted while {pend.name} streamed values; a generator "
                    "call does not resume on the next scheduler. Call it again"))

    def _print_output(self, msg: p.Output, name: str | None = None) -> None:
        if not self._print_calls:
            return
        if name is None:
            pend = self._calls.get(msg.invocation_id)
            name = pend.name if pend else "?"
        prefix = f"[{name} {msg.invocation_id}] "  # the call's id, unique in the cluster
        text = msg.text[:-1] if msg.text.endswith("\n") else msg.text
        try:
            stream = sys.stderr if msg.stream == "stderr" else sys.stdout
            stream.write("".join(prefix + line + "\n" for line in text.split("\n")))
            stream.flush()
        except Exception:  # a closed pipe (script | head) must not break the client
            pass


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container without a passwd entry)
        return str(os.getuid())


# --------------------------------------------------------------------------- default client

