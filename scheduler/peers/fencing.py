"""Fencing by worker generation: a message from an older worker process of a device is
logged and ignored, never applied to its successor.

Each start of a device's worker is a new generation (the supervisor's incarnation,
sent in the worker's Hello and in the supervisor's exit notice). When the scheduler
loses a worker it fences that generation: the process may still be alive (frozen,
unreachable) and come back. Results, heartbeats and model events are fenced by the
connection they arrive on (a lost worker's connection is forgotten, and a forgotten
connection must say Hello again, which is refused here).
"""

from __future__ import annotations

import logging

from gpufn.exceptions import GpufnError, kind_of
from gpufn.scheduler.nouns.records import Device
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")


def fenced(d: Device, incarnation: int) -> bool:
    """A Hello from a generation that was replaced: refuse it (and have it killed)."""
    if incarnation and incarnation <= d.fenced:
        log.info("refusing hello of %s worker generation %d (fenced at %d)", d.key,
                 incarnation, d.fenced)
        return True
    return False


def refusal(d: Device, incarnation: int) -> p.Welcome:
    return p.Welcome(False, kind_of(GpufnError),
                     f"worker generation {incarnation} of {d.key} was replaced; it must exit")


def stale_exit(d: Device, msg: p.WorkerExited) -> bool:
    """An exit notice about an older generation than the device's current worker."""
    stale = (msg.incarnation < d.incarnation if msg.incarnation
             else d.worker is not None and msg.pid != d.worker_pid)
    if stale:
        log.info("ignoring exit notice of %s generation %d pid %d (current: %d pid %d)",
                 d.key, msg.incarnation, msg.pid, d.incarnation, d.worker_pid)
    return stale
