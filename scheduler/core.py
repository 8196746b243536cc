"""The scheduler's sans-I/O core: `handle(event, now) -> [Send]`.

It owns every decision and touches no socket, thread or clock: the process shell
(`server.py`) turns frames into events, passes in the deployment store, and executes the
returned sends. User payload frames pass through untouched. The core is composed of books
it asks questions of: the ready queue, the model book, the gang formations, the intake
checks and a placement pass whose decisions the core applies; every invocation move goes
through `Transitions`. Each message type has one handler: the core's own, or one its desks
(apps, operations, streams) contribute for their own messages, merged once below. A step
a desk owns in a core handler is called explicitly, in order, where it happens.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from typing import Any

from gpufn.exceptions import (
    AuthenticationError,
    Cancelled,
    ConnectionLost,
    GpufnError,
    HostOutOfMemory,
    Unschedulable,
    kind_of,
)
from gpufn.scheduler.books import batches
from gpufn.scheduler.books.gang_book import GangBook
from gpufn.scheduler.books.model_book import ModelBook
from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.books.users import UserStore, sees
from gpufn.scheduler.calls import wire_checks
from gpufn.scheduler.calls.adoption import Adoption
from gpufn.scheduler.calls.intake import Intake
from gpufn.scheduler.calls.recovery import STOPPED, Recovery, Report, Restored
from gpufn.scheduler.calls.timers import Timers
from gpufn.scheduler.calls.transitions import Transitions
from gpufn.scheduler.desks import report
from gpufn.scheduler.desks.app_book import AppBook
from gpufn.scheduler.desks.lease_desk import LeaseDesk, is_lease
from gpufn.scheduler.desks.lost_leases import Parked
from gpufn.scheduler.desks.ops import OpsDesk
from gpufn.scheduler.desks.streams import NO_CLIENT, StreamDesk
from gpufn.scheduler.desks.user_desk import UserDesk
from gpufn.scheduler.nouns.events import (
    Event,
    Received,
    RendezvousFailed,
    RendezvousReady,
    Send,
    Stalled,
    Tick,
    Unreachable,
)
from gpufn.scheduler.nouns.records import (
    Device,
    FunctionRecord,
    Invocation,
    Journal,
    may_have_started,
)
from gpufn.scheduler.nouns.settings import Counters, SchedulerConfig
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import InvState
from gpufn.scheduler.peers import handshake
from gpufn.scheduler.peers.membership import (
    AllBack,
    ClientGone,
    DevicesChanged,
    Membership,
    Reported,
    WorkerGone,
)
from gpufn.scheduler.peers.membership import Decision as MemberDecision
from gpufn.scheduler.placement.placement_pass import (
    Decision,
    Dispatch,
    NeedRendezvous,
    PlacementPass,
    Preempt,
    Unplaceable,
    WakeAt,
)
from gpufn.scheduler.stores.deployments import DeploymentStore
from gpufn.scheduler.stores.kept_results import DetachedCall, KeptResults
from gpufn.scheduler.stores.ops import OpsStore
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec

log = logging.getLogger("gpufn.scheduler")
FORGOTTEN = ("it was stopped while it ran because the scheduler lost its client (silent for "
             "over {:g}s, GPUFN_CLIENT_TIMEOUT, or its connection gone: a network partition?); "
             "raise that timeout above the longest outage to keep such calls running")

__all__ = [
    "Event",
    "Received",
    "RendezvousFailed",
    "RendezvousReady",
    "SchedulerConfig",
    "SchedulerCore",
    "Send",
    "Stalled",
    "Tick",
    "Unreachable",
]

class SchedulerCore:
    def __init__(self, config: SchedulerConfig | None = None,
                 deployments: DeploymentStore | None = None,
                 users: UserStore | None = None,
                 results: KeptResults | None = None,
                 ops_store: OpsStore | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.wall_offset = 0.0  # wall clock minus the `now` the shell passes (`start`)
        self.functions: dict[str, FunctionRecord] = {}
        self.invocations: dict[str, Invocation] = {}
        self.queue = ReadyQueue(self.config.aging_seconds)
        self.counters = Counters()
        self.gangs = GangBook()
        self.models = ModelBook(self.gangs)
        self.policy = self.config.policy()
        self.instance = secrets.token_hex(8)  # tells a client whether it was forgotten or we restarted
        self.recovery = Recovery(self.config.restart_grace_seconds, self.instance)
        self._out: list[Send] = []
        self.members = Membership(self.config, self.counters, self.recovery, self.policy, self._out)
        self.peers, self.devices = self.members.peers, self.members.devices
        self.worker_device, self.hosts = self.members.worker_device, self.members.hosts
        self.intake = Intake(self.config, self.devices, self.queue, self.models)
        self.placement = PlacementPass(self.config, self.devices, self.queue, self.models)
        ops_store = ops_store or OpsStore(":memory:")
        self.needs_rendezvous = False
        self._started = False
        self._wakeup_at: float | None = None
        self.tx = Transitions(self.config, self.devices, self.queue, self.invocations, self.peers,
                              self.counters, self.gangs, self.models, self._out)
        self._seq = 0
        self.timers = Timers(self.config, self.tx, self.devices, self.counters)
        self.adoption = Adoption(self.recovery, self.tx, self.devices, self.invocations, self._out)
        self.apps = AppBook(self, deployments or DeploymentStore(":memory:"))
        self.ops = OpsDesk(self, ops_store)  # logs, usage and drain
        self.leases = LeaseDesk(self, self.ops)  # repeat calls straight to a worker
        self.streams = StreamDesk(self, results,  # streamed values, from_id callers, kept results
                                  ops_store.durable)
        self.tx.observers += [self.ops, self.streams]  # usage first, then attached callers
        self.users = UserDesk(self, UserStore() if users is None else users,  # tokens, limits
                              self._drop_peer)
        self.placement.caps = self.users.caps
        own: dict[type, Any] = {
            p.Hello: self._on_hello, p.Ping: self._on_ping, p.Goodbye: self._on_goodbye,
            p.Register: self._on_register, p.Submit: self._on_submit, p.Cancel: self._on_cancel,
            p.StatusRequest: self._on_status, p.Result: self._on_worker_result,
            p.Output: self._on_output, p.Heartbeat: self._on_heartbeat,
            p.WorkerExited: self._on_worker_exited, p.ModelEvent: self._on_model_event,
        }
        self._handlers = handshake.merge_handlers(
            own, self.apps.handlers(), self.ops.handlers(), self.streams.handlers(),
            self.users.handlers(), self.leases.handlers())

    # ------------------------------------------------------------------ entry points

    def start(self, restored: Restored, now: float) -> list[Send]:
        """Once, before the first event: what the stores said of the time before this
        scheduler (`Restored.read`). The spawned calls of deployed functions the previous
        scheduler noted (nobody may resubmit them) are admitted again on their version, as
        if resubmitted: they wait for the hold; a worker's report of them is taken over."""
        if self._started:
            raise RuntimeError("SchedulerCore.start is called once, before the first event")
        self._started = True
        self.wall_offset = restored.wall_offset
        self.tx.now = now
        self.tx.tokens = max(self.tx.tokens, restored.first_token)
        self.recovery.start(restored.expected_devices, now)
        self.streams.adopt(restored.detached)
        for call in restored.detached:
            self._readmit(call, now)
        if restored.detached:
            log.info("%d spawned call(s) whose spawner may be gone admitted again",
                     len(restored.detached))
        return self._flush(now)

    def handle(self, event: Event, now: float) -> list[Send]:
        return self.handle_many((event,), now)

    def handle_many(self, events: Iterable[Event], now: float) -> list[Send]:
        """Apply events in order, then run one scheduling pass; return the sends."""
        if not self._started:
            raise RuntimeError("SchedulerCore.start(restored, now) must be called first")
        self.tx.now = now
        for ev in events:
            try:
                self._on_event(ev, now)
            except Exception as e:  # one bad message must not take the scheduler down
                log.exception("failed to handle %s", type(getattr(ev, "msg", ev)).__name__)
                if isinstance(ev, Received):
                    why = f"the scheduler could not handle {type(ev.msg).__name__}: {e}"
                    if isinstance(ev.msg, p.Submit):  # that call fails; it never hangs
                        self._fail_submit(ev.peer, ev.msg.invocation_id, why, now)
                    else:
                        self.send(ev.peer, p.Error(kind_of(GpufnError), why))
        return self._flush(now)

    def _flush(self, now: float) -> list[Send]:
        """One scheduling pass if anything changed; then the sends, handed over."""
        if self.tx.dirty:
            self.tx.dirty = False
            try:
                self._schedule(now)
            except Exception:  # a placement bug must not take the scheduler down
                log.exception("scheduling pass failed")
        out = list(self._out)
        self._out.clear()
        return out

    def _fail_submit(self, peer: bytes, invocation_id: str, why: str, now: float) -> None:
        inv = self.invocations.get(invocation_id)
        if inv is None:
            self.send(peer, p.Result(invocation_id, False, kind_of(GpufnError), why))
        elif inv.state is InvState.QUEUED:
            self.tx.finish(inv, now, InvState.FAILED, GpufnError(why))

    @property
    def rendezvous_port(self) -> int | None:
        return self.tx.rendezvous_port

    def next_wakeup(self) -> float | None:
        """When the scheduler wants a pass although nothing arrives (a batch's wait ends)."""
        return self._wakeup_at

    def status(self, now: float) -> dict[str, Any]:
        return report.report(self, now)

    def _on_event(self, ev: Event, now: float) -> None:
        if isinstance(ev, Received):
            self._on_message(ev.peer, ev.msg, now)
        elif isinstance(ev, Tick):
            self._on_tick(now)
        elif isinstance(ev, Unreachable):
            self._on_unreachable(ev.peer, now)
        elif isinstance(ev, RendezvousReady):
            self.tx.rendezvous_port = ev.port
            self.tx.dirty = True
        elif isinstance(ev, RendezvousFailed):
            self._rendezvous_failed(ev.error, now)
        elif isinstance(ev, Stalled):
            self.members.stalled(ev.seconds)

    # ------------------------------------------------------------------ the desks' surface

    def send(self, peer: bytes, msg: p.Message) -> None:
        self._out.append(Send(peer, msg))


    def device_of(self, peer: bytes) -> Device | None:
        """The device whose worker (or its control channel) is `peer`."""
        return self.members.device_of(peer)


    def wall(self, now: float) -> float:
        """Wall-clock seconds for `now` (what a person reads: deploy times, usage)."""
        return now + self.wall_offset

    # ------------------------------------------------------------------ scheduling

    def _schedule(self, now: float) -> None:
        if self.recovery.suspects:  # the hold is over: before anything is placed
            self.adoption.decide_suspects(now)
        self.tx.sweep_shards(now)  # stale shards of sharded models leave first
        for decision in self.placement.run(now, self.tx.rendezvous_port):
            self._apply(decision, now)
        self.leases.revoke_if_waiting(now)  # a call waits: leases stop taking calls

    def _apply(self, decision: Decision, now: float) -> None:
        if isinstance(decision, Dispatch):
            inv = decision.inv
            if decision.batch:
                self._seq += 1
                self.counters.batches += 1
                inv = batches.form(self.queue, inv, self._seq, now)
            else:
                self.queue.pop(inv.function.function_id)
            self.tx.dispatch(inv, decision.devices, decision.plans, now)
        elif isinstance(decision, Preempt):
            self.tx.preempt(decision.victim, decision.beneficiary, now)
        elif isinstance(decision, Unplaceable):
            self.tx.finish(decision.inv, now, InvState.FAILED, Unschedulable(decision.reason))
        elif isinstance(decision, WakeAt):
            if self._wakeup_at is None or decision.when < self._wakeup_at:
                self._wakeup_at = decision.when  # the shell wakes the scheduler then
        elif isinstance(decision, NeedRendezvous):
            self.needs_rendezvous = True  # the shell starts the store, then schedules again

    # ------------------------------------------------------------------ transitions

    def _invalidate_feasibility(self) -> None:
        self.intake.invalidate()
        self.tx.dirty = True

    # ------------------------------------------------------------------ peers

    def _on_message(self, peer: bytes, msg: p.Message, now: float) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.send(peer, p.Error(kind_of(GpufnError), f"unexpected message {type(msg).__name__}"))
            return
        if not isinstance(msg, p.Hello):
            known = self.peers.get(peer)
            if known is None:
                self.counters.stale_results += isinstance(msg, p.Result)
                self.send(peer, p.Error(
                    kind_of(AuthenticationError),
                    "this connection has not said Hello (or the scheduler restarted); reconnect",
                ))
                return
            if known.role not in handshake.ROLES_ALLOWED[type(msg)]:
                self.send(peer, p.Error(kind_of(GpufnError),
                                         f"a {known.role} may not send {type(msg).__name__}"))
                return
            known.last_seen = now
            denied = self.users.denial(known, msg)  # an operation its token does not allow
            if denied is not None:
                self.send(peer, denied)
                return
        handler(peer, msg, now)

    def _on_hello(self, peer: bytes, msg: p.Hello, now: float) -> None:
        self._members(self.members.hello(peer, msg, self.users.identify(msg), now), now)

    def _members(self, decisions: Iterable[MemberDecision], now: float) -> None:
        """Apply what membership decided, each as it is yielded (a device is reset only
        after the calls it ran were dealt with)."""
        for dec in decisions:
            if isinstance(dec, WorkerGone):
                self._worker_gone(dec.device, now, dec.reason, dec.oom, dec.started)
            elif isinstance(dec, ClientGone):
                self._client_gone(dec.peer, now, dec.reason)
            elif isinstance(dec, Reported):
                self.adoption.recovered(dec.ids, dec.device, now)
            elif isinstance(dec, DevicesChanged):
                self._invalidate_feasibility()
            elif isinstance(dec, AllBack):
                self.queue.expedite(self.recovery.hold_until, now)

    def _on_ping(self, peer: bytes, msg: p.Ping, now: float) -> None:
        self.send(peer, p.Pong(msg.seq))

    def _on_goodbye(self, peer: bytes, msg: p.Goodbye, now: float) -> None:
        self._drop_peer(peer, now, msg.reason or "said goodbye")

    def _drop_peer(self, peer: bytes, now: float, reason: str) -> None:
        self._members(self.members.drop(peer, now, reason), now)

    def _on_unreachable(self, peer: bytes, now: float) -> None:
        self._members(self.members.unreachable(peer, now), now)

    def _rendezvous_failed(self, error: str, now: float) -> None:
        """Without the store no gang can form: fail queued gang calls, refuse new ones."""
        self.intake.rendezvous_error = error
        for inv in [i for i in self.invocations.values()
                    if i.state is InvState.QUEUED and Shape.of(i.spec) is Shape.GANG]:
            self.tx.finish(inv, now, InvState.FAILED,
                         Unschedulable(self.intake.no_rendezvous(inv.function.name)))

    def _client_gone(self, peer: bytes, now: float, reason: str) -> None:
        dropped, stopped = 0, []
        for inv in [i for i in self.invocations.values() if i.client == peer]:
            if self.streams.outlives(inv):
                continue  # spawned on a deployed function: it runs on, its Result is kept
            if inv.state is InvState.QUEUED:
                self.tx.finish(inv, now, InvState.CANCELLED, Cancelled("client left"))
                dropped += 1
            elif inv.state is InvState.RUNNING:
                self.tx.cancel_running(inv, now, "client left")
                stopped.append(inv.id)
        if reason in ("timed out", "unreachable"):  # maybe only cut off: it may send these again
            self.recovery.client_forgotten(stopped, now)
            why = (f"nothing heard for over {self.config.client_timeout:g}s (GPUFN_CLIENT_TIMEOUT)"
                   if reason == "timed out" else "its connection is gone")
            log.warning("forgot client %s: %s; %d queued call(s) dropped, %d running call(s) "
                        "stopped (if it comes back and sends them again, a stopped one counts "
                        "as an attempt)", peer.hex(), why, dropped, len(stopped))
        elif dropped or stopped:
            log.info("client %s %s: %d queued call(s) dropped, %d running call(s) stopped",
                     peer.hex(), reason, dropped, len(stopped))

    # ------------------------------------------------------------------ client calls

    def _on_register(self, peer: bytes, msg: p.Register, now: float) -> None:
        if msg.function_id in self.functions:
            return
        try:
            spec = wire_checks.register_spec(msg)
        except GpufnError as e:
            self.send(peer, p.Error(kind_of(e), f"function {msg.name}: {e}"))
            return
        ncode = len(msg.frames) - sum(int(m.get("nframes", 0)) for m in msg.models)
        fn = self.functions[msg.function_id] = FunctionRecord(
            msg.function_id, msg.code_id, msg.name, spec, tuple(msg.frames[:ncode]))
        fn.model_keys = self.models.register(list(msg.models), tuple(msg.frames[ncode:]))

    def _on_submit(self, peer: bytes, msg: p.Submit, now: float) -> None:
        if msg.prior_lease:
            decided = self.leases.resubmitted(peer, msg, now)  # did it start on the
            if decided is None:  # lost worker? (its journal, on its way)
                return
            msg = decided
        self._take_submit(peer, msg, now)

    def _admit_parked(self, parked: list[Parked], now: float) -> None:
        for w in parked:
            if w.peer in self.peers:  # (a client gone meanwhile took its calls along)
                self._take_submit(w.peer, w.msg, now)

    def _take_submit(self, peer: bytes, msg: p.Submit, now: float) -> None:
        if msg.invocation_id in self.invocations:  # a duplicate: never run twice, but a
            self.streams.resubmitted(peer, self.invocations[msg.invocation_id])  # caller again
            return
        if self.streams.answer_again(peer, msg.invocation_id):
            return  # it ended already: its kept Result, not a second run
        draining = self.ops.refusal(msg)  # 1. nothing is admitted while the scheduler drains
        if draining is not None:
            self.send(peer, draining)
            return
        fn = (self.functions.get(msg.function_id)
              or self.apps.resolve(msg.function_id, now, msg.invocation_id))
        if isinstance(fn, GpufnError):  # unknown (a restart?), or a deployed app that is not
            self.send(peer, p.Result(msg.invocation_id, False, kind_of(fn), str(fn)))
            return
        self.counters.submitted += 1
        try:
            spec = wire_checks.submit_spec(fn.spec, msg.options) if msg.options else fn.spec
        except GpufnError as e:
            self.send(peer, p.Result(msg.invocation_id, False, kind_of(e), str(e)))
            return
        limited = self.users.admit(self.peers[peer], spec, fn.name)  # the user's limits
        if isinstance(limited, GpufnError):
            self.counters.unschedulable += 1
            self.send(peer, p.Result(msg.invocation_id, False, kind_of(limited), str(limited)))
            return
        spec = limited
        refused = self.intake.refusal(fn, spec, bool(msg.options))
        if refused is not None:
            if isinstance(refused, Unschedulable):
                self.counters.unschedulable += 1
            else:
                self.counters.rejected += 1
            self.send(peer, p.Result(msg.invocation_id, False, kind_of(refused), str(refused)))
            return
        self._seq += 1
        inv = Invocation(msg.invocation_id, fn, peer, spec, tuple(msg.frames), now, self._seq)
        inv.user = self.peers[peer].user  # from its token, never the client's claim
        inv.shm = msg.shm
        inv.wants_lease = msg.lease
        not_before = self.recovery.not_before(peer, now)
        if msg.prior_attempts > 0:  # it used attempts under a lease: they count here
            not_before = max(not_before, self.tx.carry_attempts(
                inv, msg.prior_attempts, msg.prior_raised, msg.prior_device, now))
        self._admit(inv, msg.keep, not_before, now)
        if inv.counted_attempts > spec.retries and inv.state is InvState.QUEUED:
            self.tx.out_of_retries(inv, now, msg.prior_raised,
                                   self.leases.lost_calls.why(msg.prior_lease))

    def _admit(self, inv: Invocation, keep: bool, not_before: float, now: float) -> None:
        inv.history.append(("queued", now))
        self.timers.watch(inv, now)
        self.invocations[inv.id] = inv
        self.streams.admitted(inv, keep)  # 2. its Result kept for FunctionCall.from_id
        claim = self.recovery.claim(inv.id)  # 3. after a restart: a worker runs or ran it
        if isinstance(claim, Report) and self.adoption.adopt(inv, claim, now, queued=False):
            return
        inv.not_before = not_before
        self.queue.push(inv, now)
        if claim is STOPPED:
            self.tx.lost_before_restart(inv, now, FORGOTTEN.format(
                self.config.client_timeout), ConnectionLost)
        elif claim is not None:
            self.adoption.ran_before(inv, now)
        self.tx.dirty = True

    def _readmit(self, call: DetachedCall, now: float) -> None:
        """A spawned call the previous scheduler noted, admitted again (`start`)."""
        try:
            fn = self.apps.noted_function(call.function_id, call.invocation_id)
            spec = GpuSpec.from_wire(call.spec)
        except GpufnError as e:
            self.streams.unadmittable(call, e, now)
            return
        self._seq += 1
        inv = Invocation(call.invocation_id, fn, NO_CLIENT, spec, call.frames,
                         call.submitted - self.wall_offset, self._seq)
        inv.user = call.owner
        self.counters.submitted += 1
        hold = self.recovery.hold_until if self.recovery.holding(now) else 0.0
        try:
            self._admit(inv, True, hold, now)
        except Exception:  # one bad record must not keep the scheduler from starting
            log.exception("[%s] could not admit it again", inv.id)

    def _on_cancel(self, peer: bytes, msg: p.Cancel, now: float) -> None:
        inv = self.invocations.get(msg.invocation_id)
        cancelled = False
        # Its caller, or the same user (or an admin) from elsewhere (`FunctionCall.from_id`);
        # another user's call is answered exactly like an unknown one.
        if inv is not None and (inv.client == peer or sees(self.peers.get(peer), inv.user)):
            if inv.state is InvState.QUEUED:
                self.tx.finish(inv, now, InvState.CANCELLED, Cancelled(
                    f"{inv.function.name} call {inv.id} was cancelled before it started"))
                cancelled = True
            elif inv.state is InvState.RUNNING and msg.include_running:
                self.tx.cancel_running(inv, now, msg.reason or "cancelled by the caller")
                cancelled = True
        elif inv is None and self.leases.lost_calls.unpark(peer, msg.invocation_id):
            cancelled = True  # it waited for its lost worker's journal: never admitted
            self.send(peer, p.Result(msg.invocation_id, False, kind_of(Cancelled),
                                     f"call {msg.invocation_id} was cancelled"))
        elif inv is None and msg.include_running:
            self.leases.forward_cancel(peer, msg)  # its call under a lease, maybe running
        if msg.request_id:
            self.send(peer, p.QueryReply(msg.request_id, True, {"cancelled": cancelled}))

    def _on_status(self, peer: bytes, msg: p.StatusRequest, now: float) -> None:
        self.send(peer, p.StatusReply(msg.request_id,
                                      self.users.view(self.status(now), self.peers[peer])))

    # ------------------------------------------------------------------ worker reports

    def _on_worker_result(self, peer: bytes, msg: p.Result, now: float) -> None:
        d = self.device_of(peer)
        if is_lease(msg.invocation_id):
            self.leases.on_result(d, msg, now)
            return
        inv = d.running.get(msg.invocation_id) if d is not None else None
        if d is None or inv is None:
            self.counters.stale_results += 1
            if d is not None and self.recovery.reports:  # a reported call, not resubmitted yet
                self.recovery.result_arrived(msg.invocation_id, d.key, msg.meta.dispatch_token)
            return  # late result of a call already settled (timed out, retried elsewhere)
        self._heard(d, now)
        earlier = msg.meta.dispatch_token not in (0, inv.dispatch_token)
        running_here = inv.state is InvState.RUNNING and d.key in inv.devices
        if earlier or not running_here:
            self.counters.stale_results += 1
            if not (earlier and running_here):  # else a later dispatch holds this device
                self.tx.release_reporter(inv, d)  # a stopped process's last word
            return
        if inv.shape.multi_device:
            self._on_rank_result(inv, d, msg, now)
            return
        if self.models.should_replan(inv, msg):
            self.tx.release_device(inv, d)
            replanned = [m for m in inv.members if m.state is InvState.RUNNING] if inv.members else [inv]
            for m in replanned:  # a batch's calls are queued again on their own
                m.replans += 1
                self.tx.requeue(m, now, "a model it waited for was larger than declared")
            if inv.members:
                self.tx.finish(inv, now, InvState.FAILED, release=False)
            return
        d.completed += 1
        if msg.ok and msg.meta.duration is not None:
            inv.function.observe_runtime(msg.meta.duration, d.key)
        if inv.members:
            self.tx.finish_batch(inv, msg, now)
            return
        overran = self.timers.overran(inv, msg.meta.duration) if msg.ok else None
        if overran is not None:
            self.tx.finish(inv, now, InvState.FAILED, overran)
            return
        result = p.Result(inv.id, msg.ok, msg.error_kind, msg.message,
                          self.tx.meta(inv, now, msg.meta, owned=True), msg.frames)
        lease = self.leases.grant(inv, d, now) if msg.ok else None  # ahead of the Result
        self.tx.retry_or_fail(inv, now, result)  # a Retries(on=...) match queues it again
        if lease is not None:
            self.leases.start(lease, d, now)

    def _on_rank_result(self, inv: Invocation, d: Device, msg: p.Result, now: float) -> None:
        """One process of a multi-device call reported. A failure stops the others; the
        call settles once every rank has reported or been lost (or after a grace)."""
        rank = inv.devices.index(d.key)
        d.completed += 1
        self.tx.release_reporter(inv, d)
        inv.rank_results[rank] = msg
        if not msg.ok:
            self.tx.gang_failing(inv, now, f"rank {rank} of {inv.function.name} call {inv.id} failed")
        self.tx.settle(inv, now)

    def _on_output(self, peer: bytes, msg: p.Output, now: float) -> None:
        inv = self.invocations.get(msg.invocation_id)
        if inv is not None:
            self.ops.output(inv, msg, now)  # kept for `gpufn logs`
            if inv.client in self.peers:
                self.send(inv.client, msg)
            return
        d = self.device_of(peer)
        carrier = d.running.get(msg.invocation_id) if d is not None else None
        if carrier is None and d is not None:  # printed by a call under a lease on d
            carrier = next((i for i in d.running.values() if i.lease is not None), None)
            if carrier is not None:
                self.ops.output(carrier, msg, now)
                return
        if carrier is not None:  # printed by a batch: every caller in it sees it
            self.ops.output(carrier, msg, now)
            for m in carrier.members:
                if m.state is InvState.RUNNING and m.client in self.peers:
                    self.send(m.client, p.Output(m.id, msg.stream, msg.text))

    def _on_heartbeat(self, peer: bytes, msg: p.Heartbeat, now: float) -> None:
        d = self.members.device_of(peer)
        if d is not None:
            self._heard(d, now)

    def _heard(self, d: Device, now: float) -> None:
        silent = now - d.last_seen
        if silent > self.config.heartbeat_timeout / 2:  # a cut link or a stalled host
            log.warning("heard from %s again after %.1fs of silence (under the heartbeat "
                        "timeout of %gs: its worker and calls are kept)", d.key, silent,
                        self.config.heartbeat_timeout)
        d.last_seen = now

    def _on_model_event(self, peer: bytes, msg: p.ModelEvent, now: float) -> None:
        d = self.device_of(peer)
        if d is None:
            return
        if self.models.on_event(d, msg, now):
            self._invalidate_feasibility()  # feasibility used the old size
        self.tx.advance_starts(d, now)  # calls that waited for this model start their clocks
        self.tx.dirty = True

    def _on_worker_exited(self, peer: bytes, msg: p.WorkerExited, now: float) -> None:
        d = self.devices.get(msg.device)
        parked = self.leases.worker_exited(msg) if d is not None and d.supervisor == peer else []
        self._members(self.members.worker_exited(peer, msg, now), now)
        self._admit_parked(parked, now)

    def _worker_gone(self, d: Device, now: float, reason: str, oom: str,
                     journal: Journal | None = None) -> None:
        """The device's worker is gone: retry or fail what ran there. With `oom` (its
        supervisor's words) it was stopped over its host-memory limit: what ran there
        fails with HostOutOfMemory. `journal`: the calls the process started (its exit
        notice), else its calls' clocks say. Membership resets the device next."""
        # Read before anything is freed: freeing a call starts the clock of the next one
        # pipelined behind it, and a call that never started is queued again, no attempt
        # used (all of those behind a call past its timeout had failed WorkerLost).
        def began(i: Invocation) -> bool:
            if journal is None or i.members:  # (a batch's journal holds its members)
                return i.run_started is not None
            return may_have_started(journal, i.id)

        started = {i.id for i in d.running.values() if began(i)}
        for inv in list(d.running.values()):
            if inv.lease is not None and inv.state is InvState.RUNNING:
                self.leases.lost(inv, d, now, reason)
            elif inv.state is InvState.RUNNING and d.key in inv.devices and oom:
                self.tx.failed_with_worker(inv, d, now, HostOutOfMemory(
                    f"{inv.function.name} call {inv.id} on device {d.key}: {oom}"))
            elif inv.state is InvState.RUNNING and d.key in inv.devices:
                self.tx.lost_with_worker(inv, d, now,
                                         f"the worker for device {d.key} was lost ({reason})",
                                         inv.id in started)
            else:
                if inv.lease is not None:  # cancelled meanwhile (its client left)
                    self.leases.open.pop(inv.id, None)
                self.tx.release_device(inv, d)
        self.gangs.forget_device(d.key)
        self.tx.dirty = True

    def _on_tick(self, now: float) -> None:
        self._admit_parked(self.leases.tick(now), now)
        self.apps.tick(now)
        self.streams.tick(now)
        self.ops.tick(now)  # usage and logs to disk
        for inv_id, r in self.recovery.orphans(now):  # taken over by no caller: stopped
            d = self.devices.get(r.device)
            if d is not None and d.worker == r.worker:
                self.send(d.control or d.worker, p.Cancel(
                    inv_id, "no caller came back for it after the scheduler restarted", True,
                    r.dispatch_token))
        if self._wakeup_at is not None and now >= self._wakeup_at:
            self._wakeup_at = None
            self.tx.dirty = True
        for inv in [i for i in self.tx.failing if i.failing_since is not None
                    and now - i.failing_since > self.config.gang_settle_seconds]:
            self.tx.settle(inv, now, force=True)
        self.tx.failing = {i for i in self.tx.failing if i.state is InvState.RUNNING}
        self._members(self.members.silent_workers(now), now)
        for kill in self.timers.expired(now):
            self.kill_worker(kill.device, now, kill.reason)
        self._members(self.members.silent_clients(now), now)

    def kill_worker(self, d: Device, now: float, reason: str) -> None:
        """Have its supervisor kill the device's worker; what ran there is lost now."""
        self._members(self.members.kill(d, now, reason), now)
