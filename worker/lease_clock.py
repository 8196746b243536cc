"""Timeouts of calls under leases, kept on their worker: the scheduler never sees such a
call start or end, so it cannot time it (`scheduler/calls/timers.py` times the rest).

A call past its timeout is interrupted (a `Timeout` raised in its thread, as a cancel
raises `Cancelled`); one still running `grace` seconds later (stuck in native code, or it
swallowed the exception) is reported to the scheduler, which fails it at its client and
restarts the worker, as it does at once for a scheduled call past its timeout (said again
each `grace` while it runs: the scheduler may have been restarting). Thread-safe: the
main thread starts and ends calls, the control thread (which runs while user code holds
the main thread) asks what is due.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gpufn.exceptions import Timeout, kind_of
from gpufn.wire import protocol as p

RECHECK_SECONDS = 0.05  # an interrupt that found its call not running yet is tried again


@dataclass(slots=True)
class Timed:
    """One running call with a timeout."""

    invocation_id: str
    lease_id: str
    name: str
    timeout: float
    started: float
    dispatch_token: int
    interrupted: float | None = None  # when its Timeout was raised in it
    reported: float | None = None  # when it was last reported as not stopping
    next_try: float = 0.0  # not running yet when last tried: try again from then


class LeaseClock:
    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._calls: dict[str, Timed] = {}
        self._lock = threading.Lock()

    def started(self, invocation_id: str, lease_id: str, name: str, timeout: float | None,
                now: float, dispatch_token: int) -> None:
        if timeout is None:
            return
        with self._lock:
            self._calls[invocation_id] = Timed(invocation_id, lease_id, name, timeout, now,
                                               dispatch_token)

    def ended(self, invocation_id: str) -> Timed | None:
        """The call ended: its entry (None for a call without a timeout)."""
        with self._lock:
            return self._calls.pop(invocation_id, None)

    def next_at(self) -> float | None:
        """When the control thread must look next (None: nothing is timed)."""
        with self._lock:
            times = [self._due_at(c) for c in self._calls.values()]
        return min(times) if times else None

    def _due_at(self, c: Timed) -> float:
        if c.interrupted is not None:
            return (c.reported if c.reported is not None else c.interrupted) + self.grace
        return max(c.started + c.timeout, c.next_try)

    def due(self, now: float) -> tuple[list[Timed], list[Timed]]:
        """(calls to interrupt now, calls still running a `grace` after their interrupt
        or their last report: to report, as reported now)."""
        stop: list[Timed] = []
        stuck: list[Timed] = []
        with self._lock:
            for c in self._calls.values():
                if now < self._due_at(c):
                    continue
                if c.interrupted is None:
                    stop.append(c)
                else:
                    c.reported = now
                    stuck.append(c)
        return stop, stuck

    def stuck(self, c: Timed, device: str) -> Timeout:
        """The error of a call still running a grace after its interrupt."""
        return Timeout(f"{c.name} call {c.invocation_id} ran longer than its timeout of "
                       f"{c.timeout:g}s on {device} and did not stop within {self.grace:g}s "
                       "of being interrupted; its worker was restarted. Raise timeout= if it "
                       "needs longer.")

    def interrupted(self, c: Timed, landed: bool, now: float) -> None:
        """The interrupt of `c` was raised in it (`landed`), or found it not running yet."""
        with self._lock:
            if landed:
                c.interrupted = now
            else:
                c.next_try = now + RECHECK_SECONDS


def timed_out(c: Timed, device: str, ran: float | None = None) -> Timeout:
    """The error a leased call past its timeout fails with (the scheduler's wording)."""
    if ran is not None and c.interrupted is None:
        return Timeout(f"{c.name} call {c.invocation_id} ran {ran:.1f}s, longer than its "
                       f"timeout of {c.timeout:g}s. Raise timeout= if it needs longer.")
    return Timeout(f"{c.name} call {c.invocation_id} ran longer than its timeout of "
                   f"{c.timeout:g}s on {device}; it was interrupted. Raise timeout= if it "
                   "needs longer.")


def within_timeout(result: p.Result, c: Timed, device: str) -> p.Result:
    """A leased call's Result as its caller gets it: one that ran past its timeout fails
    with Timeout, never retried, whatever it returned or raised (as the scheduler rules
    for a scheduled call)."""
    ran = result.meta.duration
    if c.interrupted is None and (ran is None or ran <= c.timeout):
        return result
    err = timed_out(c, device, ran)
    result.meta.retryable = False
    return p.Result(result.invocation_id, False, kind_of(err), str(err), result.meta)
