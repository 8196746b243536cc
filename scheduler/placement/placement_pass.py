"""One scheduling pass: reads the queue, the devices and the model book, and yields
decisions (dispatch, preempt, fail as unschedulable, wake later) that the core applies.

Decisions are yielded one at a time and the core applies each before the pass goes on,
so every later choice in the same pass sees the devices as they now are.

Queue heads are taken best-first. A single-device call goes to the best ranked device;
a multi-device call (a gang) gets `count` idle devices chosen close together, all at
once or not at all. When the best gang cannot start, it reserves the devices that will
drain soonest; other calls may use those only if they will finish before it could start.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpufn.memory_pool.ledger import Fit
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books import batches
from gpufn.scheduler.books.model_book import ModelBook
from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.books.users import DeviceCaps
from gpufn.scheduler.nouns.records import Device, Invocation
from gpufn.scheduler.nouns.settings import SchedulerConfig
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import InvState
from gpufn.scheduler.placement.affinity import Affinity
from gpufn.scheduler.placement.device_fit import (
    could_ever_run,
    has_slot,
    is_short,
    pipeline_depth,
    rank_devices,
    type_rank,
)
from gpufn.scheduler.placement.gang_choice import (
    Reservation,
    can_backfill,
    choose_gang,
    reservation_for,
)
from gpufn.scheduler.placement.open_index import OpenIndex, estimate_bounds

# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Start the queue head `inv` (for a batched function: a batch led by it) on these
    devices, admitting its models by `plans` (device key -> plan) where it has any."""

    inv: Invocation
    devices: tuple[Device, ...]
    plans: dict[str, Fit] = field(default_factory=dict)
    batch: bool = False


@dataclass(frozen=True, slots=True)
class Preempt:
    """Stop the preemptible `victim` on `device` and queue it again, for `beneficiary`."""

    victim: Invocation
    device: Device
    beneficiary: Invocation


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """The queued call can never run (its models at their learned sizes fit nowhere)."""

    inv: Invocation
    reason: str


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Run a pass again at this time although nothing arrives (a batch's wait ends)."""

    when: float


@dataclass(frozen=True, slots=True)
class NeedRendezvous:
    """A gang waits for the rendezvous store, which the shell starts on request."""


Decision = Dispatch | Preempt | Unplaceable | WakeAt | NeedRendezvous


# --------------------------------------------------------------------------- the pass


def _open(d: Device, slots: int) -> bool:
    """Whether the device could start something now: a worker, a free slot (or a stepped
    engine's batch there, which may take more of its own calls: `has_slot`), and no rank
    of a multi-device call (such a device is that call's alone)."""
    running = d.running
    return d.takes_work and (d.slots_held(slots) < slots or d.steps_batch(slots)) and not (
        running and any(i.shape.multi_device for i in running.values()))


class PlacementPass:
    def __init__(self, config: SchedulerConfig, devices: dict[str, Device], queue: ReadyQueue,
                 models: ModelBook) -> None:
        self.config = config
        self.devices = devices
        self.queue = queue
        self.models = models
        self.caps: DeviceCaps | None = None  # per-user device caps (set by the core)
        self.affinity = Affinity()  # the device each affinity key last ran on
        self._open: dict[str, Device] = {}  # this pass's devices with a free slot
        self._index: OpenIndex | None = None  # the same, ordered for single-device choice
        self._estimates: dict[str, tuple[object, float, bool]] = {}  # see estimate_bounds
        self._preemptible: bool | None = None
        self._placed_on: tuple[Device, ...] = ()  # the devices of the last dispatch
        self._drains: dict[str, float] = {}
        self._backfill_checked: Reservation | None = None  # _only_backfill_left's answer for
        self._backfill_possible = False

    def run(self, now: float, rendezvous_port: int | None) -> Iterator[Decision]:
        if not len(self.queue):
            return
        backoff_ends = self.queue.release(now)  # retries whose backoff ended become eligible
        if backoff_ends is not None:
            yield WakeAt(backoff_ends)
        capped = self.caps is not None and self.caps.begin(self.devices.values())
        if self.caps is not None and self.queue.held_users():
            self._unhold()  # with no cap left (changed, or the user revoked) all go back
        # The devices with a free slot, once per pass (O(devices)); every choice below
        # looks only at these, and a device leaves the list as it fills.
        slots = self.config.slots_per_device
        self._open = {d.key: d for d in self.devices.values() if _open(d, slots)}
        self._index = None  # built when first needed
        self._preemptible = None  # computed when first needed
        self._drains = {}  # drain_seconds per device at this `now` (see rank_devices)
        self._backfill_checked = None
        if self._full():
            return
        reservation: Reservation | None = None
        owner: Invocation | None = None
        order = self.queue.ordered()
        for fid in order:
            inv = self.queue.head(fid)
            if inv is None:
                continue
            if inv.not_before > now:  # a retry in its backoff (its function waits behind it)
                yield WakeAt(inv.not_before)
                continue
            if capped and self.caps is not None and not self.caps.admits(inv):
                self.queue.hold(inv)  # its user is at their device cap: it waits aside
                continue
            if inv.spec.count > 1:
                reserved = reservation.devices if reservation and owner is not inv else ()
                placed = yield from self._gang(inv, reserved, rendezvous_port, now)
                if not placed and reservation is None:
                    reservation, owner = self._reserve(inv, now), inv
            else:
                placed = yield from self._single(inv, now, reservation)
            if not placed:
                if reservation is not None and self._only_backfill_left(reservation):
                    order.close()
                    return  # every open device is the gang's and nothing may backfill
                continue  # this function is blocked for the rest of the pass
            if capped and self.caps is not None:
                self.caps.took(inv)
            if inv.spec.affinity and len(self._placed_on) == 1:
                self.affinity.ran(inv.function.code_id, inv.spec.affinity, self._placed_on[0].key)
            for d in self._placed_on:  # only the devices it just used changed
                self._drains.pop(d.key, None)
                still = _open(d, slots)
                if not still:
                    self._open.pop(d.key, None)
                if self._index is not None:
                    self._index.update(d, still)
            if self._full():
                order.close()
                return  # the rest of the queue cannot start now: a pass costs O(placed)

    def _unhold(self) -> None:
        """Calls set aside at their user's device cap go back while there is room."""
        assert self.caps is not None
        for user in self.queue.held_users():
            self.queue.unhold(user, self.caps.room(user))

    def _only_backfill_left(self, r: Reservation) -> bool:
        """Whether nothing else can start in this pass: every open device is reserved for
        the gang, nothing is preemptible, and no queued function's measured run time fits
        before the gang could start (then visiting each blocked function is wasted)."""
        if self._any_unreserved(r) or self._any_preemptible():
            return False
        if self._backfill_checked is r:
            return not self._backfill_possible
        possible = False
        for fid in self.queue.functions():
            head = self.queue.head(fid)
            if head is not None and head.spec.count == 1 and can_backfill(
                    head.function.runtime_ewma, r.start_eta):
                possible = True
                break
        self._backfill_checked, self._backfill_possible = r, possible
        return not possible

    def _any_unreserved(self, r: Reservation) -> bool:
        """Whether an open device lies outside the reservation (O(gang size))."""
        return len(self._open) > sum(1 for k in set(r.devices) if k in self._open)

    def _open_index(self, now: float) -> OpenIndex:
        if self._index is None:
            self._index = OpenIndex(list(self._open.values()), now, self._drains)
        return self._index

    def _full(self) -> bool:
        """Every device is full and nothing could be preempted: no call can start."""
        return not self._open and not self._any_preemptible()

    def _any_preemptible(self) -> bool:
        """Whether a preemptible call runs anywhere (once per pass: O(running))."""
        if self._preemptible is None:
            self._preemptible = any(i.spec.preemptible for d in self.devices.values()
                                    for i in d.running.values())
        return self._preemptible

    # ------------------------------------------------------------------ single device

    def _no_plan(self, inv: Invocation, fn: Any, spec: Any) -> Generator[Decision, None, bool]:
        """No device may take the call with its models now: Unplaceable if none ever can
        (True: finished, the next call of the function may go), else it waits (False: by
        choice, a resident device frees soon, or for room)."""
        reason = self.models.never_fits(fn, spec.memory, self.devices.values())
        if reason is None:
            return False
        self._placed_on = ()
        yield Unplaceable(inv, reason)
        return True

    def _single(self, inv: Invocation, now: float,
                r: Reservation | None) -> Generator[Decision, None, bool]:
        spec, fn = inv.spec, inv.function
        if spec.batch_size is not None:
            when = batches.due(self.queue, inv)
            if when is not None and now < when:
                yield WakeAt(when)
                return False
        short = is_short(inv, self.config.short_call_seconds)
        depth = (pipeline_depth(fn, self.config.pipeline_seconds, self.config.pipeline_depth)
                 if short else 0)
        with_models = bool(fn.model_keys)
        # It may use the gang's reserved devices only as backfill that ends in time.
        kept_off: tuple[str, ...] = ()
        if r is not None and not can_backfill(fn.runtime_ewma, r.start_eta):
            kept_off = r.devices
            if not self._any_unreserved(r) and not self._any_preemptible():
                return False  # a blocked function costs O(1) here
        if inv.lost_on:  # a retry: the full ranking (another device than where it was lost)
            return (yield from self._single_ranked(inv, now, kept_off, depth))
        # Where "no device at all could take it" (then: preempt) is decided: the devices
        # outside the reservation, or all open ones when none is outside.
        scope_off = kept_off if r is not None and kept_off and self._any_unreserved(r) else ()
        index = self._open_index(now)
        limit = spec.concurrency + depth
        slots, code = self.config.slots_per_device, fn.code_id
        off = set(kept_off)
        usable: Callable[[Device], bool] = lambda d: (  # noqa: E731
            inv.id not in d.running and d.key not in off and has_slot(d, spec, code, slots))
        if spec.affinity and (yield from self._affine(inv, index, limit, usable, now)):
            return True
        plans: dict[str, Fit] = {}
        if not with_models:
            lo, uniform = estimate_bounds(fn, self._estimates)
            chosen = index.best(fn, spec.type, limit, spec.memory, lo, uniform, usable)
            if chosen is None:
                yield from self._nothing_ranked(inv, now, index, limit, scope_off, memory=spec.memory)
                return False
        else:
            walk = index.by_drain(spec.type, fn.code_id, limit, usable)
            first = next(walk, None)
            if first is None:
                yield from self._nothing_ranked(inv, now, index, limit, scope_off, memory=0)
                return False
            code = fn.code_id

            def is_candidate(d: Device) -> bool:
                return d.key in index and usable(d) and index.ranks(d, spec.type, code, limit)

            best = self.models.best_plan_by_drain(
                inv, itertools.chain((first,), walk), is_candidate, self.devices.values(), now)
            if best is None:
                return (yield from self._no_plan(inv, fn, spec))
            chosen, plans = best[0], {best[0].key: best[1]}
        self._placed_on = (chosen,)
        yield Dispatch(inv, (chosen,), plans, batch=spec.batch_size is not None)
        return True

    def _affine(self, inv: Invocation, index: OpenIndex, limit: int,
                usable: Callable[[Device], bool], now: float) -> Generator[Decision, None, bool]:
        """A call naming an affinity key: to the key's device if it can take it now and
        is not much busier than the others that could (`Affinity.choose`)."""
        spec, fn = inv.spec, inv.function
        with_models = bool(fn.model_keys)
        could = [d for d in self._open.values()
                 if d.key in index and usable(d) and index.ranks(d, spec.type, fn.code_id, limit)
                 and (with_models or d.ledger.free >= spec.memory)]
        home = self.affinity.choose(fn.code_id, spec.affinity, could, spec.concurrency)
        if home is None:
            return False
        plans: dict[str, Fit] = {}
        if with_models:
            best = self.models.best_plan(inv, [home], self.devices.values(), now)
            if best is None:
                return False
            plans = {home.key: best[1]}
        self._placed_on = (home,)
        yield Dispatch(inv, (home,), plans, batch=spec.batch_size is not None)
        return True

    def _nothing_ranked(self, inv: Invocation, now: float, index: OpenIndex, limit: int,
                        scope_off: tuple[str, ...], memory: int) -> Iterator[Decision]:
        """No usable device: when none in scope could take it at all, make room if allowed."""
        off = set(scope_off)
        lo, uniform = estimate_bounds(inv.function, self._estimates)
        slots, spec, code = self.config.slots_per_device, inv.spec, inv.function.code_id
        if index.best(inv.function, inv.spec.type, limit, memory, lo, uniform,
                      lambda d: d.key not in off and has_slot(d, spec, code, slots)) is None:
            preempt = self._preemption(inv, now)
            if preempt is not None:
                yield preempt

    def _single_ranked(self, inv: Invocation, now: float, kept_off: tuple[str, ...],
                       depth: int) -> Generator[Decision, None, bool]:
        """`_single` by a full ranking of the open devices (a retry's device order)."""
        spec, fn = inv.spec, inv.function
        with_models = bool(fn.model_keys)
        candidates = list(self._open.values())
        if kept_off:
            unreserved = [d for d in candidates if d.key not in kept_off]
            if unreserved:
                candidates = unreserved  # else the full path decides about preemption
        ranked = rank_devices(spec, fn, candidates, self.config.slots_per_device,
                              depth, check_memory=not with_models, now=now, drains=self._drains,
                              shared_only=True)
        if not ranked:  # no device could take it now at all: make room if that is allowed
            preempt = self._preemption(inv, now)
            if preempt is not None:
                yield preempt
            return False
        usable = [d for d in ranked if inv.id not in d.running and d.key not in kept_off]
        plans: dict[str, Fit] = {}
        if with_models and usable:
            best = self.models.best_plan(inv, usable, self.devices.values(), now)
            if best is None:
                return (yield from self._no_plan(inv, fn, spec))
            usable, plans = [best[0]], {best[0].key: best[1]}
        if not usable:
            return False
        usable.sort(key=lambda d: d.key in inv.lost_on)
        self._placed_on = (usable[0],)
        yield Dispatch(inv, (usable[0],), plans, batch=spec.batch_size is not None)
        return True

    # ------------------------------------------------------------------ preemption

    def _preemption(self, inv: Invocation, now: float) -> Preempt | None:
        """A running preemptible call of lower priority to stop so this call would then
        fit; it goes back to the queue (keeping its place) and runs again from the start."""
        if inv.preempt_asked is not None and now - inv.preempt_asked < self.config.stop_grace_seconds:
            return None  # a call preempted for it is still stopping
        spec = inv.spec
        if not self._any_preemptible() or not any(
                i.spec.preemptible and i.spec.priority < spec.priority
                for d in self.devices.values() for i in d.running.values()):
            return None
        best: tuple[tuple[Any, ...], Device, Invocation] | None = None
        for d in self.devices.values():
            if not d.takes_work or type_rank(spec.type, d.info.name) is None:
                continue
            for victim in d.running.values():
                vs = victim.spec
                if (victim.state is not InvState.RUNNING or not vs.preemptible
                        or vs.priority >= spec.priority or victim.shape.multi_device
                        or victim.id in d.stopping or victim.members
                        or victim.items):  # a stream that delivered values cannot restart
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
            return None
        return Preempt(best[2], best[1], inv)

    # ------------------------------------------------------------------ gangs

    def _gang_capable(self, inv: Invocation) -> list[Device]:
        return [d for d in self.devices.values()
                if d.takes_work and could_ever_run(inv.spec, d)]

    def _gang(self, inv: Invocation, reserved: tuple[str, ...], rendezvous_port: int | None,
              now: float) -> Generator[Decision, None, bool]:
        spec, fn = inv.spec, inv.function
        shape = Shape.of(spec)
        if shape.needs_rendezvous and rendezvous_port is None:
            yield NeedRendezvous()  # the shell starts the store, then schedules again
            return False
        idle = [d for d in self._open.values() if not d.running and d.key not in reserved
                and could_ever_run(spec, d)
                and (fn.model_keys or d.ledger.free >= spec.memory)]  # models: planned below
        fresh = [d for d in idle if d.key not in inv.lost_on]
        if inv.lost_on and len(fresh) >= spec.count:  # a retry: away from where it was lost
            idle = fresh
        prefer: tuple[str, ...] = tuple(fn.warm_gang)
        if fn.model_keys:  # sharded models: their holding gang first, or wait for it
            choice = self.models.gang_choice(inv, {d.key for d in idle}, self.devices, now)
            if choice is None:
                return False
            prefer, avoid = choice
            idle = [d for d in idle if d.key not in avoid]
        chosen = choose_gang([d.info for d in idle], spec.count, prefer=prefer)
        if chosen is None or (shape.one_node and len({c.node for c in chosen}) > 1):
            return False
        devices = tuple(self.devices[c.key] for c in chosen)
        plans: dict[str, Fit] = {}
        if fn.model_keys:
            found = self.models.gang_plans(inv, list(devices), self.devices)
            if found is None:
                return False
            plans = found
        self._placed_on = devices
        yield Dispatch(inv, devices, plans)
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
