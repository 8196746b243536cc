"""After a scheduler restart: which resubmitted calls its workers run or ran, and the
hold that lets the workers say so before anything is placed.

Clients hold their calls and workers hold what they ran (DESIGN principle 13). A client
the scheduler does not know (it restarted) says so in its Hello and resubmits every call
it still waits for. Workers that register again report the calls they run now (the new
scheduler takes them over: they keep running, their one Result goes to the caller), the
finished calls whose Results they still hold (asked for again with `Resend` when the
caller resubmits), and the calls that ran there but whose Result is gone (those may have
completed: a resubmit counts as an attempt lost with its worker, retried when `retries`
allows, else `WorkerLost`). A supervisor reports, the same way, the calls of its workers
that died while no scheduler was there. A resubmitted call matches a report whichever
comes first.

Calls resubmitted in the first `restart_grace_seconds` after the scheduler started wait
(the hold) until every device seen before the restart has its worker back, at most that
long, so that no call is placed before its worker could say it runs it; a client
forgotten later (it fell silent) resubmits with no wait. During the hold a call said to
have run (`RAN`) is only a suspect: a worker may still report that it runs it (a retry
the previous scheduler placed after the first worker died); the hold's end decides.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from gpufn.scheduler.stores.kept_results import DetachedCall, KeptResults
from gpufn.scheduler.stores.ops import OpsStore
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")

RAN_MEMORY_SECONDS = 300.0  # how long a report waits for its call's resubmit
ORPHAN_SECONDS = 120.0  # a running call nobody resubmitted is stopped after this


@dataclass(slots=True)
class Report:
    """A call a worker runs (or ran and holds the Result of), as it said in its Hello."""

    device: str
    worker: bytes
    dispatch_token: int
    attempt: int
    held: bool  # finished; the worker holds its Result
    at: float
    ran_seconds: float = 0.0  # how long it ran before this scheduler (billed, and its timeout's)


@dataclass(frozen=True, slots=True)
class Restored:
    """What a (re)started scheduler knows from before it, read once from its stores by the
    shell and handed to `SchedulerCore.start`: the one value a restart carries over."""

    wall_offset: float = 0.0  # wall clock minus the monotonic `now` the shell passes
    first_token: int = 0  # dispatch tokens start above any an earlier scheduler gave
    expected_devices: frozenset[str] | None = None  # seen before the restart (None: unknown)
    detached: tuple[DetachedCall, ...] = ()  # spawned calls to admit again, oldest first

    @classmethod
    def read(cls, ops: OpsStore, results: KeptResults | None, wall_offset: float,
             first_token: int) -> Restored:
        """From the stores of a durable scheduler (`gpufn serve`); an embedded one, whose
        workers die with it, restores no devices and no calls."""
        if not ops.durable:
            return cls(wall_offset, first_token)
        return cls(wall_offset, first_token, frozenset(ops.expected_devices()),
                   tuple(_pending_calls(results)) if results is not None else ())


def _pending_calls(results: KeptResults) -> list[DetachedCall]:
    """The noted calls that did not end; those whose Result is kept already are not run
    again (their notes are dropped). An unreadable book admits nothing, said in the log."""
    try:
        calls: list[DetachedCall] = []
        ended: list[DetachedCall] = []
        for c in results.detached():
            (ended if c.invocation_id in results else calls).append(c)
        if ended:
            results.save_calls([], [c.invocation_id for c in ended])
    except Exception:  # it must not keep the scheduler from starting
        log.exception("could not read the calls to admit again after the restart")
        return []
    return calls


RAN = "ran"  # `claim`: the call ran on a worker and may have completed; nothing to take over
STOPPED = "stopped"  # `claim`: stopped while it ran because its client was forgotten


class Recovery:
    def __init__(self, grace: float, instance: str = "") -> None:
        self.grace = grace
        self.instance = instance  # this scheduler's id: a client that knew it was not restarted
        self.ran: dict[str, float] = {}  # invocation id -> when a worker said it ran
        self.reports: dict[str, Report] = {}  # invocation id -> running or held there
        self._resubmit_until: dict[bytes, float] = {}  # client -> end of its grace
        self.began: float | None = None  # when this scheduler started (`start`)
        # The devices seen before the restart (None: not known, the hold lasts its grace).
        self.expected: set[str] | None = None
        self.hold_over = False
        self._next_orphans = 0.0
        self.suspects: set[str] = set()  # resubmitted, said to have run: decided at the hold's end
        # Calls stopped while running when their client fell silent past the client
        # timeout: if it was only cut off, it sends them again; that run was an attempt.
        self.stopped: dict[str, float] = {}

    def start(self, expected: Iterable[str] | None, now: float) -> None:
        """The scheduler starts at `now`, expecting the workers of `expected` back."""
        self.began = now
        self.expected = set(expected) if expected is not None else None
        self.hold_over = self.expected is not None and not self.expected

    @property
    def hold_until(self) -> float:
        return (self.began or 0.0) + self.grace

    def client_hello(self, peer: bytes, info: p.HelloInfo, now: float) -> None:
        same = bool(self.instance) and info.instance == self.instance  # only forgotten
        if info.resubmit and not same and not self.hold_over and now < self.hold_until:
            self._resubmit_until[peer] = self.hold_until

    def not_before(self, peer: bytes, now: float) -> float:
        """When a call this client submits may start (0: at once)."""
        if not self._resubmit_until:
            return 0.0
        until = self._resubmit_until.get(peer, 0.0)
        if until <= now or self.hold_over:
            self._resubmit_until.pop(peer, None)
            return 0.0
        return until

    def holding(self, now: float) -> bool:
        """Whether the hold lasts (resubmitted calls wait; suspects are not decided)."""
        return not self.hold_over and self.began is not None and now < self.hold_until

    def decided(self, now: float) -> list[str]:
        """The suspects to count as run now that the hold is over (each once)."""
        if not self.suspects or self.holding(now):
            return []
        out, self.suspects = sorted(self.suspects), set()
        return out

    def device_ready(self, key: str) -> bool:
        """A device has its worker (and its report) back; True if that ends the hold."""
        if self.hold_over or self.expected is None:
            return False
        self.expected.discard(key)
        if self.expected:
            return False
        self.hold_over = True
        self._resubmit_until.clear()
        return True

    def worker_report(self, device: str, worker: bytes, info: p.HelloInfo,
                      now: float) -> list[str]:
        """Remember what a registering worker (or supervisor: `device` "") runs, holds
        and ran; returns the ids it named."""
        self._forget_old(now)
        for held, calls in ((False, info.running), (True, info.held)):
            for inv_id, (token, attempt, *ran_ms) in calls.items():
                self.reports[inv_id] = Report(device, worker, int(token), int(attempt), held,
                                              now, float(ran_ms[0]) / 1000 if ran_ms else 0.0)
        for inv_id in info.ran:
            self.ran[str(inv_id)] = now
        return [*info.running, *info.held, *map(str, info.ran)]

    def _forget_old(self, now: float) -> None:
        if len(self.ran) > 100_000 or any(now - t > RAN_MEMORY_SECONDS for t in
                                          list(self.ran.values())[:1]):
            self.ran = {k: t for k, t in self.ran.items() if now - t <= RAN_MEMORY_SECONDS}
        if len(self.reports) > 100_000 or any(now - r.at > RAN_MEMORY_SECONDS for r in
                                              list(self.reports.values())[:1]):
            self.reports = {k: r for k, r in self.reports.items()
                            if now - r.at <= RAN_MEMORY_SECONDS}
        if len(self.stopped) > 100_000 or any(now - t > RAN_MEMORY_SECONDS for t in
                                              list(self.stopped.values())[:1]):
            self.stopped = {k: t for k, t in self.stopped.items()
                            if now - t <= RAN_MEMORY_SECONDS}

    def claim(self, invocation_id: str) -> Report | str | None:
        """What the workers said of a (resubmitted) call: its Report, `RAN`, or None.
        Each report is claimed once."""
        if self.reports:
            report = self.reports.pop(invocation_id, None)
            if report is not None:
                self.ran.pop(invocation_id, None)
                self.suspects.discard(invocation_id)
                return report
        if self.ran and self.ran.pop(invocation_id, None) is not None:
            return RAN
        if self.stopped and self.stopped.pop(invocation_id, None) is not None:
            return STOPPED
        return None

    def client_forgotten(self, stopped: Iterable[str], now: float) -> None:
        """A silent client was forgotten and these running calls of it were stopped."""
        self._forget_old(now)
        for inv_id in stopped:
            self.stopped[inv_id] = now

    def result_arrived(self, invocation_id: str, device: str, dispatch_token: int) -> None:
        """A Result for a call reported running and not claimed yet: its worker holds it
        now (it keeps what it sent), so a resubmit asks for it again."""
        report = self.reports.get(invocation_id)
        if report is not None and report.device == device and report.dispatch_token == dispatch_token:
            report.held = True

    def orphans(self, now: float) -> list[tuple[str, Report]]:
        """Running calls reported longer than `ORPHAN_SECONDS` ago that no caller took
        back: (id, report) each, forgotten here; their workers are told to stop them.
        Looked at once a second."""
        if not self.reports or now < self._next_orphans:
            return []
        self._next_orphans = now + 1.0
        out: list[tuple[str, Report]] = []
        for inv_id, r in list(self.reports.items()):
            if not r.held and now - r.at > ORPHAN_SECONDS:
                del self.reports[inv_id]
                out.append((inv_id, r))
        return out
