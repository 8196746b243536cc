"""The scheduler's status report (what `gpufn status` renders), read from its books."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpufn import protocol as p
from gpufn.scheduler.states import InvState

if TYPE_CHECKING:
    from gpufn.scheduler.core import SchedulerCore


def report(core: SchedulerCore, now: float) -> dict[str, Any]:
    devices = []
    for d in sorted(core.devices.values(), key=lambda d: (d.info.node, d.info.index)):
        devices.append({
            "key": d.key, "name": d.info.name, "kind": d.info.kind, "state": d.state.value,
            "capacity": d.ledger.capacity, "used": d.ledger.used,
            "running": [{"id": i.id, "function": i.function.name,
                         "seconds": now - (i.started or now)} for i in d.running.values()],
            "completed": d.completed, "restarts": d.restarts, "last_error": d.last_error,
            "pid": d.worker_pid, "models": core.models.device_status(d),
            "group": list(core.gangs.held[d.key]) if d.key in core.gangs.held else None,
        })
    functions = [
        {"name": f.name, "function_id": f.function_id, "queued": core.queue.depth(fid),
         "calls": f.calls, "runtime_ewma": f.runtime_ewma}
        for fid, f in core.functions.items()
    ]
    return {
        "devices": devices,
        "functions": functions,
        "queued": len(core.queue),
        "running": sum(1 for i in core.invocations.values() if i.state is InvState.RUNNING),
        "clients": sum(1 for v in core.peers.values() if v.role == p.Role.CLIENT),
        "counters": core.counters.as_dict(),
        "models": core.models.counters(),
        "gangs": {"cold": core.gangs.cold_formations, "warm": core.gangs.warm_formations},
        "policy": core.policy.name,
    }
