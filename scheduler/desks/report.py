"""The scheduler's status report (what `gpufn status` renders), read from its books."""

from __future__ import annotations

from typing import Any, Protocol

from gpufn.memory_pool.eviction import EvictionPolicy
from gpufn.scheduler.books.gang_book import GangBook
from gpufn.scheduler.desks.lease_desk import LeaseDesk
from gpufn.scheduler.desks.ops import OpsDesk
from gpufn.scheduler.desks.surface import CoreView
from gpufn.scheduler.nouns.settings import Counters
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p


class Reported(CoreView, Protocol):
    """What the report reads beyond a desk's view."""

    counters: Counters
    gangs: GangBook
    policy: EvictionPolicy
    ops: OpsDesk
    leases: LeaseDesk


def report(core: Reported, now: float) -> dict[str, Any]:
    devices = []
    for d in sorted(core.devices.values(), key=lambda d: (d.info.node, d.info.index)):
        devices.append({
            "key": d.key, "name": d.info.name, "kind": d.info.kind, "state": d.state.value,
            "capacity": d.ledger.capacity, "used": d.ledger.used,
            "running": [{"id": i.id, "function": i.function.name, "user": i.user,
                         "seconds": now - (i.started or now)} for i in d.running.values()],
            "completed": d.completed, "restarts": d.restarts, "last_error": d.last_error,
            "pid": d.worker_pid, "models": core.models.device_status(d),
            "group": list(core.gangs.held[d.key]) if d.key in core.gangs.held else None,
        })
    functions = [
        {"name": f.name, "function_id": f.function_id, "queued": core.queue.depth(fid),
         "calls": f.calls, "runtime_ewma": f.runtime_ewma, "app": f.app, "version": f.version,
         "model_keys": list(f.model_keys)}
        for fid, f in core.functions.items()
    ]
    return {
        "devices": devices,
        "functions": functions,
        "queued": len(core.queue),
        "running": sum(1 for i in core.invocations.values() if i.state is InvState.RUNNING),
        "clients": sum(1 for v in core.peers.values() if v.role == p.Role.CLIENT),
        "counters": core.counters.as_dict(),
        "models": core.models.counters(core.devices),
        "gangs": {"cold": core.gangs.cold_formations, "warm": core.gangs.warm_formations},
        "policy": core.policy.name,
        "queue_by_priority": queue_by_priority(core),
        "hosts": hosts(core),
        "draining": core.ops.draining,
        # Calls straight to workers (desks/lease_desk.py): leases open now, granted so
        # far, and the calls their Results reported.
        "leases": {"open": len(core.leases.open), "granted": core.leases.granted,
                   "calls": core.leases.leased_calls},
    }


def queue_by_priority(core: CoreView) -> list[dict[str, Any]]:
    """Queued calls per function and priority, highest priority first (a counter, no scan)."""
    rows = []
    for (fid, prio), n in core.queue.depth_by_priority().items():
        f = core.functions.get(fid)
        rows.append({"function": f.name if f else fid, "app": f.app if f else "",
                     "version": f.version if f else 0, "priority": prio, "queued": n})
    return sorted(rows, key=lambda r: (-r["priority"], r["app"], r["function"]))


def hosts(core: CoreView) -> list[dict[str, Any]]:
    """Per host: its workers by state, devices, and whether its supervisor is connected."""
    out: dict[str, dict[str, Any]] = {}
    for d in core.devices.values():
        h = out.setdefault(d.info.node, {"host": d.info.node, "devices": 0, "workers": {},
                                         "connected": False})
        h["devices"] += 1
        h["workers"][d.state.value] = h["workers"].get(d.state.value, 0) + 1
        h["connected"] = h["connected"] or d.supervisor in core.peers
    return sorted(out.values(), key=lambda h: h["host"])
