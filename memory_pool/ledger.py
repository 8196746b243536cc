"""Per-device memory ledger kept by the scheduler: capacity, workspace reserved by running
invocations, shared models and their residency, and the admission planner over them.

All numbers are bytes and all times are the caller's clock (`now`): the ledger is pure
bookkeeping, so the scheduler's sans-I/O core can call it directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpufn.memory_pool.eviction import CostAwarePolicy, EvictionPolicy
from gpufn.memory_pool.residency import ModelEntry, Residency
from gpufn.wire.units import format_bytes

OVER_ESTIMATE = 1.25  # a measured size above estimate * this is worth a log line


@dataclass(frozen=True)
class ModelNeed:
    """One model an invocation needs, as declared by `@gpufn.model` (plus the caller's
    priority). `nbytes` is the best size known to the scheduler: a size measured on
    another device, else the declared estimate."""

    name: str
    nbytes: int = 0
    pinned: bool = False
    offload: bool = True
    priority: int = 0


@dataclass(frozen=True)
class Request:
    """What one invocation needs on a device: models and workspace bytes."""

    models: tuple[ModelNeed, ...] = ()
    workspace: int = 0
    function: str = ""

    def needs(self) -> list[ModelNeed]:
        """The models, one per name (a repeated name keeps its first declaration,
        with the highest priority among the repeats)."""
        out: dict[str, ModelNeed] = {}
        for m in self.models:
            if m.name in out:
                first = out[m.name]
                out[m.name] = ModelNeed(first.name, first.nbytes, first.pinned, first.offload,
                                        max(first.priority, m.priority))
            else:
                out[m.name] = m
        return list(out.values())


@dataclass(frozen=True)
class SizeCorrection:
    """A model measured well above its estimate (returned by `load_done` to log)."""

    name: str
    estimate: int
    measured: int

    def __str__(self) -> str:
        if self.estimate <= 0:
            return (f"model {self.name!r} measured {format_bytes(self.measured)} and declared "
                    f"no estimate; set @gpufn.model(memory=...) so placement can plan for it")
        over = (self.measured / self.estimate - 1) * 100
        return (f"model {self.name!r} measured {format_bytes(self.measured)}, {over:.0f}% over "
                f"its estimate of {format_bytes(self.estimate)}; the ledger now uses the "
                f"measured size (raise @gpufn.model(memory=...) to match)")


# ---------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class NeverFits:
    """The request cannot fit on this device even with every evictable model gone."""

    shortfall: int  # bytes missing (0 when the limit is a model count)
    required: int  # workspace + every needed model
    capacity: int
    pinned: int = 0  # bytes of other pinned models that never leave
    reason: str = ""

    def __str__(self) -> str:
        if self.reason:
            return self.reason
        pinned = f", {format_bytes(self.pinned)} of it pinned by other models" if self.pinned else ""
        return (f"needs {format_bytes(self.required)} (models + workspace) but the device has "
                f"{format_bytes(self.capacity)}{pinned}: short by {format_bytes(self.shortfall)}")


@dataclass(frozen=True)
class Fit:
    """How to admit one request on one device. Apply it with `DeviceLedger.admit`, then
    send the worker, in this order: drop_host, offload, evict, restore, load, run."""

    request: Request
    resident: tuple[str, ...]  # already on the device and usable
    waiting: tuple[str, ...]  # being loaded there now; the call runs once they are in
    load: tuple[str, ...]  # run the loader
    restore: tuple[str, ...]  # bring back from host memory
    offload: tuple[str, ...]  # idle models to copy to host memory and free
    evict: tuple[str, ...]  # idle models to drop
    drop_host: tuple[tuple[str, str], ...]  # (device key, model): host copies to drop
    load_bytes: int  # device bytes the loader will fill
    restore_bytes: int  # device bytes coming back from host
    freed_bytes: int  # device bytes the victims give back
    victim_value: float  # the policy's summed value of the victims (what is given up)
    free_after: int  # device bytes free once everything settles
    clock: float  # the ledger's eviction clock after the victims go
    version: tuple[int, int]  # (ledger, host ledger) versions planned against

    @property
    def cost(self) -> tuple[int, int, int, float, int]:
        """Sort key to rank devices, lowest best: models already resident, then
        offloaded to host, then in flight, then the least eviction."""
        return (self.load_bytes, self.restore_bytes, len(self.waiting),
                self.victim_value, self.freed_bytes)

    @property
    def victims(self) -> tuple[str, ...]:
        return self.offload + self.evict


class StaleFit(RuntimeError):
    """`admit` was given a plan made before the ledger last changed."""


# ---------------------------------------------------------------------------- host

@dataclass
class HostLedger:
    """Host memory budget for offloaded models, one per node (all of a node's workers
    share its RAM). Copies are keyed by (device key, model)."""

    capacity: int
    copies: dict[tuple[str, str], tuple[ModelEntry, int]] = field(default_factory=dict)
    version: int = 0

    @property
    def used(self) -> int:
        return sum(n for _, n in self.copies.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def hold(self, device: str, entry: ModelEntry) -> None:
        key = (device, entry.name)
        if key in self.copies:
            raise KeyError(f"host memory already holds model {entry.name!r} of {device}")
        self.copies[key] = (entry, entry.nbytes)
        self.version += 1

    def release(self, device: str, name: str) -> int:
        held = self.copies.pop((device, name), None)
        self.version += 1
        return 0 if held is None else held[1]

    def offloaded(self) -> list[tuple[str, ModelEntry]]:
        """(device key, entry) of every settled host copy: the ones that can be dropped."""
        return [(dev, e) for (dev, _), (e, _) in self.copies.items()
                if e.state is Residency.OFFLOADED]

    def drop(self, device: str, name: str, now: float) -> int:
        """Drop a host copy for good (the model becomes ABSENT); returns bytes freed."""
        entry, _ = self.copies[(device, name)]
        entry.to(Residency.ABSENT, now)
        return self.release(device, name)

    def release_device(self, device: str) -> int:
        """That device's worker restarted: its host copies died with it."""
        return sum(self.release(dev, name) for dev, name in list(self.copies) if dev == device)


# ---------------------------------------------------------------------------- device

@dataclass
class DeviceLedger:
    """Byte accounting and model residency for one device.

    `host` is the node's HostLedger (None: offloading is not limited); a ledger sharing
    one needs its device `key`. `policy` is the default for `plan`.
    """

    capacity: int
    workspace: dict[str, int] = field(default_factory=dict)
    models: dict[str, ModelEntry] = field(default_factory=dict)
    host: HostLedger | None = None
    key: str = ""
    policy: EvictionPolicy = field(default_factory=CostAwarePolicy)
    clock: float = 0.0
    holds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    version: int = 0
    _used_at: tuple[int, int] = field(default=(-1, -1), repr=False, compare=False)
    _used: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.host is not None and not self.key:
            raise ValueError("a DeviceLedger sharing a HostLedger needs its device key")

    # ----------------------------------------------------------- bytes

    @property
    def workspace_bytes(self) -> int:
        return sum(self.workspace.values())

    @property
    def model_bytes(self) -> int:
        """Bytes of models occupying the device (loading, resident, or on their way out)."""
        return sum(e.nbytes for e in self.models.values() if e.state.on_device)

    @property
    def used(self) -> int:
        # Read on every placement decision: cached until the ledger (or host) changes.
        v = self._version()
        if self._used_at != v:
            self._used_at, self._used = v, self.workspace_bytes + self.model_bytes
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def state(self, name: str) -> Residency:
        e = self.models.get(name)
        return Residency.ABSENT if e is None else e.state

    def reserve(self, owner: str, nbytes: int) -> None:
        """Reserve workspace for a running invocation (`admit` does this too)."""
        if owner in self.workspace:
            raise KeyError(f"workspace for {owner} is already reserved")
        self.workspace[owner] = nbytes
        self.version += 1

    def release(self, owner: str, now: float | None = None) -> int:
        """The invocation finished: free its workspace (returned) and its model holds."""
        for name in self.holds.pop(owner, ()):
            e = self.models.get(name)
            if e is not None:
                e.in_use = max(0, e.in_use - 1)
                if now is not None:
                    e.last_used = max(e.last_used, now)
        self.version += 1
        return self.workspace.pop(owner, 0)

    def reset(self, now: float = 0.0) -> None:
        """The worker restarted: nothing of the old process holds memory any more, so
        every model is ABSENT here and its host copies are gone too."""
        self.workspace.clear()
        self.holds.clear()
        for e in self.models.values():
            e.in_use = 0
            e.from_host = False
            if e.state is not Residency.ABSENT:
                e.to(Residency.ABSENT, now, force=True)
        if self.host is not None:
            self.host.release_device(self.key)
        self.version += 1

    # ----------------------------------------------------------- models

    def adopt(self, name: str, nbytes: int, now: float) -> None:
        """A model the device's worker already holds (it outlived a scheduler restart):
        RESIDENT with its measured size. It may not be offloaded until a function that
        names it says whether it may (`ModelNeed.offload`)."""
        e = self.models.get(name)
        if e is not None and e.state is not Residency.ABSENT:
            return
        if e is None:
            e = self.models[name] = ModelEntry(name, nbytes)
        e.offload_allowed = False
        e.to(Residency.LOADING, now)
        e.to(Residency.RESIDENT, now)
        e.nbytes, e.measured = nbytes, True
        self.version += 1

    def _entry(self, need: ModelNeed) -> ModelEntry:
        e = self.models.get(need.name)
        if e is None:
            e = self.models[need.name] = ModelEntry(need.name, need.nbytes)
        elif not e.measured and e.state is Residency.ABSENT:
            e.nbytes = need.nbytes
        e.pinned = need.pinned
        e.offload_allowed = need.offload
        return e

    def _get(self, name: str) -> ModelEntry:
        e = self.models.get(name)
        if e is None:
            raise KeyError(f"model {name!r} is not known on this device")
        return e

    def acquire(self, owner: str, needs: Sequence[ModelNeed], now: float,
                function: str = "") -> None:
        """`owner` (an invocation) uses these models: they cannot be evicted until
        `release(owner)`. Each must be resident or loading. Counts recency and frequency."""
        if owner in self.holds:
            raise KeyError(f"{owner} already holds models on this device")
        for need in needs:
            e = self._get(need.name)
            if e.state not in (Residency.RESIDENT, Residency.LOADING):
                raise ValueError(f"model {need.name!r} is {e.state.value}, not usable by {owner}")
        for need in needs:
            e = self.models[need.name]
            e.in_use += 1
            e.uses += 1
            e.last_used = now
            e.clock = self.clock
            e.priority = need.priority if e.uses == 1 else max(e.priority, need.priority)
            if function:
                e.users.add(function)
        self.holds[owner] = tuple(n.name for n in needs)
        self.version += 1

    def load_started(self, need: ModelNeed, now: float) -> ModelEntry:
        """The worker was told to run the loader: reserve the size (measured earlier on
        this device if known, else `need.nbytes`)."""
        e = self._entry(need)
        e.to(Residency.LOADING, now)
        e.from_host = False
        self.version += 1
        return e

    def load_done(self, name: str, now: float, nbytes: int,
                  seconds: float) -> SizeCorrection | None:
        """The loader finished: the measured size replaces the estimate. Returns a
        SizeCorrection to log when it is over 25% above the estimate."""
        e = self._get(name)
        if e.state is Residency.LOADING and e.from_host:
            raise ValueError(f"model {name!r} is being restored from host; call restore_done")
        estimate = e.nbytes
        e.to(Residency.RESIDENT, now)
        e.nbytes, e.measured, e.load_seconds = nbytes, True, seconds
        self.version += 1
        if nbytes > estimate * OVER_ESTIMATE:
            return SizeCorrection(name, estimate, nbytes)
        return None

    def load_failed(self, name: str, now: float) -> list[str]:
        """The loader (or a restore from host) failed: the model is ABSENT, its host copy
        is gone. Returns the owners holding it, which the caller fails or re-queues."""
        e = self._get(name)
        e.to(Residency.ABSENT, now)
        if e.from_host and self.host is not None:
            self.host.release(self.key, name)
        e.from_host = False
        self.version += 1
        return [owner for owner, names in self.holds.items() if name in names]

    def restore_started(self, name: str, now: float) -> None:
        """The worker was told to copy an offloaded model back: its bytes count on the
        device now; the host copy stays held until `restore_done`."""
        e = self._get(name)
        e.to(Residency.LOADING, now)
        e.from_host = True
        self.version += 1

    def restore_done(self, name: str, now: float, seconds: float) -> None:
        """The model is back on the device; records the host -> device time."""
        e = self._get(name)
        if not e.from_host:
            raise ValueError(f"model {name!r} is being loaded, not restored; call load_done")
        e.to(Residency.RESIDENT, now)
        e.from_host = False
        e.reload_seconds = seconds
        if self.host is not None:
            self.host.release(self.key, name)
        self.version += 1

    def _check_victim(self, e: ModelEntry) -> None:
        if e.pinned:
            raise ValueError(f"model {e.name!r} is pinned and cannot leave the device")
        if e.in_use:
            raise ValueError(f"model {e.name!r} is in use by {e.in_use} invocation(s)")

    def offload_started(self, name: str, now: float) -> None:
        """The worker was told to move an idle model to host memory (held there now;
        device bytes stay counted until `offload_done`)."""
        e = self._get(name)
        self._check_victim(e)
        if not e.offload_allowed:
            raise ValueError(f"model {name!r} was declared offload=False")
        e.to(Residency.OFFLOADING, now)
        if self.host is not None:
            self.host.hold(self.key, e)
        self.version += 1

    def offload_done(self, name: str, now: float) -> None:
        self._get(name).to(Residency.OFFLOADED, now)
        self.version += 1

    def offload_failed(self, name: str, now: float) -> None:
        """The worker could not copy the model to host and dropped it: ABSENT here."""
        self._get(name).to(Residency.ABSENT, now)
        if self.host is not None:
            self.host.release(self.key, name)
        self.version += 1

    def evict_started(self, name: str, now: float) -> None:
        """The worker was told to drop an idle model (device bytes counted until done)."""
        e = self._get(name)
        self._check_victim(e)
        e.to(Residency.EVICTING, now)
        self.version += 1

    def evict_done(self, name: str, now: float) -> None:
        self._get(name).to(Residency.ABSENT, now)
        self.version += 1

    def drop_host_copy(self, name: str, now: float) -> int:
        """Drop this device's host copy of an offloaded model; returns host bytes freed."""
        e = self._get(name)
        e.to(Residency.ABSENT, now)
        self.version += 1
        return 0 if self.host is None else self.host.release(self.key, name)

    # ----------------------------------------------------------- planning

    def fit(self, request: Request, policy: EvictionPolicy | None = None, *,
             forced: Mapping[str, bool] | None = None,
             blocked: Iterable[str] = ()) -> Fit | NeverFits | None:
        """How `request` fits here: a Fit, None if it cannot fit now but could once
        running calls finish or models settle, or NeverFits with the shortfall. Pure.

        `forced`: models that must leave whatever the room (name -> may go to host):
        sibling shards of a victim chosen on another device of a gang, or stale shards.
        `blocked`: models never chosen as victims here (a shard busy on another rank)."""
        policy = policy or self.policy
        forced = forced or {}
        needs = request.needs()
        needed = {n.name for n in needs}
        resident: list[str] = []
        waiting: list[str] = []
        load: list[str] = []
        restore: list[str] = []
        size: dict[str, int] = {}
        for n in needs:
            e = self.models.get(n.name)
            size[n.name] = e.nbytes if e is not None and e.measured else n.nbytes
            state = Residency.ABSENT if e is None else e.state
            if state in (Residency.OFFLOADING, Residency.EVICTING):
                return None  # on its way out; plan again once it settles
            {Residency.RESIDENT: resident, Residency.LOADING: waiting,
             Residency.OFFLOADED: restore, Residency.ABSENT: load}[state].append(n.name)

        others = [e for e in self.models.values() if e.name not in needed]
        pinned = [e for e in others if e.pinned and e.state.on_device]
        limit = policy.model_limit()
        if limit is not None and len(needs) + len(pinned) > limit:
            return NeverFits(0, 0, self.capacity, reason=(
                f"needs {len(needs)} models and {len(pinned)} pinned ones stay, but the "
                f"{policy.name} policy allows {limit} per device"))
        load_bytes = sum(size[n] for n in load)
        restore_bytes = sum(size[n] for n in restore)
        if policy.bytes_aware:
            required = request.workspace + sum(size.values())
            pinned_bytes = sum(e.nbytes for e in pinned)
            short = required + pinned_bytes - self.capacity
            if short > 0:
                return NeverFits(short, required, self.capacity, pinned_bytes)

        must: list[ModelEntry] = []
        for name, _ in sorted(forced.items()):
            e = self.models.get(name)
            if e is None or name in needed or not e.state.on_device:
                continue
            if not e.idle or e.pinned:
                return None  # it cannot leave now; plan again once it is idle
            must.append(e)
        stay = set(blocked) | set(forced)
        candidates = policy.order(e for e in others if e.idle and not e.pinned and e.name not in stay)
        victims: list[ModelEntry] = list(must)
        if limit is not None:
            occupying = sum(1 for e in self.models.values()
                            if e.state in (Residency.LOADING, Residency.RESIDENT))
            over = occupying + len(load) + len(restore) - limit
            if over > len(candidates):
                return None
            victims += candidates[:max(over - len(must), 0)]
        if policy.bytes_aware:
            deficit = request.workspace + load_bytes + restore_bytes - self.free
            deficit -= sum(v.nbytes for v in victims)
            if deficit > 0:
                extra = _cover(deficit, [c for c in candidates if c not in victims])
                if extra is None:
                    return None
                victims += extra

        offload, evict, drops = self._route_victims(victims, policy, needed, forced)
        clock = self.clock
        for v in victims:
            clock = policy.inflate(clock, v)
        freed = sum(v.nbytes for v in victims)
        add = request.workspace + load_bytes + restore_bytes
        return Fit(
            request=request, resident=tuple(resident), waiting=tuple(waiting),
            load=tuple(load), restore=tuple(restore), offload=tuple(offload),
            evict=tuple(evict), drop_host=tuple(drops), load_bytes=load_bytes,
            restore_bytes=restore_bytes, freed_bytes=freed,
            victim_value=sum(policy.value(v) for v in victims),
            free_after=self.free + freed - add, clock=clock, version=self._version(),
        )

    def _route_victims(self, victims: list[ModelEntry], policy: EvictionPolicy, needed: set[str],
                       forced: Mapping[str, bool]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
        """Offload each victim that may go to host memory (dropping the cheapest host
        copies when the budget is full), evict the rest. A shard's host copy is never
        dropped alone (its siblings would be left half a model): only with the group."""
        offload: list[str] = []
        evict: list[str] = []
        drops: list[tuple[str, str]] = []
        host_free = math.inf if self.host is None else float(self.host.free)
        droppable: list[tuple[str, ModelEntry]] = []
        if self.host is not None:
            droppable = sorted(
                ((dev, e) for dev, e in self.host.offloaded()
                 if not (dev == self.key and e.name in needed) and not e.shards),
                key=lambda p: (policy.value(p[1]), p[1].last_used, p[1].name, p[0]))
        for v in victims:
            if not (policy.offload and v.offload_allowed and forced.get(v.name, True)):
                evict.append(v.name)
                continue
            if v.nbytes > host_free:
                room = host_free + sum(e.nbytes for _, e in droppable)
                if v.nbytes > room:
                    evict.append(v.name)
                    continue
                while v.nbytes > host_free:
                    dev, e = droppable.pop(0)
                    drops.append((dev, e.name))
                    host_free += e.nbytes
            offload.append(v.name)
            host_free -= v.nbytes
        return offload, evict, drops

    def _version(self) -> tuple[int, int]:
        return (self.version, 0 if self.host is None else self.host.version)

    def admit(self, owner: str, plan: Fit, now: float, *, check: bool = True) -> None:
        """Commit a plan from `plan()` for invocation `owner`: host copies dropped, victims
        offloading/evicting, loads and restores started, workspace reserved, models held.
        `check=False`: the caller checked the versions itself (a gang's joint plan)."""
        if check and plan.version != self._version():
            raise StaleFit(f"plan for {owner} was made before the ledger changed; plan again")
        for dev, name in plan.drop_host:
            assert self.host is not None  # a plan only drops host copies when there is one
            self.host.drop(dev, name, now)
        for name in plan.offload:
            self.offload_started(name, now)
        for name in plan.evict:
            self.evict_started(name, now)
        self.clock = plan.clock
        needs = plan.request.needs()
        for name in plan.restore:
            self.restore_started(name, now)
        for need in needs:
            if need.name in plan.load:
                self.load_started(need, now)
        self.reserve(owner, plan.request.workspace)
        self.acquire(owner, needs, now, plan.request.function)

    def cost_to_place(self, request: Request,
                      policy: EvictionPolicy | None = None) -> tuple[int, int, int, float, int] | None:
        """`Fit.cost` of placing `request` here, or None when it does not fit now."""
        plan = self.fit(request, policy)
        return plan.cost if isinstance(plan, Fit) else None

    def describe(self) -> dict[str, object]:
        """A status snapshot: bytes and each model's residency."""
        return {
            "capacity": self.capacity, "used": self.used, "workspace": self.workspace_bytes,
            "models": {e.name: {"state": e.state.value, "nbytes": e.nbytes,
                                "measured": e.measured, "in_use": e.in_use, "uses": e.uses,
                                "pinned": e.pinned} for e in self.models.values()},
        }


def _cover(deficit: int, ordered: Iterable[ModelEntry]) -> list[ModelEntry] | None:
    """Victims, lowest value first, until `deficit` bytes are freed; then spare the most
    valuable ones that turned out unnecessary. None if all of them are not enough."""
    chosen: list[ModelEntry] = []
    freed = 0
    for e in ordered:
        if freed >= deficit:
            break
        chosen.append(e)
        freed += e.nbytes
    if freed < deficit:
        return None
    for e in reversed(list(chosen)):
        if freed - e.nbytes >= deficit:
            chosen.remove(e)
            freed -= e.nbytes
    return chosen


def choose_device(ledgers: Mapping[str, DeviceLedger], request: Request,
                  policy: EvictionPolicy | None = None) -> tuple[str, Fit] | NeverFits | None:
    """The device where `request` is cheapest to place (lowest `Fit.cost`, ties by most
    free bytes after, then key), None if none fits now, or — when no device could ever
    hold it — the NeverFits with the smallest shortfall (for `gpufn.Unschedulable`)."""
    best: tuple[str, Fit] | None = None
    never: list[NeverFits] = []
    for key in sorted(ledgers):
        plan = ledgers[key].fit(request, policy)
        if isinstance(plan, NeverFits):
            never.append(plan)
        elif plan is not None and (
                best is None or (plan.cost, -plan.free_after) < (best[1].cost, -best[1].free_after)):
            best = (key, plan)
    if best is not None:
        return best
    if never and len(never) == len(ledgers):
        return min(never, key=lambda n: n.shortfall)
    return None


# ---------------------------------------------------------------------------- gangs

@dataclass(frozen=True)
class GroupFit:
    """A request planned on every device of a gang at once, sharded models as units.

    `plans`: device key -> Fit (gang devices, rank order). `outside`: what must happen to
    sibling shards on devices outside the gang, as (device key, model, action) with action
    "offload", "evict" or "drop" (a host copy). `versions`: every ledger's version planned
    against (admit all or replan)."""

    plans: dict[str, Fit]
    outside: tuple[tuple[str, str, str], ...]
    versions: tuple[tuple[str, tuple[int, int]], ...]


def _group_blocked(ledgers: Mapping[str, DeviceLedger]) -> set[str]:
    """Shards that must stay everywhere: busy (in use, moving, pinned) on any rank."""
    blocked: set[str] = set()
    for led in ledgers.values():
        for e in led.models.values():
            if e.shards and e.state.on_device and (not e.idle or e.pinned):
                blocked.add(e.name)
    return blocked


def fit_group(ledgers: Mapping[str, DeviceLedger], gang: Sequence[str], request: Request,
               policy: EvictionPolicy | None = None,
               doomed: Mapping[str, bool] | None = None) -> GroupFit | NeverFits | None:
    """Fit `request` on every device of `gang` at once (all fit, or None: wait).

    Eviction is all-or-nothing: a shard chosen as a victim on one device takes its
    sibling shards along, on the gang's devices (planned again with them forced out, until
    nothing changes) and outside it; a shard busy on any rank blocks all of them; a group
    goes to host memory only if every shard does. `doomed` (name -> may offload) must leave
    whatever the room (stale shards, or a sharded model moving to another gang)."""
    forced: dict[str, bool] = dict(doomed or {})
    blocked = _group_blocked(ledgers) - set(forced)
    needed = {n.name for n in request.models}
    plans: dict[str, Fit] = {}
    for _ in range(len(gang) + 2):
        plans = {}
        for key in gang:
            plan = ledgers[key].fit(request, policy, forced=forced, blocked=blocked)
            if not isinstance(plan, Fit):
                return plan
            plans[key] = plan
        grown = dict(forced)
        for key, plan in plans.items():
            led = ledgers[key]
            for name in plan.victims:
                if led.models[name].shards:
                    grown[name] = grown.get(name, True) and name in plan.offload
        if grown == forced:
            break
        forced = grown
    else:
        return None
    if any(forced.values()) and not _host_fits(ledgers, gang, plans, forced):
        return fit_group(ledgers, gang, request, policy, dict.fromkeys(forced, False))
    outside: list[tuple[str, str, str]] = []
    for name, may_offload in sorted(forced.items()):
        if name in needed:
            continue
        for key, led in ledgers.items():
            if key in gang:
                continue
            e = led.models.get(name)
            if e is None or not e.shards:
                continue
            if e.state is Residency.OFFLOADED:
                outside.append((key, name, "drop"))
            elif e.state.on_device:
                if not e.idle or e.pinned:
                    return None
                outside.append((key, name, "offload" if may_offload and e.offload_allowed
                                and (led.policy.offload if policy is None else policy.offload)
                                else "evict"))
    versions = tuple((k, led._version()) for k, led in sorted(ledgers.items()))
    return GroupFit(plans, tuple(outside), versions)


def _host_fits(ledgers: Mapping[str, DeviceLedger], gang: Sequence[str], plans: Mapping[str, Fit],
               forced: Mapping[str, bool]) -> bool:
    """Whether every host ledger can take the offloads the plans (and forced shards
    outside the gang) send to it together (each plan checked only its own)."""
    need: dict[int, tuple[HostLedger, int]] = {}
    for key, led in ledgers.items():
        if led.host is None:
            continue
        names = set(plans[key].offload) if key in plans else {
            n for n, off in forced.items() if off and n in led.models and led.models[n].idle}
        nbytes = sum(led.models[n].nbytes for n in names)
        host, used = need.get(id(led.host), (led.host, 0))
        need[id(led.host)] = (host, used + nbytes)
    return all(used <= host.free for host, used in need.values())
