"""The scheduler's sans-I/O core: `handle(event, now) -> [Send]`.

It owns every decision (queues, placement, timeouts, retries, device health) and
touches no socket, thread or clock: the process shell (`server.py`) turns frames into
events and executes the returned sends. User payload frames pass through untouched.
"""

from __future__ import annotations

import heapq
import hmac
import logging
from dataclasses import dataclass
from typing import Any

from gpufn import protocol as p
from gpufn.exceptions import (
    AuthenticationError,
    Cancelled,
    GpufnError,
    ProtocolMismatch,
    QueueFull,
    Timeout,
    Unschedulable,
    WorkerLost,
    kind_of,
)
from gpufn.memory_pool.eviction import EvictionPolicy, policy_by_name
from gpufn.memory_pool.ledger import DeviceLedger, HostLedger
from gpufn.memory_pool.probe import DeviceInfo
from gpufn.scheduler.batching import Batching
from gpufn.scheduler.gangs import GangBook
from gpufn.scheduler.models import ModelPlacement, ModelRecord
from gpufn.scheduler.placement import feasibility_error
from gpufn.scheduler.queues import ReadyQueue
from gpufn.scheduler.records import Device, FunctionRecord, Invocation, Peer
from gpufn.scheduler.scheduling import SchedulingPass
from gpufn.scheduler.states import DeviceState, InvState
from gpufn.spec import GpuSpec, make_spec, parse_memory

log = logging.getLogger("gpufn.scheduler")


# --------------------------------------------------------------------------- events & commands


@dataclass(frozen=True, slots=True)
class Received:
    peer: bytes
    msg: p.Message


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class Unreachable:
    """The shell could not deliver to this peer: it is gone."""

    peer: bytes


@dataclass(frozen=True, slots=True)
class RendezvousReady:
    """The shell's gang rendezvous store listens on this port."""

    port: int


@dataclass(frozen=True, slots=True)
class RendezvousFailed:
    """The shell could not start the gang rendezvous store."""

    error: str


Event = Received | Tick | Unreachable | RendezvousReady | RendezvousFailed


@dataclass(frozen=True, slots=True)
class Send:
    peer: bytes
    msg: p.Message


@dataclass
class SchedulerConfig:
    token: str | None = None
    slots_per_device: int = 8
    aging_seconds: float = 30.0
    heartbeat_timeout: float = 30.0
    client_timeout: float = 120.0
    max_queue: int = 1_000_000
    max_queue_per_function: int | None = None
    # A call told to stop (cancelled, or another rank of its gang failed) that has not
    # returned after this long has its worker killed and restarted.
    stop_grace_seconds: float = 10.0
    # After a gang rank fails, wait this long at most for the others to report, so the
    # root cause (a dead rank, or a non-communication error) is what the caller sees.
    gang_settle_seconds: float = 3.0
    # Calls measured shorter than this run inline on the worker's main thread, and up
    # to `pipeline_depth` more of them may wait at a worker (hiding the round trip).
    short_call_seconds: float = 0.005
    pipeline_depth: int = 2
    # The memory pool: eviction policy ("cost" or "lru-count") and its options, and the
    # host memory per node that offloaded models may use (0: half the node's RAM).
    eviction_policy: str = "cost"
    eviction_options: dict[str, Any] | None = None
    host_offload_bytes: int = 0

    def policy(self) -> EvictionPolicy:
        return policy_by_name(self.eviction_policy, **(self.eviction_options or {}))

    @classmethod
    def from_env(cls, token: str | None) -> SchedulerConfig:
        """Defaults overridden by GPUFN_SLOTS, GPUFN_AGING_SECONDS, GPUFN_HEARTBEAT_TIMEOUT,
        GPUFN_CLIENT_TIMEOUT, GPUFN_MAX_QUEUE, GPUFN_MAX_QUEUE_PER_FUNCTION,
        GPUFN_STOP_GRACE_SECONDS, GPUFN_GANG_SETTLE_SECONDS, GPUFN_PIPELINE_DEPTH,
        GPUFN_EVICTION_POLICY (+ GPUFN_LRU_MAX_MODELS), GPUFN_HOST_OFFLOAD_MEMORY."""
        from gpufn import config as c

        per_fn = c.env_int("GPUFN_MAX_QUEUE_PER_FUNCTION", 0)
        policy = c.env_str("GPUFN_EVICTION_POLICY", "cost") or "cost"
        options: dict[str, Any] = {}
        if policy == "lru-count":
            options["max_models"] = c.env_int("GPUFN_LRU_MAX_MODELS", 3)
        host = c.env_str("GPUFN_HOST_OFFLOAD_MEMORY")
        return cls(
            token=token,
            slots_per_device=c.env_int("GPUFN_SLOTS", cls.slots_per_device),
            aging_seconds=c.env_float("GPUFN_AGING_SECONDS", cls.aging_seconds),
            heartbeat_timeout=c.env_float("GPUFN_HEARTBEAT_TIMEOUT", cls.heartbeat_timeout),
            client_timeout=c.env_float("GPUFN_CLIENT_TIMEOUT", cls.client_timeout),
            max_queue=c.env_int("GPUFN_MAX_QUEUE", cls.max_queue),
            max_queue_per_function=per_fn or None,
            stop_grace_seconds=c.env_float("GPUFN_STOP_GRACE_SECONDS", cls.stop_grace_seconds),
            gang_settle_seconds=c.env_float("GPUFN_GANG_SETTLE_SECONDS", cls.gang_settle_seconds),
            pipeline_depth=c.env_int("GPUFN_PIPELINE_DEPTH", cls.pipeline_depth),
            eviction_policy=policy,
            eviction_options=options,
            host_offload_bytes=parse_memory(host, "GPUFN_HOST_OFFLOAD_MEMORY") if host else 0,
        )


@dataclass
class Counters:
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    retried: int = 0
    timeouts: int = 0
    lost: int = 0
    unschedulable: int = 0
    restarts: int = 0
    rejected: int = 0
    preempted: int = 0
    batches: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


# --------------------------------------------------------------------------- core


class SchedulerCore(SchedulingPass, ModelPlacement, Batching):
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.peers: dict[bytes, Peer] = {}
        self.devices: dict[str, Device] = {}
        self.worker_device: dict[bytes, str] = {}
        self.functions: dict[str, FunctionRecord] = {}
        self.invocations: dict[str, Invocation] = {}
        self.queue = ReadyQueue(self.config.aging_seconds)
        self.counters = Counters()
        self.gangs = GangBook()
        self.models: dict[str, ModelRecord] = {}
        self._replan: set[str] = set()
        self.hosts: dict[str, HostLedger] = {}
        self.policy = self.config.policy()
        self.rendezvous_port: int | None = None
        self.rendezvous_error = ""
        self.needs_rendezvous = False
        self._now = 0.0
        self._wakeup_at: float | None = None
        self._deadlines: list[tuple[float, int, Invocation]] = []
        self._failing: set[Invocation] = set()
        self._feasible: dict[str, str | None] = {}
        self._out: list[Send] = []
        self._dirty = False
        self._seq = 0
        self._tokens = 0  # dispatch tokens (see Invocation.token)
        self._handlers: dict[type, Any] = {
            p.Hello: self._on_hello,
            p.Ping: self._on_ping,
            p.Goodbye: self._on_goodbye,
            p.Register: self._on_register,
            p.Submit: self._on_submit,
            p.Cancel: self._on_cancel,
            p.StatusRequest: self._on_status,
            p.Result: self._on_worker_result,
            p.Output: self._on_output,
            p.Heartbeat: self._on_heartbeat,
            p.WorkerExited: self._on_worker_exited,
            p.ModelEvent: self._on_model_event,
        }
        self._roles_allowed: dict[type, frozenset[str]] = {
            p.Register: frozenset({p.Role.CLIENT}),
            p.Submit: frozenset({p.Role.CLIENT}),
            p.Cancel: frozenset({p.Role.CLIENT}),
            p.Result: frozenset({p.Role.WORKER}),
            p.Output: frozenset({p.Role.WORKER}),
            p.Heartbeat: frozenset({p.Role.WORKER}),
            p.ModelEvent: frozenset({p.Role.WORKER}),
            p.WorkerExited: frozenset({p.Role.SUPERVISOR}),
        }

    # ------------------------------------------------------------------ entry points

    def handle(self, event: Event, now: float) -> list[Send]:
        return self.handle_many((event,), now)

    def handle_many(self, events: Any, now: float) -> list[Send]:
        """Apply events in order, then run one scheduling pass; return the sends."""
        self._now = now
        for ev in events:
            try:
                self._on_event(ev, now)
            except Exception as e:  # one bad message must not take the scheduler down
                log.exception("failed to handle %s", type(getattr(ev, "msg", ev)).__name__)
                if isinstance(ev, Received):
                    self._send(ev.peer, p.Error("GpufnError", f"the scheduler could not handle "
                                                f"{type(ev.msg).__name__}: {e}"))
        if self._dirty:
            self._dirty = False
            try:
                self._schedule(now)
            except Exception:  # a placement bug must not take the scheduler down
                log.exception("scheduling pass failed")
        out, self._out = self._out, []
        return out

    def _on_event(self, ev: Event, now: float) -> None:
        if isinstance(ev, Received):
            self._on_message(ev.peer, ev.msg, now)
        elif isinstance(ev, Tick):
            self._on_tick(now)
        elif isinstance(ev, Unreachable):
            self._on_unreachable(ev.peer, now)
        elif isinstance(ev, RendezvousReady):
            self.rendezvous_port = ev.port
            self._dirty = True
        elif isinstance(ev, RendezvousFailed):
            self._rendezvous_failed(ev.error, now)

    # ------------------------------------------------------------------ helpers

    def _send(self, peer: bytes, msg: p.Message) -> None:
        self._out.append(Send(peer, msg))

    def _finish(
        self, inv: Invocation, now: float, state: InvState, error: GpufnError | None = None,
        result: p.Result | None = None, release: bool = True,
    ) -> None:
        """Move an invocation to a terminal state and tell its client (exactly once).

        With release=False the call keeps its hold on its devices until the worker
        reports that it stopped (a cancelled call still occupies its worker)."""
        inv.to(state, now)
        if release:
            self._release(inv)
        self.invocations.pop(inv.id, None)
        if inv.members:  # a batch carrier: its calls get the outcome, not a client
            if state is not InvState.SUCCEEDED:
                for m in inv.members:
                    if m.state is InvState.RUNNING:
                        res = (p.Result(m.id, False, result.error_kind, result.message,
                                        self._meta(m, now, result.meta), result.frames)
                               if result is not None else None)
                        self._finish(m, now, state, error, res, release=False)
            return
        if state is InvState.SUCCEEDED:
            self.counters.succeeded += 1
        elif state is InvState.CANCELLED:
            self.counters.cancelled += 1
        else:
            self.counters.failed += 1
        if result is None:
            assert error is not None
            result = p.Result(inv.id, False, kind_of(error), str(error), self._meta(inv, now))
        if inv.client in self.peers:
            self._send(inv.client, result)

    def _meta(self, inv: Invocation, now: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "devices": list(inv.devices),
            "attempts": inv.attempts,
            "queued_s": ((inv.started or now) - inv.submitted),
            "cold_start": inv.cold or (inv.carrier.cold if inv.carrier else "") or False,
        }
        if extra:
            meta.update(extra)
        return meta

    def _release(self, inv: Invocation) -> None:
        """Free what a running invocation holds on its devices."""
        for key in inv.devices:
            d = self.devices.get(key)
            if d is not None:
                self._release_device(inv, d)

    def _release_device(self, inv: Invocation, d: Device) -> None:
        d.stopping.pop(inv.id, None)
        if d.running.pop(inv.id, None) is None:
            return
        self._advance_starts(d, self._now)  # a pipelined call behind it starts now
        code = inv.function.code_id  # with_options() variants share one concurrency limit
        d.running_by_fn[code] -= 1
        if d.running_by_fn[code] <= 0:
            del d.running_by_fn[code]
        d.ledger.release(inv.id, self._now)
        self._dirty = True

    def next_wakeup(self) -> float | None:
        """When the scheduler wants a pass although nothing arrives (a batch's wait ends)."""
        return self._wakeup_at

    def _control_peer(self, key: str) -> bytes | None:
        d = self.devices.get(key)
        return (d.control or d.worker) if d is not None else None

    def _stop_ranks(self, inv: Invocation, reason: str, skip: str | None = None) -> None:
        """Interrupt every rank still holding a device (a gang also tears its group down)."""
        gang = inv.gang
        if gang is not None:
            self.gangs.broken(inv.devices)
        # spmd=False runs one process, on the first device; the others are only held.
        keys = inv.devices if inv.spec.spmd or len(inv.devices) == 1 else inv.devices[:1]
        for key in keys:
            d = self.devices.get(key)
            target = self._control_peer(key)
            if key == skip or d is None or inv.id not in d.running or target is None:
                continue
            d.stopping.setdefault(inv.id, self._now)
            self._send(target, p.Cancel(inv.id, reason, True, inv.token))
            if gang is not None:
                self._send(target, p.GroupOp(p.GroupOpKind.ABORT, {"gang_id": gang[0], "generation": gang[1],
                                                       "reason": reason}))

    def _invalidate_feasibility(self) -> None:
        self._feasible.clear()
        self._dirty = True

    # ------------------------------------------------------------------ messages

    def _on_message(self, peer: bytes, msg: p.Message, now: float) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._send(peer, p.Error("GpufnError", f"unexpected message {type(msg).__name__}"))
            return
        if not isinstance(msg, p.Hello):
            known = self.peers.get(peer)
            if known is None:
                self._send(peer, p.Error(
                    kind_of(AuthenticationError),
                    "this connection has not said Hello (or the scheduler restarted); reconnect",
                ))
                return
            allowed = self._roles_allowed.get(type(msg))
            if allowed is not None and known.role not in allowed:
                self._send(peer, p.Error("GpufnError", f"a {known.role} may not send {type(msg).__name__}"))
                return
            known.last_seen = now
        handler(peer, msg, now)

    def _on_hello(self, peer: bytes, msg: p.Hello, now: float) -> None:
        if not (isinstance(msg.role, str) and isinstance(msg.token, str)
                and isinstance(msg.info, dict) and isinstance(msg.pid, int)):
            self._send(peer, p.Welcome(False, kind_of(ProtocolMismatch),
                                       "malformed Hello: role/token must be strings, info a map"))
            return
        if msg.version != p.PROTOCOL_VERSION:
            self._send(peer, p.Welcome(False, kind_of(ProtocolMismatch), (
                f"peer speaks gpufn protocol {msg.version}, this scheduler speaks "
                f"{p.PROTOCOL_VERSION}; install the same gpufn version everywhere")))
            return
        want = self.config.token
        if want and not hmac.compare_digest(want.encode(), (msg.token or "").encode()):
            self._send(peer, p.Welcome(False, kind_of(AuthenticationError), (
                "wrong or missing token: set GPUFN_TOKEN (or connect(token=...)) to the token "
                "the scheduler was started with")))
            return
        if msg.role == p.Role.CLIENT:
            self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now)
            self._send(peer, p.Welcome(True, info=self._cluster_info()))
        elif msg.role == p.Role.SUPERVISOR:
            self._hello_supervisor(peer, msg, now)
        elif msg.role == p.Role.WORKER:
            self._hello_worker(peer, msg, now)
        else:
            self._send(peer, p.Welcome(False, "GpufnError", f"unknown role {msg.role!r}"))

    def _cluster_info(self) -> dict[str, Any]:
        return {"protocol": p.PROTOCOL_VERSION, "devices": len(self.devices),
                "client_timeout": self.config.client_timeout}

    def _hello_supervisor(self, peer: bytes, msg: p.Hello, now: float) -> None:
        infos = [DeviceInfo.from_wire(d) for d in msg.info.get("devices", [])]
        self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now)
        for info in infos:
            d = self.devices.get(info.key)
            if d is not None and d.state is not DeviceState.GONE and d.supervisor != peer:
                old = self.peers.get(d.supervisor)
                if old is not None:
                    log.warning("device %s re-announced by a new supervisor; replacing", info.key)
            if d is not None:
                self._lose_worker(d, now, "its supervisor re-registered", restart=False)
                d.info, d.supervisor = info, peer
                d.ledger = self._ledger(info, msg.info)
                if d.state is not DeviceState.STARTING:
                    d.to(DeviceState.STARTING, now)
            else:
                d = Device(info=info, supervisor=peer, ledger=self._ledger(info, msg.info))
                d.history.append(("starting", now))
                self.devices[info.key] = d
        self._invalidate_feasibility()
        self._send(peer, p.Welcome(True, info=self._cluster_info()))
        log.info("supervisor %s registered %d device(s)", msg.info.get("node"), len(infos))

    def _ledger(self, info: DeviceInfo, node_info: dict[str, Any]) -> DeviceLedger:
        """A device's ledger, sharing its node's host-memory budget for offloaded models."""
        host = self.hosts.get(info.node)
        if host is None:
            budget = self.config.host_offload_bytes or int(node_info.get("host_memory", 0)) // 2
            host = self.hosts[info.node] = HostLedger(budget or 16 * 2**30)
        return DeviceLedger(info.memory_total, host=host, key=info.key, policy=self.policy)

    def _hello_worker(self, peer: bytes, msg: p.Hello, now: float) -> None:
        key = msg.info.get("device", "")
        d = self.devices.get(key)
        if d is None or d.state is DeviceState.GONE:
            self._send(peer, p.Welcome(False, "GpufnError", (
                f"device {key!r} was not announced by a supervisor; start workers with "
                "`gpufn serve` or `gpufn worker`, not by hand")))
            return
        if msg.info.get("channel") == "control":
            if d.control is not None and d.control != peer:
                self.peers.pop(d.control, None)
                self.worker_device.pop(d.control, None)
            self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now)
            self.worker_device[peer] = key
            d.control = peer
            d.last_seen = now
            self._send(peer, p.Welcome(True, info=self._cluster_info()))
            return
        if d.worker is not None and d.worker != peer:
            self._lose_worker(d, now, "a new worker process registered for the device")
        self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now)
        self.worker_device[peer] = key
        d.worker, d.worker_pid = peer, msg.pid
        d.incarnation = int(msg.info.get("incarnation", d.incarnation + 1))
        d.last_seen = now
        d.code.clear()
        d.ledger.reset()
        if d.state is not DeviceState.READY:
            d.to(DeviceState.READY, now)
        d.last_error = ""
        self._invalidate_feasibility()
        self._send(peer, p.Welcome(True, info=self._cluster_info()))
        log.info("worker for %s ready (pid %d)", key, msg.pid)

    def _on_ping(self, peer: bytes, msg: p.Ping, now: float) -> None:
        self._send(peer, p.Pong(msg.seq))

    def _on_goodbye(self, peer: bytes, msg: p.Goodbye, now: float) -> None:
        self._drop_peer(peer, now, msg.reason or "said goodbye")

    def _on_unreachable(self, peer: bytes, now: float) -> None:
        info = self.peers.get(peer)
        if info is None:
            return
        if info.role == p.Role.WORKER:  # it may still be running calls that get retried
            key = self.worker_device.get(peer)
            d = self.devices.get(key) if key else None
            if d is not None and d.supervisor in self.peers:
                self._send(d.supervisor, p.KillWorker(d.key, d.worker_pid, "unreachable"))
        self._drop_peer(peer, now, "unreachable")

    def _rendezvous_failed(self, error: str, now: float) -> None:
        """Without the store no gang can form: fail queued gang calls, refuse new ones."""
        self.rendezvous_error = error
        for inv in [i for i in self.invocations.values()
                    if i.state is InvState.QUEUED and i.spec.count > 1 and i.spec.spmd]:
            self.queue.discard(inv)
            self._finish(inv, now, InvState.FAILED, Unschedulable(self._no_rendezvous(inv)))

    def _no_rendezvous(self, inv: Invocation) -> str:
        return (f"{inv.function.name} needs a process group, but the scheduler could not start "
                f"its rendezvous store ({self.rendezvous_error}). Check that torch is installed "
                "where the scheduler runs, then restart it")

    def _drop_peer(self, peer: bytes, now: float, reason: str) -> None:
        info = self.peers.pop(peer, None)
        if info is None:
            return
        if info.role == p.Role.CLIENT:
            for inv in [i for i in self.invocations.values() if i.client == peer]:
                if inv.state is InvState.QUEUED:
                    self.queue.discard(inv)
                    self._finish(inv, now, InvState.CANCELLED, Cancelled("client left"))
                elif inv.state is InvState.RUNNING:
                    self._cancel_running(inv, now, "client left")
        elif info.role == p.Role.WORKER:
            key = self.worker_device.pop(peer, None)
            d = self.devices.get(key) if key else None
            if d is not None and peer in (d.worker, d.control):
                self._lose_worker(d, now, f"worker {reason}")
        elif info.role == p.Role.SUPERVISOR:
            for d in self.devices.values():
                if d.supervisor == peer and d.state is not DeviceState.GONE:
                    self._lose_worker(d, now, f"its supervisor {reason}", restart=False)
                    d.to(DeviceState.GONE, now)
            self._invalidate_feasibility()

    # ------------------------------------------------------------------ client calls

    def _on_register(self, peer: bytes, msg: p.Register, now: float) -> None:
        if msg.function_id in self.functions:
            return
        try:
            spec = make_spec(GpuSpec.from_wire(msg.spec))
        except GpufnError as e:
            self._send(peer, p.Error(kind_of(e), f"function {msg.name}: {e}"))
            return
        ncode = len(msg.frames) - sum(int(m.get("nframes", 0)) for m in msg.models)
        fn = self.functions[msg.function_id] = FunctionRecord(
            msg.function_id, msg.code_id, msg.name, spec, tuple(msg.frames[:ncode]))
        fn.model_keys = self._register_models(list(msg.models), tuple(msg.frames[ncode:]))

    def _spec_for(self, fn: FunctionRecord, options: dict[str, Any]) -> GpuSpec:
        if not options:
            return fn.spec
        return make_spec(fn.spec, **options)

    def _on_submit(self, peer: bytes, msg: p.Submit, now: float) -> None:
        if msg.invocation_id in self.invocations:
            return  # a duplicate submit is ignored, never run twice
        fn = self.functions.get(msg.function_id)
        if fn is None:
            self._send(peer, p.Result(msg.invocation_id, False, "GpufnError", (
                "the scheduler does not know this function (it may have restarted); "
                "reconnect with gpufn.connect() and call again"), {}))
            return
        self.counters.submitted += 1
        try:
            spec = self._spec_for(fn, msg.options)
        except GpufnError as e:
            self._send(peer, p.Result(msg.invocation_id, False, kind_of(e), str(e), {}))
            return
        err = self._feasibility(fn, spec, bool(msg.options))
        if err is None and self.rendezvous_error and spec.count > 1 and spec.spmd:
            err = f"{fn.name}: the gang rendezvous store could not start ({self.rendezvous_error})"
        if err is not None:
            self.counters.unschedulable += 1
            self._send(peer, p.Result(msg.invocation_id, False, kind_of(Unschedulable), err, {}))
            return
        full = self._queue_full(fn)
        if full is not None:
            self.counters.rejected += 1
            self._send(peer, p.Result(msg.invocation_id, False, kind_of(QueueFull), full, {}))
            return
        self._seq += 1
        inv = Invocation(msg.invocation_id, fn, peer, spec, tuple(msg.frames), now, self._seq)
        inv.history.append(("queued", now))
        if spec.deadline is not None:
            inv.deadline = now + spec.deadline
            heapq.heappush(self._deadlines, (inv.deadline, inv.seq, inv))
        self.invocations[inv.id] = inv
        self.queue.push(inv)
        self._dirty = True

    def _queue_full(self, fn: FunctionRecord) -> str | None:
        cfg = self.config
        if len(self.queue) >= cfg.max_queue:
            return (f"the scheduler's queue holds {len(self.queue)} calls, its limit "
                    f"(GPUFN_MAX_QUEUE={cfg.max_queue}); {fn.name} was not accepted. Retry "
                    "later, slow down, or raise the limit")
        per_fn = cfg.max_queue_per_function
        depth = self.queue.depth(fn.function_id)
        if per_fn is not None and depth >= per_fn:
            return (f"{fn.name} already has {depth} queued calls, its limit "
                    f"(GPUFN_MAX_QUEUE_PER_FUNCTION={per_fn}); this call was not accepted. "
                    "Retry later, slow down, or raise the limit")
        return None

    def _feasibility(self, fn: FunctionRecord, spec: GpuSpec, per_call: bool) -> str | None:
        if per_call or fn.function_id not in self._feasible:
            err = (feasibility_error(spec, fn.name, self.devices.values(), self._model_bytes(fn))
                   or self._never_fits(fn, spec.memory))
            if per_call:
                return err
            self._feasible[fn.function_id] = err
        return self._feasible[fn.function_id]

    def _on_cancel(self, peer: bytes, msg: p.Cancel, now: float) -> None:
        inv = self.invocations.get(msg.invocation_id)
        if inv is None or inv.client != peer:
            return
        if inv.state is InvState.QUEUED:
            self.queue.discard(inv)
            self._finish(inv, now, InvState.CANCELLED, Cancelled(
                f"{inv.function.name} call {inv.id} was cancelled before it started"))
        elif inv.state is InvState.RUNNING and msg.include_running:
            self._cancel_running(inv, now, msg.reason or "cancelled by the caller")

    def _cancel_running(self, inv: Invocation, now: float, reason: str) -> None:
        """Tell the caller at once; the devices stay held until the worker stops the call."""
        self._stop_ranks(inv, reason)
        self._finish(inv, now, InvState.CANCELLED, Cancelled(
            f"{inv.function.name} call {inv.id} was cancelled while running ({reason})"),
            release=False)

    def _on_status(self, peer: bytes, msg: p.StatusRequest, now: float) -> None:
        self._send(peer, p.StatusReply(msg.request_id, self.status(now)))

    # ------------------------------------------------------------------ worker messages

    def _device_of(self, peer: bytes) -> Device | None:
        key = self.worker_device.get(peer)
        return self.devices.get(key) if key else None

    def _on_worker_result(self, peer: bytes, msg: p.Result, now: float) -> None:
        d = self._device_of(peer)
        inv = d.running.get(msg.invocation_id) if d is not None else None
        if d is None or inv is None:
            return  # late result of a call already settled (timed out, retried elsewhere)
        d.last_seen = now
        attempt = msg.meta.get("attempt")
        if (inv.state is not InvState.RUNNING or d.key not in inv.devices
                or (attempt is not None and attempt != inv.token)):
            self._release_device(inv, d)  # a stopped rank or an earlier attempt: free it
            if not inv.spec.spmd and inv.devices and d.key == inv.devices[0] and (
                    inv.state is not InvState.RUNNING):
                self._release(inv)  # its one process stopped: the held devices are free
            return
        if len(inv.devices) > 1:
            self._on_rank_result(inv, d, msg, now)
            return
        if self._should_replan(inv, msg):
            self._release_device(inv, d)
            if inv.members:  # a batch: its calls are queued again on their own
                inv.to(InvState.FAILED, now)
                for m in inv.members:
                    if m.state is InvState.RUNNING:
                        self._requeue(m, now)
                        m.replans += 1
            else:
                inv.replans += 1
                self._requeue(inv, now)
            return
        d.completed += 1
        duration = msg.meta.get("duration")
        if msg.ok and isinstance(duration, (int, float)):
            inv.function.observe_runtime(float(duration), d.key)
        if inv.members:
            self._on_carrier_result(inv, msg, now)
            return
        meta = self._meta(inv, now, msg.meta)
        result = p.Result(inv.id, msg.ok, msg.error_kind, msg.message, meta, msg.frames)
        self._finish(inv, now, InvState.SUCCEEDED if msg.ok else InvState.FAILED, result=result)

    def _on_rank_result(self, inv: Invocation, d: Device, msg: p.Result, now: float) -> None:
        """One rank of a multi-device call reported. A failure stops the other ranks;
        the call settles once every rank has reported or been lost (or after a grace)."""
        rank = inv.devices.index(d.key)
        d.completed += 1
        self._release_device(inv, d)
        if not inv.spec.spmd:  # one process ran it: the other devices were only held
            self._release(inv)
        inv.rank_results[rank] = msg
        if not msg.ok:
            self._gang_failing(inv, now, f"rank {rank} of {inv.function.name} call {inv.id} failed")
        self._settle_gang(inv, now)

    def _gang_failing(self, inv: Invocation, now: float, reason: str) -> None:
        if inv.failing_since is None:
            inv.failing_since = now
            self._failing.add(inv)
            self._stop_ranks(inv, reason)

    def _settle_gang(self, inv: Invocation, now: float, force: bool = False) -> None:
        """Finish a multi-device call once its ranks have all answered. The caller sees
        the root cause: a lost rank (WorkerLost, or a retry), else a rank whose error is
        not a consequence of a peer failing (a communication error), else the first."""
        if inv.state is not InvState.RUNNING:
            return
        answered = len(inv.rank_results) + len(inv.lost_ranks)
        if not inv.spec.spmd:  # only the process on the first device reports
            answered = int(0 in inv.rank_results or 0 in inv.lost_ranks)
        if inv.failing_since is None:
            if len(inv.rank_results) >= inv.reporters:
                self._gang_succeeded(inv, now)
            return
        if answered < inv.reporters and not force:
            return
        if inv.lost_ranks:
            rank, why = min(inv.lost_ranks.items())
            self._retry_or_fail_lost(inv, now, f"{why} (rank {rank})")
            return
        fails = [(r, m) for r, m in inv.rank_results.items() if not m.ok]
        root = [f for f in fails if not f[1].meta.get("comm_error")] or fails
        rank, msg = root[0]
        meta = self._meta(inv, now, {**msg.meta, "rank": rank})
        self._finish(inv, now, InvState.FAILED, result=p.Result(
            inv.id, False, msg.error_kind, msg.message, meta, msg.frames), release=False)

    def _gang_succeeded(self, inv: Invocation, now: float) -> None:
        first = inv.rank_results[0]
        duration = first.meta.get("duration")
        if isinstance(duration, (int, float)):
            inv.function.observe_runtime(float(duration), inv.devices[0])
        extra = dict(first.meta)
        frames = first.frames
        if inv.spec.gather:
            ordered = [inv.rank_results[r] for r in range(len(inv.devices))]
            extra["gather"] = [len(r.frames) for r in ordered]
            frames = tuple(f for r in ordered for f in r.frames)
        self._finish(inv, now, InvState.SUCCEEDED, result=p.Result(
            inv.id, True, "", "", self._meta(inv, now, extra), frames), release=False)

    def _on_carrier_result(self, carrier: Invocation, msg: p.Result, now: float) -> None:
        if not msg.ok:  # the batch as a whole failed: every member gets the error
            self._finish(carrier, now, InvState.FAILED, result=msg)
            return
        results = self._member_results(carrier, msg)
        self._finish(carrier, now, InvState.SUCCEEDED, result=msg)
        for m, res in zip(carrier.members, results, strict=False):
            if m.state is InvState.RUNNING:
                meta = self._meta(m, now, res.meta)
                self._finish(m, now, InvState.SUCCEEDED if res.ok else InvState.FAILED,
                             result=p.Result(m.id, res.ok, res.error_kind, res.message, meta,
                                             res.frames), release=False)

    def _fail_if_never_fits(self, inv: Invocation, now: float) -> bool:
        """A queued call whose models (at their learned sizes) fit on no device fails
        now with Unschedulable instead of waiting forever."""
        err = self._never_fits(inv.function, inv.spec.memory)
        if err is None:
            return False
        self.queue.discard(inv)
        self._finish(inv, now, InvState.FAILED, Unschedulable(err))
        return True

    def _requeue(self, inv: Invocation, now: float) -> None:
        inv.to(InvState.QUEUED, now)
        inv.devices, inv.started, inv.cold, inv.carrier = (), None, "", None
        inv.run_started = None
        self.queue.push(inv)

    def _preempt(self, victim: Invocation, d: Device, now: float, reason: str) -> None:
        """Stop a preemptible call and queue it again (its device stays held until its
        worker reports it stopped)."""
        self.counters.preempted += 1
        victim.preemptions += 1
        log.info("[%s] %s %s", victim.id, victim.function.name, reason)
        self._stop_ranks(victim, reason)
        self._requeue(victim, now)

    def _on_output(self, peer: bytes, msg: p.Output, now: float) -> None:
        inv = self.invocations.get(msg.invocation_id)
        if inv is not None:
            if inv.client in self.peers:
                self._send(inv.client, msg)
            return
        d = self._device_of(peer)
        carrier = d.running.get(msg.invocation_id) if d is not None else None
        if carrier is not None:  # printed by a batch: every caller in it sees it
            for m in carrier.members:
                if m.state is InvState.RUNNING and m.client in self.peers:
                    self._send(m.client, p.Output(m.id, msg.stream, msg.text))

    def _on_heartbeat(self, peer: bytes, msg: p.Heartbeat, now: float) -> None:
        d = self._device_of(peer)
        if d is not None:
            d.last_seen = now

    def _on_worker_exited(self, peer: bytes, msg: p.WorkerExited, now: float) -> None:
        d = self.devices.get(msg.device)
        if d is None or d.supervisor != peer:
            return
        d.last_error = msg.reason
        if msg.returncode == -999:  # the supervisor gave up restarting it
            self._lose_worker(d, now, f"worker cannot start: {msg.reason}", restart=False)
            if d.state is not DeviceState.FAILED:
                d.to(DeviceState.FAILED, now)
            self._invalidate_feasibility()
            return
        if d.worker_pid in (0, msg.pid) or d.state is not DeviceState.READY:
            self._lose_worker(d, now, f"worker process exited ({msg.reason})")

    # ------------------------------------------------------------------ failures

    def _lose_worker(self, d: Device, now: float, reason: str, restart: bool = True) -> None:
        """The device's worker is gone: retry or fail what ran there, reset the device."""
        for inv in list(d.running.values()):
            if inv.state is InvState.RUNNING and d.key in inv.devices:
                self._lost_invocation(inv, now, d,
                                      f"the worker for device {d.key} was lost ({reason})")
            else:
                self._release_device(inv, d)
        self.gangs.forget_device(d.key)
        for peer in (d.worker, d.control):
            if peer is not None:
                self.worker_device.pop(peer, None)
                self.peers.pop(peer, None)
        d.worker, d.control, d.worker_pid = None, None, 0
        d.running.clear()
        d.running_by_fn.clear()
        d.code.clear()
        d.ledger.reset(now)
        if restart and d.state in (DeviceState.READY, DeviceState.STARTING):
            d.to(DeviceState.RESTARTING, now)
            d.restarts += 1
            self.counters.restarts += 1
        self._dirty = True

    def _lost_invocation(self, inv: Invocation, now: float, d: Device, why: str) -> None:
        self.counters.lost += 1
        never_started = inv.run_started is None and not inv.members
        self._release_device(inv, d)
        if never_started and len(inv.devices) == 1:
            inv.unstarted_losses += 1  # it never ran: queue it again, no retry used
        if len(inv.devices) > 1:
            # Other ranks stop and keep their devices until they report; then it settles.
            rank = inv.devices.index(d.key)
            inv.lost_ranks[rank] = why
            if not inv.spec.spmd and rank == 0:
                self._release(inv)  # nothing runs any more: free the held devices
            self._gang_failing(inv, now, why)
            self._settle_gang(inv, now)
            return
        self._retry_or_fail_lost(inv, now, why)

    def _retry_or_fail_lost(self, inv: Invocation, now: float, why: str) -> None:
        if inv.members:  # a lost batch: each of its calls is retried or fails on its own
            inv.to(InvState.FAILED, now)
            for m in inv.members:
                if m.state is InvState.RUNNING:
                    m.carrier = None
                    if inv.run_started is None:
                        m.unstarted_losses += 1  # the batch never started: no retry used
                    self._retry_or_fail_lost(m, now, why)
            return
        if inv.attempts - inv.preemptions - inv.unstarted_losses <= inv.spec.retries:
            inv.rank_results, inv.lost_ranks, inv.failing_since = {}, {}, None
            inv.to(InvState.QUEUED, now)
            inv.devices = ()
            inv.started = None
            self.queue.push(inv)
            self.counters.retried += 1
            log.warning("[%s] %s: %s; queued again", inv.id, inv.function.name, why)
            return
        hint = "" if inv.spec.retries else " Set retries=N in @gpu to retry on another worker."
        self._finish(inv, now, InvState.FAILED, WorkerLost(
            f"{inv.function.name} call {inv.id}: {why} after {inv.attempts} attempt(s).{hint}"),
            release=False)

    def _on_tick(self, now: float) -> None:
        if self._wakeup_at is not None and now >= self._wakeup_at:
            self._wakeup_at = None
            self._dirty = True
        for inv in [i for i in self._failing if i.failing_since is not None
                    and now - i.failing_since > self.config.gang_settle_seconds]:
            self._settle_gang(inv, now, force=True)
        self._failing = {i for i in self._failing if i.state is InvState.RUNNING}
        for d in list(self.devices.values()):
            if d.state is DeviceState.READY and now - d.last_seen > self.config.heartbeat_timeout:
                self._kill_worker(d, now, f"no heartbeat for {now - d.last_seen:.0f}s")
                continue
            late = [i for i, t in d.stopping.items() if now - t > self.config.stop_grace_seconds]
            if late:
                self._kill_worker(d, now, f"call {late[0]} did not stop within "
                                          f"{self.config.stop_grace_seconds:g}s of being told to")
                continue
            for inv in list(d.running.values()):
                t = inv.spec.timeout
                if (inv.state is InvState.RUNNING and t is not None and inv.run_started is not None
                        and now - inv.run_started > t):
                    self.counters.timeouts += 1
                    members = [self.devices[k] for k in inv.devices if inv.id in self.devices[k].running]
                    if not inv.spec.spmd:  # one process ran on the first device; free the rest
                        for m in members[1:]:
                            self._release_device(inv, m)
                        members = members[:1]
                    where = ", ".join(m.key for m in members)
                    self._finish(inv, now, InvState.FAILED, Timeout(
                        f"{inv.function.name} call {inv.id} ran longer than its timeout of {t:g}s "
                        f"on {where}; its worker(s) were restarted. Raise timeout= if it needs "
                        "longer."), release=False)
                    for m in members:
                        self._kill_worker(m, now, f"call {inv.id} exceeded its {t:g}s timeout")
                    break
        # Deadlines: a heap, so a tick costs O(due), not O(queued).
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, inv = heapq.heappop(self._deadlines)
            if inv.state is not InvState.QUEUED or inv.deadline is None or now <= inv.deadline:
                continue  # started (or finished) in time
            self.queue.discard(inv)
            self._finish(inv, now, InvState.FAILED, Timeout(
                f"{inv.function.name} call {inv.id} could not start within its deadline of "
                f"{inv.spec.deadline:g}s; it was dropped, not run late"))
        for peer in [k for k, v in self.peers.items()
                     if v.role == p.Role.CLIENT and now - v.last_seen > self.config.client_timeout]:
            self._drop_peer(peer, now, "timed out")

    def _kill_worker(self, d: Device, now: float, reason: str) -> None:
        if d.supervisor in self.peers:
            self._send(d.supervisor, p.KillWorker(d.key, d.worker_pid, reason))
        log.warning("killing worker of %s: %s", d.key, reason)
        self._lose_worker(d, now, reason)

    # ------------------------------------------------------------------ status

    def status(self, now: float) -> dict[str, Any]:
        devices = []
        for d in sorted(self.devices.values(), key=lambda d: (d.info.node, d.info.index)):
            devices.append({
                "key": d.key, "name": d.info.name, "kind": d.info.kind, "state": d.state.value,
                "capacity": d.ledger.capacity, "used": d.ledger.used,
                "running": [{"id": i.id, "function": i.function.name,
                             "seconds": now - (i.started or now)} for i in d.running.values()],
                "completed": d.completed, "restarts": d.restarts, "last_error": d.last_error,
                "pid": d.worker_pid, "models": self._models_status(d),
                "group": list(self.gangs.held[d.key]) if d.key in self.gangs.held else None,
            })
        functions = [
            {"name": f.name, "function_id": f.function_id, "queued": self.queue.depth(fid),
             "calls": f.calls, "runtime_ewma": f.runtime_ewma}
            for fid, f in self.functions.items()
        ]
        return {
            "devices": devices,
            "functions": functions,
            "queued": len(self.queue),
            "running": sum(1 for i in self.invocations.values() if i.state is InvState.RUNNING),
            "clients": sum(1 for v in self.peers.values() if v.role == p.Role.CLIENT),
            "counters": self.counters.as_dict(),
            "models": self._model_counters(),
            "gangs": {"cold": self.gangs.cold_formations, "warm": self.gangs.warm_formations},
            "policy": self.policy.name,
        }
