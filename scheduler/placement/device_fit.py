"""Where a call may run: device-type matching, feasibility, and single-device choice."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable

from gpufn.scheduler.nouns.records import Device, FunctionRecord, Invocation, drain_seconds
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.wire.spec import GpuSpec
from gpufn.wire.units import format_bytes

_TOKEN = re.compile(r"[a-z0-9]+")


def _tokens(s: str) -> list[str]:
    return _TOKEN.findall(s.lower())


@functools.lru_cache(maxsize=4096)  # asked per device per placement: a few types, a few names
def type_rank(types: tuple[str, ...], device_name: str) -> int | None:
    """Index of the first acceptable type the device matches (lower is preferred), or None.

    A type matches when all its tokens appear in the device name: "H100" matches
    "NVIDIA H100 80GB HBM3", "A100-80GB" matches "NVIDIA A100-SXM4-80GB", "A10" does
    not match "A100".
    """
    if not types:
        return 0
    have = set(_tokens(device_name))
    for i, t in enumerate(types):
        want = _tokens(t)
        if want and all(w in have for w in want):
            return i
    return None


def could_ever_run(spec: GpuSpec, device: Device, model_bytes: int = 0) -> bool:
    """True if the device, empty, could run one rank of the spec."""
    return (
        device.state.schedulable_later
        and type_rank(spec.type, device.info.name) is not None
        and spec.memory + model_bytes <= device.ledger.capacity
    )


def feasibility_error(
    spec: GpuSpec, name: str, devices: Iterable[Device], model_bytes: int = 0
) -> str | None:
    """Why no set of registered devices can ever run this spec, or None if some can."""
    devs = list(devices)
    if not devs:
        return None  # nothing registered yet: wait for devices rather than refuse
    ok = [d for d in devs if could_ever_run(spec, d, model_bytes)]
    by_node: dict[str, int] = {}
    for d in ok:
        by_node[d.info.node] = by_node.get(d.info.node, 0) + 1
    one_node = Shape.of(spec).one_node
    usable = max(by_node.values(), default=0) if one_node else len(ok)  # for a multi-device call
    if ok and (spec.count == 1 or usable >= spec.count):
        return None
    listing = ", ".join(
        f"{d.key} {d.info.name!r} {format_bytes(d.ledger.capacity)} ({d.state.value})" for d in devs
    )
    need = spec.describe()
    if model_bytes:
        need += f" plus {format_bytes(model_bytes)} of model weights"
    fixes = []
    if spec.type and not any(type_rank(spec.type, d.info.name) is not None for d in devs):
        fixes.append(f"no device matches type={list(spec.type)}; use one of the names listed")
    simulated = all(d.info.kind == "cpu" for d in devs)
    biggest = max(d.ledger.capacity for d in devs)
    if spec.memory + model_bytes > biggest:
        over = spec.memory + model_bytes - biggest
        gib = math.ceil((spec.memory + model_bytes) / 2**30)
        fix = (f"lower memory=, or, as these are simulated devices, give them more with "
               f"GPUFN_DEVICE_MEMORY={gib}GiB (`gpufn serve --device-memory {gib}GiB`)"
               if simulated else "lower memory= or add larger devices")
        fixes.append(
            f"the largest device has {format_bytes(biggest)}, {format_bytes(over)} too little: {fix}"
        )
    if spec.count > 1 and len(ok) < spec.count:
        where = " on one node" if one_node else ""
        fix = (f"lower count=, or, as these are simulated devices, start {spec.count} with "
               f"GPUFN_CPU_DEVICES={spec.count} (`gpufn serve --cpu-devices {spec.count}`)"
               if simulated else "lower count= or add devices")
        fixes.append(f"count={spec.count} but only {usable} suitable devices exist{where}: {fix}")
    if not fixes:
        fixes.append("no registered device is healthy")
    return f"{name} needs {need}, which no device can provide: {'; '.join(fixes)}. Devices: {listing}."


def has_slot(d: Device, spec: GpuSpec, code: str, slots: int) -> bool:
    """Whether a call of this function may take a slot on `d` (of `slots` per device):
    each call holds one, but the calls of a function declared with a concurrency above
    `slots` hold one together (`Device.slots_held`), so two models' batches and plain
    calls share a device; that function's own bound is its concurrency."""
    if spec.concurrency > slots and d.running_by_fn.get(code, 0):
        return True
    return d.slots_held(slots) < slots


def rank_devices(
    spec: GpuSpec, fn: FunctionRecord, devices: Iterable[Device], slots: int,
    pipeline_depth: int = 0, check_memory: bool = True, now: float = 0.0,
    drains: dict[str, float] | None = None, shared_only: bool = False,
) -> list[Device]:
    """Devices that can start one rank of this function now, best first.

    `pipeline_depth` lets that many more calls wait at a worker beyond `concurrency`
    (for short calls, so the worker never idles through a scheduler round trip). A device
    running a rank of a multi-device call is that call's alone: one slow neighbour would
    slow every rank.
    `drains`, when given, caches `drain_seconds` per device key for this `now`;
    `shared_only`: the caller passes no device that runs a multi-device call.
    `slots` bounds the calls on a device (`has_slot`).
    Preference: the earliest acceptable type, then the earliest expected finish (what
    runs there, drained by measured run times, plus this call's run time measured on
    that device: faster devices get more calls), then fewer calls, then free memory.
    """
    scored = []
    code, limit, types, memory = fn.code_id, spec.concurrency + pipeline_depth, spec.type, spec.memory
    for d in devices:
        running = d.running
        if not d.takes_work or not has_slot(d, spec, code, slots):
            continue
        if running and (d.running_by_fn.get(code, 0) >= limit or (not shared_only and any(
                other.shape.multi_device for other in running.values()))):
            continue
        rank = type_rank(types, d.info.name) if types else 0
        if rank is None or (check_memory and d.ledger.free < memory):
            continue
        drain = 0.0
        if running:
            if drains is None:
                drain = drain_seconds(d, now)
            else:  # the caller's cache for this `now` (it drops what it changed)
                got = drains.get(d.info.key)
                drain = drains[d.info.key] = drain_seconds(d, now) if got is None else got
        finish = drain + (fn.estimate(d.key) or 0.0)
        scored.append((rank, finish, len(d.running), -d.ledger.free, d.key, d))
    scored.sort(key=lambda s: s[:5])
    return [s[-1] for s in scored]


MIN_PIPELINE_DEPTH = 2


def pipeline_depth(fn: FunctionRecord, seconds: float, most: int) -> int:
    """How many more of a short function's calls may wait at a worker beyond its
    concurrency: as many as run in `seconds` by its measured time, at least 2 (one
    round trip hidden), at most `most`."""
    ewma = fn.runtime_ewma or 0.0
    fits = int(seconds / ewma) if ewma > 0 else most
    return min(most, max(MIN_PIPELINE_DEPTH, fits))


def is_short(inv: Invocation, threshold: float) -> bool:
    """A call measured shorter than `threshold`: it may run inline on the worker's main
    thread and be pipelined behind another (single-device, concurrency 1 only)."""
    s = inv.spec
    return s.concurrency == 1 and s.count == 1 and inv.function.is_short(threshold)


def gang_inline(inv: Invocation, threshold: float, warm: bool) -> bool:
    """A gang measured shorter than `threshold` whose group is already formed (`warm`: no
    join, which may wait for peers for long): its ranks run inline on their workers' main
    threads, saving two thread hand-offs per rank (never pipelined: a gang takes idle devices)."""
    return warm and inv.spec.concurrency == 1 and inv.function.is_short(threshold)
