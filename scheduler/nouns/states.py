"""State machines as data: invocation and device states with explicit transition tables.

An illegal transition raises `IllegalTransition` carrying the object's history, so a
scheduling bug surfaces with the path that led to it instead of as a silent corruption.
"""

from __future__ import annotations

from enum import Enum


class IllegalTransition(RuntimeError):
    pass


class InvState(Enum):
    # Members are compared by identity: hash them so too (Enum's own hash runs Python
    # code, and the transition tables hash states several times per call).
    __hash__ = object.__hash__

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


INV_TRANSITIONS: dict[InvState, frozenset[InvState]] = {
    InvState.QUEUED: frozenset({InvState.RUNNING, InvState.FAILED, InvState.CANCELLED}),
    # RUNNING -> QUEUED: retried after a lost worker, or preempted.
    InvState.RUNNING: frozenset(
        {InvState.SUCCEEDED, InvState.FAILED, InvState.CANCELLED, InvState.QUEUED}
    ),
    InvState.SUCCEEDED: frozenset(),
    InvState.FAILED: frozenset(),
    InvState.CANCELLED: frozenset(),
}


class DeviceState(Enum):
    """A device's worker, as the scheduler sees it."""

    __hash__ = object.__hash__

    STARTING = "starting"      # announced by its supervisor, worker not connected yet
    READY = "ready"            # worker connected and taking work
    RESTARTING = "restarting"  # worker killed or died; supervisor is starting a new one
    FAILED = "failed"          # worker cannot start; supervisor gave up
    GONE = "gone"              # its supervisor left

    @property
    def schedulable_later(self) -> bool:
        return self in (DeviceState.STARTING, DeviceState.READY, DeviceState.RESTARTING)


DEVICE_TRANSITIONS: dict[DeviceState, frozenset[DeviceState]] = {
    DeviceState.STARTING: frozenset(
        {DeviceState.READY, DeviceState.RESTARTING, DeviceState.FAILED, DeviceState.GONE}
    ),
    # -> STARTING: its supervisor registered it again (a restarted supervisor or scheduler).
    DeviceState.READY: frozenset({DeviceState.RESTARTING, DeviceState.GONE, DeviceState.STARTING}),
    DeviceState.RESTARTING: frozenset(
        {DeviceState.READY, DeviceState.RESTARTING, DeviceState.FAILED, DeviceState.GONE,
         DeviceState.STARTING}
    ),
    DeviceState.FAILED: frozenset(
        {DeviceState.READY, DeviceState.RESTARTING, DeviceState.GONE, DeviceState.STARTING}
    ),
    DeviceState.GONE: frozenset({DeviceState.STARTING}),
}


def check(
    what: str, table: dict, old: Enum, new: Enum, history: list[tuple[str, float]]
) -> None:
    if new not in table[old]:
        trail = " -> ".join(f"{s}@{t:.3f}" for s, t in history[-12:])
        raise IllegalTransition(f"{what}: {old.value} -> {new.value} is not allowed (history: {trail})")
