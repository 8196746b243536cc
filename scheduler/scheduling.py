"""One scheduling pass: queued calls onto devices (mixin of `SchedulerCore`).

Queue heads are taken best-first. A single-device call goes to the best ranked device;
a multi-device call (a gang) gets `count` idle devices chosen close together, all at
once or not at all. When the best gang cannot start, it reserves the devices that will
drain soonest; other calls may use those only if they will finish before it could start.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpufn import protocol as p
from gpufn.memory_pool.ledger import Plan
from gpufn.memory_pool.residency import Residency
from gpufn.rendezvous import DEFAULT_TIMEOUT_S, GangSpec, resolve_backend
from gpufn.scheduler.gang import Reservation, can_backfill, choose_gang, reservation_for
from gpufn.scheduler.gangs import GangBook
from gpufn.scheduler.placement import could_ever_run, rank_devices, type_rank
from gpufn.scheduler.queues import ReadyQueue
from gpufn.scheduler.records import Device, Invocation
from gpufn.scheduler.states import DeviceState, InvState


@dataclass
class _Pass:
    """Scratch state of one pass: the head gang's reservation, if any."""

    reservation: Reservation | None = None
    owner: Invocation | None = None


class SchedulingPass:
    """The placement half of the scheduler core (state lives in `SchedulerCore`)."""

    # Provided by SchedulerCore and its other mixins (ModelPlacement, Batching).
    _fail_if_never_fits: Callable[[Invocation, float], bool]
    _preempt: Callable[[Invocation, Device, float, str], None]
    _batch_ready: Callable[[Invocation, float], bool]
    _form_batch: Callable[[Invocation, float], Invocation]
    _batch_meta: Callable[[Invocation], dict[str, Any]]
    _start_members: Callable[[Invocation, float], None]
    _best_plan: Callable[[Invocation, list[Device], float], tuple[Device, Plan] | None]
    _request: Callable[[Invocation], Any]
    _apply_plan: Callable[[Invocation, Device, Plan, float], dict[str, str]]
    config: Any
    _tokens: int
    devices: dict[str, Device]
    queue: ReadyQueue
    gangs: GangBook
    rendezvous_port: int | None
    needs_rendezvous: bool
    _send: Callable[[bytes, p.Message], None]

    def _schedule(self, now: float) -> None:
        if not len(self.queue):
            return
        slots = self.config.slots_per_device
        if not any(d.state is DeviceState.READY and len(d.running) < slots
                   for d in self.devices.values()) and not any(
                       i.spec.preemptible for d in self.devices.values() for i in d.running.values()):
            return  # every device is full and nothing could be preempted
        this = _Pass()
        heads = self.queue.heads()
        heapq.heapify(heads)
        while heads:
            _, _, fid = heapq.heappop(heads)
            inv = self.queue.head(fid)
            if inv is None:
                continue
            if not self._try_place(inv, now, this):
                if inv.spec.count > 1 and this.reservation is None:
                    this.reservation = self._reserve(inv, now)
                    this.owner = inv
                continue  # this function is blocked for the rest of the pass
            nxt = self.queue.head(fid)
            if nxt is not None:
                heapq.heappush(heads, (self.queue.key(nxt), nxt.seq, fid))

    # ------------------------------------------------------------------ single device

    def _try_place(self, inv: Invocation, now: float, this: _Pass) -> bool:
        if inv.spec.count > 1:
            return self._place_gang(inv, now, this)
        spec, fn = inv.spec, inv.function
        if spec.batch_size is not None and not self._batch_ready(inv, now):
            return False
        depth = self.config.pipeline_depth if self._short(inv) else 0
        with_models = bool(fn.model_keys)
        ranked = rank_devices(spec, fn, self.devices.values(), self.config.slots_per_device,
                              depth, check_memory=not with_models, now=now)
        r = this.reservation
        usable = [d for d in ranked if inv.id not in d.running and (
            r is None or d.key not in r.devices or can_backfill(fn.runtime_ewma, r.start_eta))]
        if not ranked:  # no device could take it now at all: make room if that is allowed
            self._maybe_preempt(inv, now)
            return False
        plan = None
        if with_models and usable:
            best = self._best_plan(inv, usable, now)
            usable, plan = ([best[0]], best[1]) if best is not None else ([], None)
            if best is None and self._fail_if_never_fits(inv, now):
                return True  # finished (Unschedulable): the next call of it may go
        if not usable:
            return False  # waiting by choice (a resident device frees soon) or for room
        d = usable[0]
        if spec.batch_size is not None:
            carrier = self._form_batch(inv, now)
            self._dispatch(carrier, [d], now, {d.key: plan} if plan else None)
            return True
        self.queue.pop(fn.function_id)
        self._dispatch(inv, [d], now, {d.key: plan} if plan else None)
        return True

    # ------------------------------------------------------------------ preemption

    def _maybe_preempt(self, inv: Invocation, now: float) -> None:
        """Stop a running preemptible call of lower priority where this call would then
        fit; it goes back to the queue (keeping its place) and runs again from the start."""
        if inv.preempt_asked is not None and now - inv.preempt_asked < self.config.stop_grace_seconds:
            return  # a call preempted for it is still stopping
        if not any(i.spec.preemptible and i.spec.priority < inv.spec.priority
                   for d in self.devices.values() for i in d.running.values()):
            return
        spec = inv.spec
        best: tuple[tuple[Any, ...], Device, Invocation] | None = None
        for d in self.devices.values():
            if d.state is not DeviceState.READY or type_rank(spec.type, d.info.name) is None:
                continue
            for victim in d.running.values():
                vs = victim.spec
                if (victim.state is not InvState.RUNNING or not vs.preemptible
                        or vs.priority >= spec.priority or len(victim.devices) != 1
                        or victim.id in d.stopping or victim.members):
                    continue
                if d.ledger.free + vs.memory < spec.memory:
                    continue
                if any(d.ledger.state(k) is not Residency.RESIDENT
                       for k in inv.function.model_keys):
                    continue  # stopping the victim would not make its models appear here
                same_fn = victim.function.code_id == inv.function.code_id
                if d.running_by_fn[inv.function.code_id] - same_fn >= spec.concurrency:
                    continue
                key = (vs.priority, -(victim.started or now), d.key)
                if best is None or key < best[0]:
                    best = (key, d, victim)
        if best is None:
            return
        _, d, victim = best
        inv.preempt_asked = now
        self._preempt(victim, d, now, f"preempted by {inv.function.name} call {inv.id} "
                                      f"(priority {spec.priority} > {victim.spec.priority})")


    def _short(self, inv: Invocation) -> bool:
        s = inv.spec
        return (s.concurrency == 1 and s.count == 1
                and inv.function.is_short(self.config.short_call_seconds))

    # ------------------------------------------------------------------ gangs

    def _gang_capable(self, inv: Invocation) -> list[Device]:
        return [d for d in self.devices.values()
                if d.state is DeviceState.READY and could_ever_run(inv.spec, d)]

    def _place_gang(self, inv: Invocation, now: float, this: _Pass) -> bool:
        spec = inv.spec
        if spec.spmd and self.rendezvous_port is None:
            self.needs_rendezvous = True  # the shell starts the store, then schedules again
            return False
        reserved = this.reservation.devices if this.reservation and this.owner is not inv else ()
        idle = [d for d in self._gang_capable(inv)
                if not d.running and d.ledger.free >= spec.memory and d.key not in reserved]
        if inv.function.model_keys:  # room for the models is checked per device below
            idle = [d for d in self._gang_capable(inv) if not d.running and d.key not in reserved]
        chosen = choose_gang([d.info for d in idle], spec.count, prefer=inv.function.warm_gang)
        if chosen is None or (not spec.spmd and len({c.node for c in chosen}) > 1):
            return False
        plans: dict[str, Plan] = {}
        if inv.function.model_keys:
            req = self._request(inv)
            for c in chosen:
                plan = self.devices[c.key].ledger.plan(req)
                if not isinstance(plan, Plan):
                    return False
                plans[c.key] = plan
        self.queue.pop(inv.function.function_id)
        self._dispatch(inv, [self.devices[c.key] for c in chosen], now, plans)
        return True

    def _reserve(self, inv: Invocation, now: float) -> Reservation | None:
        """Reserve the devices that will drain soonest for a gang that cannot start yet."""
        capable = self._gang_capable(inv)
        drain: dict[str, float] = {}
        for d in capable:
            left = 0.0
            for other in d.running.values():
                ewma = other.function.runtime_ewma
                if ewma is None or other.started is None:
                    left = math.inf
                    break
                left = max(left, ewma - (now - other.started))
            drain[d.key] = max(0.0, left)
        return reservation_for(inv.spec.count, [d.info for d in capable], drain,
                               prefer=inv.function.warm_gang)

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, inv: Invocation, devices: list[Device], now: float,
                  plans: dict[str, Plan] | None = None) -> None:
        inv.to(InvState.RUNNING, now)
        inv.deadline = None  # it started in time; a retry or preemption never drops it
        inv.devices = tuple(d.key for d in devices)
        inv.started = now
        inv.attempts += 1
        self._tokens += 1
        inv.token = self._tokens
        inv.rank_results = {}
        fn, spec = inv.function, inv.spec
        base: dict[str, Any] = {"timeout": spec.timeout, "concurrency": spec.concurrency,
                                "inline": self._short(inv), "attempt_number": inv.attempts}
        if inv.members:
            base.update(self._batch_meta(inv))
            self._start_members(inv, now)
        metas: list[dict[str, Any] | None]
        if spec.count > 1 and spec.spmd:
            formation, warm = self.gangs.form(inv.devices)
            inv.gang = (formation.gang_id, formation.generation)
            fn.warm_gang = inv.devices
            backend = resolve_backend(devices[0].info.kind)
            assert self.rendezvous_port is not None
            metas = []
            for rank in range(len(devices)):
                gang = GangSpec(formation.gang_id, formation.generation, rank, len(devices),
                                "", self.rendezvous_port, backend,
                                spec.timeout or DEFAULT_TIMEOUT_S, inv.devices, formation.nonce)
                metas.append({**base, "gang": gang.to_wire(), "gather": spec.gather,
                              "warm": warm})
        elif spec.count > 1:
            # spmd=False: one process pinned to every granted device runs the call on the
            # first device's worker; the other devices are held idle for it.
            metas = [{**base, "multi": [{"key": d.key, "uuid": d.info.uuid, "kind": d.info.kind}
                                        for d in devices]}]
            metas += [None] * (len(devices) - 1)
        else:
            metas = [base]
        inv.run_started = None
        for d, meta in zip(devices, metas, strict=True):
            assert d.worker is not None
            d.running[inv.id] = inv
            d.running_by_fn[fn.code_id] += 1
            plan = (plans or {}).get(d.key)
            if plan is not None:
                models = self._apply_plan(inv, d, plan, now)  # model orders go first
                if meta is not None:
                    meta["models"] = models
                    if plan.load or plan.restore or plan.waiting:
                        meta["inline"] = False  # it waits for a model: never on the main thread
            else:
                d.ledger.reserve(inv.id, spec.memory)
            if meta is None:
                continue
            if fn.code_id not in d.code:
                self._send(d.worker, p.LoadCode(fn.code_id, fn.name, fn.code_frames))
                d.code.add(fn.code_id)
            self._send(d.worker, p.Run(inv.id, fn.function_id, fn.code_id, fn.name,
                                       inv.token, meta, inv.frames))
        self._advance_starts(devices[0], now)

    def _advance_starts(self, d: Device, now: float) -> None:
        """Mark calls on a device as really running (their timeout clock starts) once
        their models are resident and no earlier call of theirs holds their slot."""
        busy: dict[str, int] = {}
        waiting = []
        for inv in d.running.values():
            if inv.state is not InvState.RUNNING:
                continue
            if inv.run_started is not None:
                busy[inv.function.code_id] = busy.get(inv.function.code_id, 0) + 1
            else:
                waiting.append(inv)
        for inv in sorted(waiting, key=lambda i: (i.started or now, i.seq)):
            code = inv.function.code_id
            if busy.get(code, 0) >= inv.spec.concurrency:
                continue
            if any(d.ledger.state(k) is not Residency.RESIDENT for k in inv.function.model_keys):
                continue
            inv.run_started = now
            busy[code] = busy.get(code, 0) + 1


__all__ = ["SchedulingPass", "type_rank"]
