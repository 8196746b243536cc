"""The scheduler's book of shared models: their records, each call's memory request,
where a call's models are cheapest to have, and the worker orders that admit a plan.

It answers questions and returns plans and orders; it never sends a message itself.
A model's key is its name plus its loader's content hash, so redefining a loader makes
a new model; the old one stops being used and leaves the pool by policy.

A sharded model (`count=N`) is one unit spread over a gang: one ledger entry per device
(that rank's bytes), planned on all N devices at once (`fit_group`), leaving all
together, and tied to the gang formation it was loaded in (`Holder`): once any of its
devices leaves that group (a failure, a lost worker, another gang) its shards are stale
and `sweep` removes them; a new formation loads it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufn.exceptions import OutOfMemory, kind_of
from gpufn.memory_pool.ledger import (
    Fit,
    GroupFit,
    ModelNeed,
    NeverFits,
    Request,
    StaleFit,
    fit_group,
)
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books.gang_book import GangBook
from gpufn.scheduler.nouns.records import Device, FunctionRecord, Invocation, drain_seconds
from gpufn.scheduler.nouns.states import DeviceState
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")

_MOVING = (Residency.LOADING, Residency.OFFLOADING, Residency.EVICTING)
# Until a model's reloads are measured: host->device copy and loader speed guesses.
HOST_BANDWIDTH = 8.0 * 2**30
LOAD_BANDWIDTH = 1.0 * 2**30


@dataclass
class Holder:
    """Where a sharded model's shards live: the gang's devices in rank order and the
    formation (gang_id, generation) they were loaded in."""

    devices: tuple[str, ...]
    gang: tuple[str, int] | None
    failed: bool = False  # a rank's loader failed: the other shards are partial


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
    failing: int = 0  # load failures since its last successful load (0: healthy)
    last_error: str = ""  # the last load failure's message (shown by `gpufn app list`)
    count: int = 1  # devices a sharded model spans (1: a whole model per device)
    holder: Holder | None = None

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
    def __init__(self, gangs: GangBook | None = None) -> None:
        self.models: dict[str, ModelRecord] = {}
        self._replan: set[str] = set()  # calls whose model turned out larger than declared
        self.gangs = gangs if gangs is not None else GangBook()
        self._joint: dict[str, GroupFit] = {}  # a gang call's joint plan, until admitted
        # device key -> (its ledger's version, request, fit): see `_fit`
        self._fits: dict[tuple[str, Request], tuple[tuple[int, int], Fit | NeverFits | None]] = {}

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
                    bool(d.get("offload", True)), tuple(frames[i:i + n]), count=int(d.get("count", 1)))
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

    def cold_seconds(self, plan: Fit) -> float:
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
                  now: float) -> tuple[Device, Fit] | None:
        """Where the call's models are cheapest to have, by expected time: what must
        drain there plus what must load (resident, then on host, then least eviction).
        None means wait: nothing fits now, or a device that already holds the models
        frees up sooner than another could load them (no second copy for a short wait)."""
        ids = {id(d) for d in candidates}
        return self.best_plan_by_drain(
            inv, ((drain_seconds(d, now), d) for d in candidates),
            lambda d: id(d) in ids, every, now, ordered=False)

    def best_plan_by_drain(self, inv: Invocation, candidates: Iterable[tuple[float, Device]],
                           is_candidate: Callable[[Device], bool], every: Iterable[Device],
                           now: float, ordered: bool = True) -> tuple[Device, Fit] | None:
        """`best_plan` over (drain_seconds at `now`, device) pairs; `ordered`: in ascending
        drain, so the search stops at the first device whose drain alone is later than
        the best expected time found (a device's cold start only adds to its drain)."""
        req = self.request(inv)
        mine = set(inv.function.model_keys)
        every = list(every) if not isinstance(every, list) else every
        shards = self._any_shards_in(every)
        devmap = {x.key: x for x in every} if shards else {}
        joints: dict[str, GroupFit] = {}
        best: tuple[tuple[Any, ...], Device, Fit, float] | None = None
        # Each missing model adds at least its own load (or restore) time to a device's
        # cold start, and its bytes to the plan's cost: a device whose key, so bounded,
        # is already worse than the best one found is not planned at all.
        terms = [(k, self._load_seconds(self.models[k]), self._restore_seconds(self.models[k]),
                  self.models[k].size) for k in inv.function.model_keys]
        workspace = req.workspace
        for drain, d in candidates:
            if best is not None:
                if ordered and drain > best[0][0]:
                    break
                models = d.ledger.models
                least, load_b, restore_b, waiting = 0.0, 0, 0, 0
                for k, load_s, restore_s, size in terms:
                    e = models.get(k)
                    if e is None or e.state is Residency.ABSENT:
                        t, load_b = load_s, load_b + size
                    elif e.state is Residency.OFFLOADED:
                        t, restore_b = restore_s, restore_b + (e.nbytes if e.measured else size)
                    else:
                        t, waiting = 0.0, waiting + (e.state is Residency.LOADING)
                    least = t if t > least else least
                # The least key a plan here can have (`Fit.cost` with no victim: then the
                # free bytes lose the call's workspace and what loads or comes back).
                if (drain + least, (load_b, restore_b, waiting, 0.0, 0), len(d.running),
                        workspace + load_b + restore_b - d.ledger.free, d.key) > best[0]:
                    continue
            if shards:  # a victim shard here takes its siblings on other devices along
                joint = fit_group({k: x.ledger for k, x in devmap.items()}, (d.key,), req)
                if not isinstance(joint, GroupFit):
                    continue
                joints[d.key] = joint
                plan = joint.plans[d.key]
            else:
                plan = self._fit(d, req)
            if not isinstance(plan, Fit):
                continue
            swapping = any(e.state in _MOVING and e.name not in mine for e in d.ledger.models.values())
            if swapping and (plan.load or plan.restore or plan.victims):
                continue  # one swap at a time per device: calls that hit go first (no thrash)
            cold = self.cold_seconds(plan)
            key = (drain + cold, plan.cost, len(d.running), -plan.free_after, d.key)
            if best is None or key < best[0]:
                best = (key, d, plan, cold)
        if best is None:
            return None
        _, d, plan, cold = best
        if cold > 0 and not plan.waiting:
            for other in every:
                if other is d or other.state is not DeviceState.READY or is_candidate(other):
                    continue
                if all(other.ledger.state(k) is Residency.RESIDENT for k in mine) and \
                        drain_seconds(other, now) < cold:
                    return None  # it will be free there sooner than a copy could load here
        if d.key in joints:
            self._joint[inv.id] = joints[d.key]  # admitted with its sibling shards
        return d, plan

    def _fit(self, d: Device, req: Request) -> Fit | NeverFits | None:
        """`d.ledger.fit(req)`, remembered until the ledger (or its host's) changes: a
        device nothing happened on is not planned again for the same request."""
        version = d.ledger._version()
        got = self._fits.get((d.key, req))
        if got is not None and got[0] == version:
            return got[1]
        plan = d.ledger.fit(req)
        if len(self._fits) > 65536:  # stale versions pile up: start again
            self._fits.clear()
        self._fits[(d.key, req)] = (version, plan)
        return plan

    def gang_plans(self, inv: Invocation, devices: list[Device],
                   every: Mapping[str, Device] | None = None) -> dict[str, Fit] | None:
        """A plan on every device of a gang, or None if one of them cannot admit now.
        With sharded models anywhere in `every`, the gang is planned as one (see
        `fit_group`) and the joint plan is kept for `admit`."""
        req = self.request(inv)
        if every is not None and self._any_shards(every):
            joint = self._plan_joint(inv, tuple(d.key for d in devices), req, every)
            if joint is None:
                return None
            self._joint[inv.id] = joint
            return dict(joint.plans)
        plans: dict[str, Fit] = {}
        for d in devices:
            plan = d.ledger.fit(req)
            if not isinstance(plan, Fit):
                return None
            plans[d.key] = plan
        return plans

    # ------------------------------------------------------------------ sharded models

    def _sharded(self, keys: Iterable[str]) -> list[ModelRecord]:
        return [r for k in keys if (r := self.models[k]).count > 1]

    def _any_shards(self, every: Mapping[str, Device]) -> bool:
        return self._any_shards_in(every.values())

    def _any_shards_in(self, every: Iterable[Device]) -> bool:
        sharded = [r for r in self.models.values() if r.count > 1]
        if not sharded:  # shards are only made of such models (see `admit`): O(1) per call
            return False
        return any(r.holder is not None for r in sharded) or any(
            e.shards for d in every for e in d.ledger.models.values())

    def valid(self, rec: ModelRecord) -> bool:
        """Whether a sharded model's shards may serve: not partial, and every device of
        its gang still holds the group they were loaded in."""
        h = rec.holder
        return h is not None and not h.failed and h.gang is not None and self.gangs.holds(h.devices, h.gang)

    def gang_choice(self, inv: Invocation, idle: set[str], every: Mapping[str, Device],
                    now: float) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """Where a gang call goes given its sharded models: (preferred devices in rank
        order, devices to avoid), or None to wait. The gang holding the shards, same
        devices and rank order, whenever it can start; if it is busy, wait while it
        frees sooner than the model would load elsewhere (or while the model is in use),
        else move the model (its old shards leave)."""
        prefer: tuple[str, ...] = tuple(inv.function.warm_gang)
        for rec in self._sharded(inv.function.model_keys):
            h = rec.holder
            if h is None:
                continue
            if not self.valid(rec):
                return None  # stale shards are still leaving (`sweep`); then it reloads
            if all(k in idle for k in h.devices):
                return h.devices, ()
            entries = [every[k].ledger.models.get(rec.key) for k in h.devices if k in every]
            if any(e is not None and (e.in_use or e.pinned or e.state in _MOVING) for e in entries):
                return None
            drain = max((drain_seconds(every[k], now) for k in h.devices if k in every), default=0.0)
            if drain <= self._load_seconds(rec):
                return None
            return (), h.devices
        return prefer, ()

    def _load_seconds(self, r: ModelRecord) -> float:
        return r.load_seconds / r.loads if r.loads else 1.0 + r.size / LOAD_BANDWIDTH

    def _restore_seconds(self, r: ModelRecord) -> float:
        return r.restore_seconds / r.restores if r.restores else r.size / HOST_BANDWIDTH

    def _plan_joint(self, inv: Invocation, gang: tuple[str, ...], req: Request,
                    every: Mapping[str, Device]) -> GroupFit | None:
        doomed: dict[str, bool] = {}
        warm = self.gangs.is_warm(gang)
        for rec in self.models.values():
            h = rec.holder
            if rec.count <= 1 or h is None:
                continue
            moving = rec.key in inv.function.model_keys and h.devices != gang
            if moving or (not warm and set(h.devices) & set(gang)):
                doomed[rec.key] = False  # its group is left: the shards are useless
        ledgers = {k: d.ledger for k, d in every.items()}
        found = fit_group(ledgers, gang, req, doomed=doomed)
        return found if isinstance(found, GroupFit) else None

    def sweep(self, every: Mapping[str, Device], now: float) -> list[tuple[Device, p.Message]]:
        """Orders that remove stale shards (their gang's group is gone, or a rank's
        loader failed) on every device holding them, host copies included. Shards still
        in use or moving are taken on a later sweep."""
        orders: list[tuple[Device, p.Message]] = []
        for rec in self.models.values():
            h = rec.holder
            if rec.count <= 1 or h is None or self.valid(rec):
                continue
            pending = swept = False
            for k in h.devices:
                d = every.get(k)
                e = d.ledger.models.get(rec.key) if d is not None else None
                if d is None or e is None or e.state in (Residency.ABSENT, Residency.EVICTING):
                    continue
                held = any(rec.key in names for names in d.ledger.holds.values())
                if e.state is Residency.RESIDENT and e.idle and d.worker is not None:
                    d.ledger.evict_started(rec.key, now)
                elif e.state is Residency.OFFLOADED and d.worker is not None:
                    d.ledger.drop_host_copy(rec.key, now)
                elif e.state is Residency.LOADING and not held and not e.from_host:
                    d.ledger.load_failed(rec.key, now)  # a load no call will run now
                else:
                    pending = True
                    continue
                swept = True
                if d.worker is not None:
                    orders.append((d, p.EvictModel(rec.key, False)))
            rec.evictions += swept
            if not pending:
                rec.holder = None
        return orders

    def _admit_joint(self, inv: Invocation, joint: GroupFit, now: float,
                     devices: dict[str, Device]) -> list[tuple[Device, p.Message]]:
        """Before the gang's first device admits: check nothing changed since the joint
        plan, then move the sibling shards outside the gang."""
        if joint.versions != tuple((k, d.ledger._version()) for k, d in sorted(devices.items())):
            fresh = self._plan_joint(inv, inv.devices, self.request(inv), devices)
            if fresh is None:
                raise StaleFit(f"the gang plan for {inv.id} no longer fits")
            joint = self._joint[inv.id] = fresh
        orders: list[tuple[Device, p.Message]] = []
        for key, name, action in joint.outside:
            d = devices[key]
            if action == "drop":
                d.ledger.drop_host_copy(name, now)
            elif action == "offload":
                d.ledger.offload_started(name, now)
                self._count(name, "offloads")
            else:
                d.ledger.evict_started(name, now)
                self._count(name, "evictions")
            if d.worker is not None:
                orders.append((d, p.EvictModel(name, action == "offload")))
        return orders

    def never_fits(self, fn: FunctionRecord, spec_memory: int, devices: Iterable[Device]) -> str | None:
        """Why the function's models plus workspace fit on no registered device, or None."""
        devs = list(devices)
        if not fn.model_keys or not devs:
            return None
        verdicts = []
        req = self._request(fn, spec_memory)
        for d in devs:
            plan = d.ledger.fit(req)
            if not isinstance(plan, NeverFits):
                return None
            verdicts.append((plan.shortfall, d.key, plan))
        _, key, plan = min(verdicts, key=lambda v: (v[0], v[1]))
        names = ", ".join(self.models[k].name for k in fn.model_keys)
        return (f"{fn.name} with models [{names}] {plan} on the best device ({key}). Lower "
                "@gpu(memory=...), use smaller models, or add larger devices.")

    # ------------------------------------------------------------------ admission

    def admit(self, inv: Invocation, d: Device, plan: Fit, now: float,
              devices: dict[str, Device]) -> Admission:
        """Commit the plan in the device's ledger; the orders that make it true."""
        orders: list[tuple[Device, p.Message]] = []
        planned = next((i for i in (inv.id, *(m.id for m in inv.members)) if i in self._joint), None)
        if planned is not None:  # planned with sharded models in mind: admitted as one
            if planned != inv.id:  # a batch carrier admits what its head was planned with
                self._joint[inv.id] = self._joint.pop(planned)
            if inv.devices and d.key == inv.devices[0]:
                orders += self._admit_joint(inv, self._joint[inv.id], now, devices)
            plan = self._joint[inv.id].plans[d.key]
            d.ledger.admit(inv.id, plan, now, check=False)
            if inv.devices and d.key == inv.devices[-1]:
                del self._joint[inv.id]
        else:
            plan = self._admit_one(inv, d, plan, now)
        return self._orders(inv, d, plan, devices, orders)

    def _admit_one(self, inv: Invocation, d: Device, plan: Fit, now: float) -> Fit:
        try:
            d.ledger.admit(inv.id, plan, now)
        except StaleFit:  # a gang's earlier device changed the shared host ledger: plan again
            fresh = d.ledger.fit(self.request(inv))
            if not isinstance(fresh, Fit):
                raise
            d.ledger.admit(inv.id, fresh, now)
            return fresh
        return plan

    def _orders(self, inv: Invocation, d: Device, plan: Fit, devices: dict[str, Device],
                orders: list[tuple[Device, p.Message]]) -> Admission:
        for dev_key, key in plan.drop_host:
            other = devices.get(dev_key)
            if other is not None and other.worker is not None:
                orders.append((other, p.EvictModel(key, False)))
        for key in plan.offload:
            self._count(key, "offloads")
            orders.append((d, p.EvictModel(key, True)))
        for key in plan.evict:
            self._count(key, "evictions")
            orders.append((d, p.EvictModel(key, False)))
        for key in plan.restore:
            orders.append((d, p.LoadModel(key, {"restore": True, "name": self.models[key].name})))
        for key in plan.load:
            rec = self.models[key]
            spec: dict[str, Any] = {"name": rec.name, "memory": rec.memory}
            if rec.count > 1:  # loaded inside the gang's group, after the call joins it
                spec["sharded"] = True
                d.ledger.models[key].shards = inv.devices
                rec.holder = Holder(inv.devices, inv.gang)
            orders.append((d, p.LoadModel(key, spec, rec.frames)))
        cold = ("loaded" if plan.load else "restored" if plan.restore
                else "waited" if plan.waiting else "")
        names = {self.models[k].name: k for k in inv.function.model_keys}
        return Admission(tuple(orders), names, cold)

    def _count(self, key: str, what: str) -> None:
        """A victim may be a model no function registered yet names (a resident model
        that outlived a scheduler restart): it has no record to count on."""
        rec = self.models.get(key)
        if rec is not None:
            setattr(rec, what, getattr(rec, what) + 1)

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
                lead = rec is None or rec.holder is None or rec.holder.devices[0] == d.key
                if entry.from_host:
                    led.restore_done(msg.model, now, msg.seconds)
                    if rec is not None and lead:  # a sharded model counts once (rank 0)
                        rec.restores += 1
                        rec.restore_seconds += msg.seconds
                else:
                    fix = led.load_done(msg.model, now, msg.nbytes, msg.seconds)
                    if fix is not None:
                        log.warning("%s", fix)
                    if rec is not None:
                        nbytes = msg.nbytes
                        if rec.count > 1 and rec.holder is not None and rec.holder.devices[0] != d.key:
                            nbytes = max(nbytes, rec.measured)  # the largest shard plans the gang
                        resized = rec.measured != nbytes
                        rec.measured = nbytes
                        rec.failing = 0  # loaded: no longer broken
                        if lead:
                            rec.loads += 1
                            rec.load_seconds += msg.seconds
            elif msg.state is p.ModelState.LOAD_FAILED and entry is not None:
                holders = led.load_failed(msg.model, now)
                if rec is not None and rec.holder is not None and d.key in rec.holder.devices:
                    rec.holder.failed = True  # the other ranks' shards are partial: swept
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
                    rec.failing += 1
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
                        "in_use": e.in_use, "uses": e.uses, "pinned": e.pinned,
                        "load_s": e.load_seconds, "reload_s": e.reload_seconds,
                        **({"shards": list(e.shards)} if e.shards else {})})
        return out

    def counters(self, devices: Mapping[str, Device] | None = None) -> list[dict[str, Any]]:
        """Each model once; a sharded model with its gang and each device's shard bytes."""
        def shard_bytes(r: ModelRecord) -> dict[str, int] | None:
            if r.holder is None or devices is None:
                return None
            out = {}
            for k in r.holder.devices:
                e = devices[k].ledger.models.get(r.key) if k in devices else None
                if e is not None and e.state is not Residency.ABSENT:
                    out[k] = e.nbytes
            return out

        return [{"name": r.name, "shard_bytes": shard_bytes(r), "key": r.key, "bytes": r.size, "loads": r.loads, "count": r.count,
                 "gang": list(r.holder.devices) if r.holder is not None else None,
                 "mean_load_s": r.load_seconds / r.loads if r.loads else None,
                 "restores": r.restores,
                 "mean_restore_s": r.restore_seconds / r.restores if r.restores else None,
                 "offloads": r.offloads, "evictions": r.evictions, "failures": r.failures}
                for r in self.models.values()]
