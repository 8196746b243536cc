"""The scheduler's book of shared models: their records, each call's memory request,
where a call's models are cheapest to have, and the worker orders that admit a plan.

It answers questions and returns plans and orders; it never sends a message itself.
A model's key is its name plus its loader's content hash, so redefining a loader makes
a new model; the old one stops being used and leaves the pool by policy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpufn import protocol as p
from gpufn.exceptions import OutOfMemory, kind_of
from gpufn.memory_pool.ledger import ModelNeed, NeverFits, Plan, Request, StalePlan
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.placement import drain_seconds
from gpufn.scheduler.records import Device, FunctionRecord, Invocation
from gpufn.scheduler.states import DeviceState

log = logging.getLogger("gpufn.scheduler")

_MOVING = (Residency.LOADING, Residency.OFFLOADING, Residency.EVICTING)
# Until a model's reloads are measured: host->device copy and loader speed guesses.
HOST_BANDWIDTH = 8.0 * 2**30
LOAD_BANDWIDTH = 1.0 * 2**30


@dataclass
class ModelRecord:
    key: str
    name: str
    memory: int  # declared estimate
    pin: bool
    offload: bool
    frames: tuple[Any, ...]  # the loader's code
    measured: int = 0  # bytes measured on a device (better than the estimate)
    loads: int = 0
    load_seconds: float = 0.0
    restores: int = 0
    restore_seconds: float = 0.0
    offloads: int = 0
    evictions: int = 0
    failures: int = 0
    last_error: str = ""  # the last load failure's message (shown by `gpufn app list`)

    @property
    def size(self) -> int:
        return self.measured or self.memory


@dataclass(frozen=True, slots=True)
class Admission:
    """A plan committed on a device: the orders to send (to which device's worker, in
    order), the call's model name -> key map for `Model.get()`, and how cold it was."""

    orders: tuple[tuple[Device, p.Message], ...]
    names: dict[str, str]
    cold: str  # "loaded" / "restored" / "waited" / ""


class ModelBook:
    def __init__(self) -> None:
        self.models: dict[str, ModelRecord] = {}
        self._replan: set[str] = set()  # calls whose model turned out larger than declared

    # ------------------------------------------------------------------ registry

    def register(self, descs: list[dict[str, Any]], frames: tuple[Any, ...]) -> tuple[str, ...]:
        """Record the models a function names (loader frames in order); their keys."""
        keys = []
        i = 0
        for d in descs:
            n = int(d.get("nframes", 0))
            key = f"{d['name']}@{str(d.get('code_id', ''))[:10]}"
            if key not in self.models:
                self.models[key] = ModelRecord(
                    key, str(d["name"]), int(d.get("memory") or 0), bool(d.get("pin")),
                    bool(d.get("offload", True)), tuple(frames[i:i + n]))
            keys.append(key)
            i += n
        return tuple(keys)

    def model_bytes(self, fn: FunctionRecord) -> int:
        return sum(self.models[k].size for k in fn.model_keys)

    def request(self, inv: Invocation) -> Request:
        return self._request(inv.function, inv.spec.memory, inv.spec.priority)

    def _request(self, fn: FunctionRecord, memory: int, priority: int = 0) -> Request:
        needs = tuple(ModelNeed(k, self.models[k].size, self.models[k].pin,
                                self.models[k].offload, priority) for k in fn.model_keys)
        return Request(needs, memory, fn.name)

    # ------------------------------------------------------------------ questions

    def cold_seconds(self, plan: Plan) -> float:
        """Expected seconds to make a plan's models resident (restores, then loads)."""
        total = 0.0
        for key in plan.restore:
            r = self.models[key]
            total += r.restore_seconds / r.restores if r.restores else r.size / HOST_BANDWIDTH
        for key in plan.load:
            r = self.models[key]
            total += r.load_seconds / r.loads if r.loads else 1.0 + r.size / LOAD_BANDWIDTH
        return total

    def best_plan(self, inv: Invocation, candidates: list[Device], every: Iterable[Device],
                  now: float) -> tuple[Device, Plan] | None:
        """Where the call's models are cheapest to have, by expected time: what must
        drain there plus what must load (resident, then on host, then least eviction).
        None means wait: nothing fits now, or a device that already holds the models
        frees up sooner than another could load them (no second copy for a short wait)."""
        req = self.request(inv)
        mine = set(inv.function.model_keys)
        best: tuple[tuple[Any, ...], Device, Plan, float] | None = None
        for d in candidates:
            plan = d.ledger.plan(req)
            if not isinstance(plan, Plan):
                continue
            swapping = any(e.state in _MOVING and e.name not in mine for e in d.ledger.models.values())
            if swapping and (plan.load or plan.restore or plan.victims):
                continue  # one swap at a time per device: calls that hit go first (no thrash)
            cold = self.cold_seconds(plan)
            key = (drain_seconds(d, now) + cold, plan.cost, len(d.running), -plan.free_after, d.key)
            if best is None or key < best[0]:
                best = (key, d, plan, cold)
        if best is None:
            return None
        _, d, plan, cold = best
        if cold > 0 and not plan.waiting:
            for other in every:
                if other is d or other in candidates or other.state is not DeviceState.READY:
                    continue
                if all(other.ledger.state(k) is Residency.RESIDENT for k in mine) and \
                        drain_seconds(other, now) < cold:
                    return None  # it will be free there sooner than a copy could load here
        return d, plan

    def gang_plans(self, inv: Invocation, devices: list[Device]) -> dict[str, Plan] | None:
        """A plan on every device of a gang, or None if one of them cannot admit now."""
        req = self.request(inv)
        plans: dict[str, Plan] = {}
        for d in devices:
            plan = d.ledger.plan(req)
            if not isinstance(plan, Plan):
                return None
            plans[d.key] = plan
        return plans

    def never_fits(self, fn: FunctionRecord, spec_memory: int, devices: Iterable[Device]) -> str | None:
        """Why the function's models plus workspace fit on no registered device, or None."""
        devs = list(devices)
        if not fn.model_keys or not devs:
            return None
        verdicts = []
        req = self._request(fn, spec_memory)
        for d in devs:
            plan = d.ledger.plan(req)
            if not isinstance(plan, NeverFits):
                return None
            verdicts.append((plan.shortfall, d.key, plan))
        _, key, plan = min(verdicts, key=lambda v: (v[0], v[1]))
        names = ", ".join(self.models[k].name for k in fn.model_keys)
        return (f"{fn.name} with models [{names}] {plan} on the best device ({key}). Lower "
                "@gpu(memory=...), use smaller models, or add larger devices.")

    # ------------------------------------------------------------------ admission

    def admit(self, inv: Invocation, d: Device, plan: Plan, now: float,
              devices: dict[str, Device]) -> Admission:
        """Commit the plan in the device's ledger; the orders that make it true."""
        try:
            d.ledger.admit(inv.id, plan, now)
        except StalePlan:  # a gang's earlier device changed the shared host ledger: plan again
            fresh = d.ledger.plan(self.request(inv))
            if not isinstance(fresh, Plan):
                raise
            plan = fresh
            d.ledger.admit(inv.id, plan, now)
        orders: list[tuple[Device, p.Message]] = []
        for dev_key, key in plan.drop_host:
            other = devices.get(dev_key)
            if other is not None and other.worker is not None:
                orders.append((other, p.EvictModel(key, False)))
        for key in plan.offload:
            self.models[key].offloads += 1
            orders.append((d, p.EvictModel(key, True)))
        for key in plan.evict:
            self.models[key].evictions += 1
            orders.append((d, p.EvictModel(key, False)))
        for key in plan.restore:
            orders.append((d, p.LoadModel(key, {"restore": True, "name": self.models[key].name})))
        for key in plan.load:
            rec = self.models[key]
            orders.append((d, p.LoadModel(key, {"name": rec.name, "memory": rec.memory}, rec.frames)))
        cold = ("loaded" if plan.load else "restored" if plan.restore
                else "waited" if plan.waiting else "")
        names = {self.models[k].name: k for k in inv.function.model_keys}
        return Admission(tuple(orders), names, cold)

    # ------------------------------------------------------------------ worker reports

    def on_event(self, d: Device, msg: p.ModelEvent, now: float) -> bool:
        """Apply a worker's model event to the device's ledger and the records.
        Returns True if a model's learned size changed (feasibility must be re-checked)."""
        rec = self.models.get(msg.model)
        led = d.ledger
        entry = led.models.get(msg.model)
        resized = False
        try:
            if msg.state is p.ModelState.RESIDENT and entry is not None:
                if entry.from_host:
                    led.restore_done(msg.model, now, msg.seconds)
                    if rec is not None:
                        rec.restores += 1
                        rec.restore_seconds += msg.seconds
                else:
                    fix = led.load_done(msg.model, now, msg.nbytes, msg.seconds)
                    if fix is not None:
                        log.warning("%s", fix)
                    if rec is not None:
                        resized = rec.measured != msg.nbytes
                        rec.measured = msg.nbytes
                        rec.loads += 1
                        rec.load_seconds += msg.seconds
            elif msg.state is p.ModelState.LOAD_FAILED and entry is not None:
                holders = led.load_failed(msg.model, now)
                if rec is not None and msg.error_kind == kind_of(OutOfMemory) and msg.nbytes > rec.size:
                    # Declared too small: learn the real size; the calls that waited for
                    # this load (and only they) are planned again with it.
                    log.warning("model %s needs %d bytes, more than declared; re-planning",
                                rec.name, msg.nbytes)
                    rec.measured = msg.nbytes
                    self._replan.update(holders)
                    resized = True
                elif rec is not None:
                    rec.failures += 1
                    rec.last_error = msg.message
                log.warning("model %s on %s: %s", msg.model, d.key, msg.message.splitlines()[0])
            elif msg.state is p.ModelState.OFFLOADED and entry is not None:
                led.offload_done(msg.model, now)
            elif msg.state is p.ModelState.OFFLOAD_FAILED and entry is not None:
                led.offload_failed(msg.model, now)
            elif msg.state is p.ModelState.EVICTED and entry is not None:
                if entry.state is Residency.OFFLOADING:  # the worker dropped it instead
                    led.offload_failed(msg.model, now)
                elif entry.state is Residency.EVICTING:
                    led.evict_done(msg.model, now)
                elif entry.state is Residency.OFFLOADED:
                    led.drop_host_copy(msg.model, now)
        except (KeyError, ValueError) as e:  # an event from before a reset: stale
            log.info("ignoring model event %s %s on %s: %s", msg.model, msg.state, d.key, e)
        return resized

    def should_replan(self, inv: Invocation, msg: p.Result) -> bool:
        """A call that failed only because a model it waited for was larger than
        declared (the ledger has now learned the size) is queued again, once."""
        if inv.id not in self._replan:
            return False
        self._replan.discard(inv.id)
        return not msg.ok and msg.error_kind == kind_of(OutOfMemory) and inv.replans == 0

    # ------------------------------------------------------------------ status

    def device_status(self, d: Device) -> list[dict[str, Any]]:
        out = []
        for e in d.ledger.models.values():
            if e.state is Residency.ABSENT:
                continue
            rec = self.models.get(e.name)
            out.append({"name": rec.name if rec else e.name, "key": e.name, "state": e.state.value,
                        "nbytes": e.nbytes, "measured": e.measured, "users": sorted(e.users),
                        "in_use": e.in_use, "uses": e.uses, "pinned": e.pinned})
        return out

    def counters(self) -> list[dict[str, Any]]:
        return [{"name": r.name, "key": r.key, "bytes": r.size, "loads": r.loads,
                 "mean_load_s": r.load_seconds / r.loads if r.loads else None,
                 "restores": r.restores,
                 "mean_restore_s": r.restore_seconds / r.restores if r.restores else None,
                 "offloads": r.offloads, "evictions": r.evictions, "failures": r.failures}
                for r in self.models.values()]
