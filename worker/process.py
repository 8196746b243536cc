"""The worker process shell: one per device, owning its CUDA context.

It feeds scheduler messages to the sans-I/O `WorkerCore` and carries out its actions
with what it owns: the executor, the model cache, the gang's process group and the
spmd=False device-set helper. Two sockets: the work socket (main thread) receives code
and calls and sends results; the control socket (its own thread) sends heartbeats and
receives cancels, so both keep flowing while user code runs. Calls the scheduler marks
`inline` (short, measured) run on the main thread itself, saving two thread hand-offs;
others run in executor threads.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

import zmq

from gpufn.exceptions import (
    AuthenticationError,
    Cancelled,
    ConnectionLost,
    GpufnError,
    ProtocolMismatch,
    Timeout,
    WorkerLost,
    kind_of,
)
from gpufn.net import processes, sockets
from gpufn.net.connection import Connection, ConnectionConfig, WakePipe
from gpufn.runtime import context as ctxmod
from gpufn.wire import config
from gpufn.wire import protocol as p
from gpufn.worker.core import (
    AbortGroup,
    Action,
    Emit,
    Evict,
    Execute,
    Exit,
    Grant,
    Interrupt,
    JoinGroup,
    ResendHeld,
    RunInHelper,
    StartLoad,
    WorkerCore,
    control_actions,
)
from gpufn.worker.executor import Call, Executor
from gpufn.worker.host.held import HeldResults, RunJournal
from gpufn.worker.host.memory_watch import Reports
from gpufn.worker.lease_clock import LeaseClock, within_timeout
from gpufn.worker.leases import Answer, Ended, LeaseAction, LeaseBook, Refuse, Start
from gpufn.worker.output import OutputRouter
from gpufn.worker.streaming import is_special

log = logging.getLogger("gpufn.worker")

HEARTBEAT_SECONDS = 1.0
OUTPUT_FLUSH_SECONDS = 0.05
HANDSHAKE_SECONDS = 60.0
HELLO_RETRY_SECONDS = 1.0  # a refused Hello again is said again after this
CANCEL_MEMORY_SECONDS = 300.0
LEASE_ROUND = 64  # calls under leases started in one round of the main loop, at most
# ... and for at most this long: then their answers leave (a round of 64 five-millisecond
# inline calls held every answer for 320 ms, and its client idled the worker meanwhile)
LEASE_ROUND_SECONDS = 0.002
# Answers to leased calls leave once this many wait, while the rest of a client's batch
# runs: its client refills the lease meanwhile instead of both sides taking turns (a
# batch of 64 no-ops answered at once left each worker of a .map idle half the time).
DIRECT_FLUSH_CALLS = 24
DIRECT_FLUSH_SECONDS = 0.002  # ... or once the first has waited this long
# While leases are open, the control thread looks at least this often for leased calls
# past their timeout (one may start with a timeout shorter than the heartbeat's wait).
TIMEOUT_LOOK_SECONDS = 0.25


def _torch_device(kind: str) -> Any:
    try:
        import torch
    except ImportError:
        return "cpu"
    if kind == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _bind_direct(ctx: zmq.Context[Any], address: str) -> tuple[zmq.Socket[Any], str]:
    """The socket clients holding a lease send calls to, on the address this host reaches
    the scheduler from (so whoever reaches the scheduler's network may reach it), CURVE
    encrypted off loopback with a key pair made for this process; its endpoint as
    `tcp://ip:port[?key=PUBLIC]` (the scheduler passes it on in a LeaseGrant)."""
    from gpufn.net import curve

    host = _local_ip_towards(_host_of(address))
    sock = ctx.socket(zmq.ROUTER)
    sockets.configure(sock, router=True)
    key = ""
    if curve.needs_curve(host):
        public, secret = zmq.curve_keypair()
        sock.curve_server = True
        sock.curve_secretkey = secret
        key = "?key=" + public.decode()
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}{key}"


def _local_ip_towards(host: str) -> str:
    """This host's address on the route to `host` (loopback for a local scheduler)."""
    import socket

    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _host_of(address: str) -> str:
    """The scheduler's host as this worker reaches it (where the gang store listens)."""
    host = config.address_host(address)
    return "127.0.0.1" if host in ("", "*", "0.0.0.0") else host


class WorkerProcess:
    def __init__(self, address: str, token: str, device_key: str, incarnation: int, kind: str,
                 memory: int = 0, memory_fd: int = -1, journal: str = "") -> None:
        self.address = address
        self.device_key = device_key
        self.incarnation = incarnation
        self.token = token
        self.router = OutputRouter()
        self.router.install()
        self.core = WorkerCore(device_key, _torch_device(kind), _host_of(address))
        self._done: deque[p.Message] = deque()
        self._wake = WakePipe()
        self._inline = False  # the main thread runs a call inline (see `_on_done`)
        self.executor = Executor(self.router, self._on_done, self._wake.wake)
        self._items = self.executor.driver.items  # streamed values, sent at each flush
        # What this worker declares to its supervisor's memory watch (worker/host/memory_watch.py).
        self.executor.reports = Reports(memory_fd)
        from gpufn.runtime.models import set_resolver
        from gpufn.worker.model_cache import ModelManager

        # Simulated devices enforce their configured size; real GPUs their real memory.
        capacity = memory if kind == "cpu" and memory > 0 else None
        self.models = ModelManager(self.core.device, capacity, self._on_done,
                                   self.executor.reports.models)
        set_resolver(self.models.resolve)
        self.groups: Any = None  # GroupManager, made on the first gang call (imports torch.distributed)
        self.helper: Any = None  # DeviceSetHelper of the last spmd=False call
        self.ctx = zmq.Context()
        self.identity = f"w/{device_key}/{incarnation}/{os.getpid()}"
        # Calls under a lease come straight from their clients (worker/leases.py).
        self.leases = LeaseBook()
        # ... and their timeouts, which the scheduler does not see (worker/lease_clock.py)
        self.clock = LeaseClock(config.env_float("GPUFN_STOP_GRACE_SECONDS", 10.0))
        self._specials: dict[str, bool] = {}  # code id -> generator or async (`_special`)
        self.direct, self.direct_endpoint = _bind_direct(self.ctx, address)
        self._direct_out: list[tuple[bytes, list[p.Message]]] = []
        self.conn = self._connection("work", self.identity)
        self.sock = self.conn.sock
        self._running = True
        self._outgoing: list[p.Message] = []
        # Received messages not handled yet (kept on self: an interrupt aimed at an inline
        # call that had just ended must not drop the rest of a batch).
        self._inbox: deque[p.Message] = deque()
        self._rehello = threading.Event()  # the control channel learned we were forgotten
        # A refused Hello again (a restarted scheduler that has not heard from our
        # supervisor yet): when to say it once more.
        self._hello_again_at: float | None = None
        # Results sent lately: after a scheduler restart they may never have reached their
        # callers, so the new scheduler is told (with what runs) which calls ran here and
        # can ask for the Results again (see scheduler/calls/recovery.py).
        self.held = HeldResults(config.held_result_bytes())
        # The calls started here, for the supervisor if this process dies meanwhile.
        self.journal: RunJournal | None = None
        if journal:
            try:
                self.journal = RunJournal(journal)
            except OSError as e:  # a full disk: work on, without it (and say so: no file)
                with contextlib.suppress(OSError):
                    os.unlink(journal)
                log.warning("no journal of the calls started (%s: %s): if this worker dies "
                            "while no scheduler is connected, its calls are not reported to "
                            "the next one. Free space in %s.", journal, e.strerror or e,
                            os.path.dirname(journal) or ".")

    # ------------------------------------------------------------------ main thread

    def _connection(self, channel: str, identity: str) -> Connection:
        direct = self.direct_endpoint if channel == "work" else ""
        return Connection(self.ctx, ConnectionConfig(self.address, self.token), identity,
                          p.Role.WORKER, p.HelloInfo(device=self.device_key,
                                                     incarnation=self.incarnation,
                                                     channel=channel, direct=direct))

    def handshake(self) -> None:
        """Say Hello until welcomed (work may follow the Welcome at once). A refusal
        because the device is not announced yet (a restarted scheduler that has not
        heard from our supervisor) is tried again; others end the process."""
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        while True:
            try:
                self._inbox.extend(self.conn.handshake(max(1.0, deadline - time.monotonic())))
                return
            except ConnectionLost as e:
                raise SystemExit(str(e)) from None
            except (AuthenticationError, ProtocolMismatch) as e:
                raise SystemExit(f"scheduler refused this worker: {e}") from None
            except GpufnError as e:
                if time.monotonic() > deadline:
                    raise SystemExit(f"scheduler refused this worker: {e}") from None
                time.sleep(0.2)

    def _on_done(self, msg: p.Message) -> None:
        """From executor and model threads: a finished call (Result) or a model event."""
        self._done.append(msg)
        if not self._inline:  # else the main thread drains `_done` as the inline call ends
            self._wake.wake()

    def _queue(self, msg: p.Message) -> None:
        self._outgoing.append(msg)

    def _flush(self) -> None:
        items = self._items.drain()
        if items:
            self._outgoing.extend(items)
        if self.router.pending():
            self._outgoing.extend(self.router.drain())
        if self._outgoing:
            msgs, self._outgoing = self._outgoing, []
            sockets.send(self.sock, p.encode_batch(msgs))
        self._flush_direct()

    def _flush_direct(self) -> None:
        """The answers to leased calls, one message per client."""
        if self._direct_out:
            out, self._direct_out = self._direct_out, []
            by_peer: dict[bytes, list[p.Message]] = {}  # one message per client: a batch
            for peer, msgs in out:
                by_peer.setdefault(peer, []).extend(msgs)
            for peer, batch in by_peer.items():
                try:
                    sockets.send(self.direct, [peer, *p.encode_batch(batch)], zmq.NOBLOCK)
                except zmq.Again:  # its client reads slowly: it waits for the next round
                    self._direct_out.append((peer, batch))
                except zmq.ZMQError as e:  # its client is gone
                    log.info("a leased call's answer could not reach its client: %s", e)

    def _act(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Execute):
                if self.journal is not None:
                    run = self.core.running.get(a.invocation_id)
                    for inv in (run.members if run is not None and run.members
                                else (a.invocation_id,)):
                        self.journal.started(inv)
                self._execute(a)
            elif isinstance(a, Emit) and isinstance(a.msg, p.Result) and self._leased(a.msg):
                continue
            elif isinstance(a, Emit):
                if isinstance(a.msg, p.Result):  # its values and output first, then the result
                    self._outgoing.extend(self._items.drain(a.msg.invocation_id))
                    output = self.router.drain(a.msg.invocation_id)
                    self._outgoing.extend(output)
                    run = a.run
                    if run is not None and run.adoptable:
                        self.held.add(a.msg, run.attempt, output)
                    elif run is not None:
                        self.held.ran(list(run.members) or [a.msg.invocation_id])
                self._queue(a.msg)
            elif isinstance(a, ResendHeld):
                self._resend(a)
            elif isinstance(a, StartLoad):
                self.models.load(a.model, a.spec, a.frames)
            elif isinstance(a, Evict):
                self.models.evict(a.model, a.offload)
            elif isinstance(a, (Interrupt, Grant, AbortGroup)):
                self._act_now(a)
            elif isinstance(a, Exit):
                log.info("worker %s exiting: %s", self.device_key, a.reason)
                self._running = False

    def _leased(self, result: p.Result) -> bool:
        """A call under a lease ended: its output and Result go straight to its client
        (the output to the scheduler too, for `gpufn logs`); the lease goes on."""
        timed = self.clock.ended(result.invocation_id)
        if timed is not None:
            result = within_timeout(result, timed, self.device_key)
        peer = self.leases.finished(result, result.meta.duration, time.monotonic())
        if peer is None:
            return False
        result.meta.devices, result.meta.attempts = [self.device_key], 1
        output = self.router.drain(result.invocation_id)
        self._outgoing.extend(output)
        self._direct_out.append((peer, [*output, result]))
        return True  # the next call of the lease starts in the main loop (no recursion)

    def _lease_act(self, actions: list[LeaseAction]) -> None:
        for a in actions:
            if isinstance(a, Refuse):
                self._direct_out.append((a.peer, [a.msg]))
            elif isinstance(a, Answer):
                self._direct_out.append((a.peer, [a.result]))
            elif isinstance(a, Ended):
                self._queue(a.result)
            elif isinstance(a, Start):
                run = a.run
                if run.meta.timeout is not None:  # timed here: the scheduler never sees it
                    self.clock.started(run.invocation_id, self.leases.calls[run.invocation_id][0],
                                       run.name, run.meta.timeout, time.monotonic(),
                                       run.dispatch_token)
                if not self._run_leased(run):
                    actions_ = self.core.handle(run)
                    self.core.running.pop(run.invocation_id, None)  # not the scheduler's call
                    self._act(actions_)

    def _run_leased(self, run: p.Run) -> bool:
        """A leased call that runs inline with nothing to set up first (no models, gang,
        helper, batch or generator), run here at once: the scheduler-shaped layers (the core's
        Execute, `_call`'s steps, the done queue) were ~10 of a leased no-op's ~70 us on
        the worker. False: it takes the general path."""
        meta, fn = run.meta, self.core.code.get(run.code_id)
        if (fn is None or not meta.inline or meta.gang is not None or meta.multi is not None
                or meta.batch is not None or meta.members or meta.models
                or self._special(run.code_id, fn)):
            return False
        inv, device = run.invocation_id, self.core.device
        if self.journal is not None:
            self.journal.started(inv)
        context = ctxmod.CallContext(inv, run.name, device=device, devices=[device],
                                     attempt=meta.attempt_number, app=meta.app,
                                     version=meta.version, priority=meta.priority)
        call = Call(inv, run.name, fn, run.frames, context, dispatch_token=run.dispatch_token,
                    retry_on=meta.retry_on, shm_owner=meta.shm_owner,
                    host_memory=meta.host_memory)
        self._inline = True
        try:
            self.executor.run_inline(call, self._leased_done)
        finally:
            self._inline = False
        self._drain_done()  # what other threads finished meanwhile
        return True

    def _special(self, code_id: str, fn: Callable[..., Any]) -> bool:
        """A generator or async function (never inline); by code id, which names its code."""
        special = self._specials.get(code_id)
        if special is None:
            special = self._specials[code_id] = is_special(fn)
        return special

    def _leased_done(self, result: p.Message) -> None:
        assert isinstance(result, p.Result)
        self.core.completed += 1
        if not self._leased(result):  # as the general path does: the scheduler hears of it
            self._act([Emit(result)])

    def _step_leases(self) -> None:
        """Start the leases' next calls; short (inline) ones end at once, so several run
        in one round and their answers leave together, one message per client. Then
        what the leases ran, to the scheduler when it is time."""
        try:
            self._start_leased()
        finally:
            self._outgoing.extend(self.leases.reports(time.monotonic()))

    def _start_leased(self) -> None:
        until = time.monotonic() + LEASE_ROUND_SECONDS
        for _ in range(LEASE_ROUND):
            now = time.monotonic()
            if now > until:
                return
            actions = self.leases.step(now) + self.leases.refuse_late(now)
            self._lease_act(actions)
            if not any(isinstance(a, Start) for a in actions):
                return
            self._drain_done()

    def _direct_receive(self) -> None:
        """DirectRuns (and probes) from clients holding a lease."""
        now = flushed = time.monotonic()
        ready = True  # the poll said so: the first read needs no asking
        while ready or sockets.waiting(self.direct):
            ready = False
            try:
                frames = sockets.recv(self.direct, zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) < 2:
                continue
            peer = frames[0].bytes
            try:
                msgs = p.decode_all(frames[1:])
            except p.DecodeError as e:
                log.warning("undecodable message from a leasing client: %s", e)
                continue
            for msg in msgs:
                if isinstance(msg, p.DirectRun):
                    self._lease_act(self.leases.offer(peer, msg, now))
                    if self._direct_out and (
                            len(self._direct_out) >= DIRECT_FLUSH_CALLS
                            or time.monotonic() - flushed >= DIRECT_FLUSH_SECONDS):
                        self._flush_direct()  # its client refills while the rest run
                        flushed = time.monotonic()
                elif isinstance(msg, p.Ping):
                    self._direct_out.append((peer, [p.Pong(msg.seq)]))
                elif isinstance(msg, p.Cancel):
                    actions, running = self.leases.cancel(peer, msg.invocation_id, msg.reason,
                                                          now)
                    self._lease_act(actions)
                    if running and msg.include_running:
                        self.executor.interrupt(msg.invocation_id)
            if self._direct_out:  # the end of a client's batch: its answers leave now, and
                self._flush_direct()  # the loop's bookkeeping runs while its client reads
                flushed = time.monotonic()

    def _act_now(self, a: Interrupt | Grant | AbortGroup) -> None:
        """From either thread: the executor and the group manager are thread-safe, and an
        interrupt or abort must land while the main thread runs user code, so the control
        thread carries these out itself instead of queueing them for the main thread."""
        if isinstance(a, Interrupt):
            if self.leases.revoke(a.invocation_id, "revoked by the scheduler",
                                  when_idle=not a.include_running):
                self._wake.wake()  # the main thread refuses what waits and ends it
                return
            self.executor.interrupt(a.invocation_id, a.dispatch_token)  # or refused when it starts
        elif isinstance(a, Grant):
            self.executor.grant(a.invocation_id, a.dispatch_token, a.allowed)
        elif self.groups is not None:  # blocked collectives end now
            self.groups.abort(a.reason, gang_id=a.gang_id, generation=a.generation)

    def _execute(self, a: Execute) -> None:
        if self.executor.take_cancelled(a.invocation_id, a.dispatch_token):
            self._act(self.core.done(p.Result(
                a.invocation_id, False, kind_of(Cancelled),
                "cancelled before it started", p.ResultMeta(dispatch_token=a.dispatch_token))))
            return
        call = self._call(a)
        if a.inline:
            if self._outgoing:  # the Results of the calls before it, first: held while
                self._flush()  # a long one ran, the scheduler blamed the first of them
            self._inline = True
            try:
                self.executor.run_inline(call)
            finally:
                self._inline = False  # before the drain: a thread's later Result wakes us
            self._drain_done()
        else:
            self.executor.submit(call)

    def _call(self, a: Execute) -> Call:
        """The executor's call for `a`: in its thread its models are made resident, then
        its steps run (a gang rank joins its group), then the function."""
        meta, context = a.meta, a.context(self.core.device)
        extra: dict[str, Any] = {}  # the call's meta, filled by a step while it runs
        then: Callable[[], None] | None = None
        on_error: Callable[[BaseException], None] | None = None
        finish: Callable[[Any], Any] | None = None
        relay = None
        for step in a.steps:
            if isinstance(step, JoinGroup):
                then, on_error = self._gang_rank(step, context, extra)
                finish = step.finish
            else:
                relay = self._helper_relay(step, a)
        manager, needed = self.models, dict(meta.models or {})

        def prepare() -> None:  # in the call's thread: models, the group, then shards
            manager.prepare(needed, then, context)

        return Call(a.invocation_id, a.name, a.fn, a.frames, context, meta=extra,
                    prepare=prepare, finish=finish, on_error=on_error,
                    dispatch_token=a.dispatch_token, batch=meta.batch, models=needed,
                    retry_on=meta.retry_on, relay=relay, shm_owner=meta.shm_owner,
                    host_memory=meta.host_memory)

    def _gang_rank(self, step: JoinGroup, context: ctxmod.CallContext, extra: dict[str, Any],
                   ) -> tuple[Callable[[], None], Callable[[BaseException], None]]:
        """A gang rank's join (after its models) and its abort when it raises."""
        if self.groups is None:
            from gpufn.worker.groups import GroupManager

            self.groups = GroupManager()
        groups, gang, device = self.groups, step.gang, self.core.device

        def join() -> None:
            context.group = groups.ensure(gang, device)
            extra["group_inits"] = groups.inits
            extra["group_init_s"] = groups.last_init_s

        def on_error(exc: BaseException) -> None:
            groups.abort(f"rank {gang.rank} raised {type(exc).__name__}",
                         gang_id=gang.gang_id, generation=gang.generation)

        return join, on_error

    def _helper_relay(self, step: RunInHelper, a: Execute,
                      ) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
        """Where a device-set call's frames go: the helper that sees its devices (the warm
        one if it serves this set, else a new one)."""
        from gpufn.worker.device_set.helper import DeviceSetHelper

        keys = tuple(d["key"] for d in step.devices)
        if self.helper is not None and (self.helper.keys != keys or not self.helper.alive()):
            self.helper.close()
            self.helper = None
        if self.helper is None:
            self.helper = DeviceSetHelper(step.devices)
        helper, code_id, code = self.helper, step.code_id, step.code_frames
        attempt = a.meta.attempt_number

        def run_there(frames: tuple[Any, ...]) -> tuple[Any, ...]:
            return helper.run(a.invocation_id, a.name, code_id, code, frames, attempt)

        return run_there

    def _prepare_rehello(self) -> None:
        """The scheduler restarted: put into the next Hello what runs here (the new
        scheduler takes those calls over), the Results held (it asks for those its
        callers still wait for), the calls that ran (they count as run) and the resident
        models (they stay). Calls it cannot take over are stopped."""
        self.leases.revoke_all("the scheduler restarted")  # the next one holds no slot for them
        running, ran, stop = self.core.restart_report()
        for inv in stop:
            self.executor.interrupt(inv)
        if self.groups is not None:  # the gang store went with the old scheduler
            self.groups.abort("the scheduler restarted")
        held, gone = self.held.report()
        info = self.conn.info
        info.running, info.held, info.ran = running, held, gone + ran
        info.models = self.models.keep_for_restart()

    def _resend(self, a: ResendHeld) -> None:
        result = self.held.get(a.invocation_id)
        if result is not None and result.meta.dispatch_token == a.dispatch_token:
            self._outgoing.extend(self.held.output(a.invocation_id))
            self._queue(result)
            return
        # Let go of meanwhile: the run counts as an attempt lost (retried if it may be).
        self._queue(p.Result(a.invocation_id, False, kind_of(WorkerLost), (
            f"worker {self.device_key} ran call {a.invocation_id} but no longer holds its "
            "result"), p.ResultMeta(dispatch_token=a.dispatch_token, retryable=True)))

    def _drain_done(self) -> None:
        while self._done:
            msg = self._done.popleft()
            if isinstance(msg, p.Result):
                self._act(self.core.done(msg))
            else:
                self._queue(msg)

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        wake_fd = self._wake.fileno()
        poller.register(wake_fd, zmq.POLLIN)
        poller.register(self.direct, zmq.POLLIN)
        while self._running:
            try:
                again = self._hello_again_at is not None and time.monotonic() >= self._hello_again_at
                if self._rehello.is_set() or again:  # scheduler restarted: announce the work socket
                    self._rehello.clear()
                    self._hello_again_at = None
                    self._prepare_rehello()
                    self.conn.hello()
                if self._inbox:
                    self._receive()
                    self._flush()
                wait = OUTPUT_FLUSH_SECONDS if self.router.pending() else HEARTBEAT_SECONDS
                ends = self.leases.next_deadline()
                if ends is not None:
                    wait = min(wait, max(0.0, ends - time.monotonic()) + 0.001)
                if self.leases.startable():
                    wait = 0.0
                ready = dict(poller.poll(math.ceil(wait * 1000)))
                if ready.get(wake_fd):
                    self._wake.drain()
                self._drain_done()
                if ready.get(self.sock):
                    self._receive()
                if ready.get(self.direct):
                    self._direct_receive()
                if self.leases.leases or self.leases.early:
                    self._step_leases()
                self._flush()
            except Cancelled:
                continue  # an interrupt aimed at a call that had just ended

    def _receive(self) -> None:
        while self._running:
            if not self._inbox:
                try:
                    frames = sockets.recv(self.sock, zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    self._inbox.extend(p.decode_all(frames))
                except p.DecodeError as e:
                    log.warning("undecodable message from the scheduler: %s", e)
                    continue
            while self._inbox and self._running:
                msg = self._inbox.popleft()
                if isinstance(msg, p.Error):
                    if self.conn.wants_hello(msg):
                        log.warning("scheduler: %s", msg.message)
                        self._prepare_rehello()
                        self.conn.hello()
                    elif not self.conn.needs_rehello(msg):
                        log.warning("scheduler: %s", msg.message)
                    continue
                if isinstance(msg, p.Welcome):
                    self.conn.welcomed()
                    if not msg.ok:
                        self._refused_again(msg)
                        continue
                if isinstance(msg, p.Run) and msg.meta.lease is not None:
                    self.leases.open(msg, time.monotonic())  # calls come straight to us now
                    self._lease_act(self.leases.opened(msg.invocation_id, time.monotonic()))
                    continue
                try:
                    self._act(self.core.handle(msg))
                except Cancelled:
                    raise
                except Exception as e:  # a bad message must not take the worker down
                    log.exception("failed to handle %s", type(msg).__name__)
                    self._act(self.core.failed(msg, e))

    def _refused_again(self, msg: p.Welcome) -> None:
        """Our Hello to a restarted scheduler was refused. A wrong token or version ends
        the process (as at start); otherwise its supervisor has not registered again yet
        (or this generation was replaced: the supervisor then stops us): say Hello again
        in a second, keeping what runs and what is held for the scheduler to take over."""
        if msg.error_kind in (kind_of(AuthenticationError), kind_of(ProtocolMismatch)):
            raise SystemExit(f"scheduler refused this worker: {msg.message}")
        log.info("scheduler refused this worker's Hello (%s); saying it again in %gs",
                 msg.message, HELLO_RETRY_SECONDS)
        self._hello_again_at = time.monotonic() + HELLO_RETRY_SECONDS

    # ------------------------------------------------------------------ control thread

    def start_control(self) -> threading.Thread:
        t = threading.Thread(target=self._control_loop, name="gpufn-control", daemon=True)
        t.start()
        return t

    def _control_loop(self) -> None:
        conn = self._connection("control", self.identity + "/ctl")
        sock = conn.sock
        try:
            early = conn.handshake_or_exit(HANDSHAKE_SECONDS, "worker")
        except SystemExit as e:
            log.error("control channel: %s", e)
            os._exit(3)
        for msg in early:
            self._control(conn, msg)
        next_beat = 0.0
        while True:
            now = time.monotonic()
            self._enforce_timeouts(sock, now)
            if now >= next_beat:
                groups = self.groups
                sock.send_multipart(p.encode(p.Heartbeat(
                    self.executor.running(),
                    {"completed": self.core.completed,  # an int read, not a call into the core
                     "group_inits": groups.inits if groups is not None else 0})))
                next_beat = now + HEARTBEAT_SECONDS
                self.executor.forget_cancels(CANCEL_MEMORY_SECONDS)
            wake = next_beat
            due = self.clock.next_at()
            if due is not None:
                wake = min(wake, due)
            if self.leases.leases:  # a leased call with a timeout may start meanwhile
                wake = min(wake, now + TIMEOUT_LOOK_SECONDS)
            if not sock.poll(math.ceil(max(0.0, wake - now) * 1000)):
                continue
            while True:
                try:
                    msgs = p.decode_all(sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                for msg in msgs:
                    self._control(conn, msg)

    def _enforce_timeouts(self, sock: zmq.Socket[Any], now: float) -> None:
        """(Control thread.) Leased calls past their timeout are interrupted; one that
        has not stopped a grace later is reported to the scheduler, which fails it with
        Timeout at its client and restarts this worker."""
        due, stuck = self.clock.due(now)
        for c in stuck:
            log.error("call %s of %s ran longer than its timeout of %gs and did not stop "
                      "within %gs of being interrupted; asking the scheduler to restart "
                      "this worker", c.invocation_id, c.name, c.timeout, self.clock.grace)
            sock.send_multipart(p.encode(p.LeaseOverrun(
                c.lease_id, c.invocation_id, str(self.clock.stuck(c, self.device_key)),
                now - c.started)))
        for c in due:
            landed = self.executor.interrupt(c.invocation_id, c.dispatch_token, exc=Timeout)
            self.clock.interrupted(c, landed, now)
            if landed:
                log.warning("call %s of %s ran past its timeout of %gs: interrupted",
                            c.invocation_id, c.name, c.timeout)

    def _control(self, conn: Connection, msg: p.Message) -> None:
        if isinstance(msg, (p.Cancel, p.Credit, p.GroupOp)):
            for a in control_actions(msg):
                assert isinstance(a, (Interrupt, Grant, AbortGroup))
                self._act_now(a)
        elif isinstance(msg, p.Shutdown):
            self.exit_now(0)
        elif isinstance(msg, p.Welcome):
            conn.welcomed()
        elif conn.on_error(msg):
            self._rehello.set()  # the main thread announces the work socket again
            self._wake.wake()

    def close(self) -> None:
        self.direct.close(0)
        self.conn.close()

    def exit_now(self, code: int = 0) -> NoReturn:
        """End this process now: executor threads may still run user code and nobody
        waits for them; the spmd=False helper is stopped as what it is, not left for the
        supervisor to find as a call's leftover."""
        helper = self.helper
        if helper is not None:
            from gpufn.worker.device_set.helper import stop_tracker

            try:
                helper.close(force=True)
                stop_tracker()
            except Exception:
                pass
        os._exit(code)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m gpufn.worker")
    ap.add_argument("--address", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--incarnation", type=int, default=1)
    ap.add_argument("--kind", default="cpu")
    ap.add_argument("--memory", type=int, default=0, help="device bytes (simulated devices)")
    ap.add_argument("--memory-fd", type=int, default=-1,
                    help="a pipe to the supervisor's host-memory watch")
    ap.add_argument("--journal", default="", help="file where the calls started are noted")
    a = ap.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s gpufn-worker[{a.device}] %(levelname)s %(message)s"))
    glog = logging.getLogger("gpufn")
    glog.addHandler(handler)
    glog.setLevel(config.log_level())
    glog.propagate = False
    token = config.token() or ""
    worker = WorkerProcess(a.address, token, a.device, a.incarnation, a.kind, a.memory,
                           a.memory_fd, a.journal)
    signal.signal(signal.SIGTERM, lambda *_: worker.exit_now(0))
    # Exit if our supervisor dies without taking us along (e.g. started by hand).
    processes.watch_parent(os.getppid(), lambda: worker.exit_now(0))
    worker.handshake()
    worker.start_control()
    try:
        worker.serve()
    finally:
        worker.close()
    worker.exit_now(0)
