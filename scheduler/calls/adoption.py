"""Restart adoption: after a scheduler restart, the resubmitted calls its workers say they
run, hold the Result of, or ran are taken over, asked for again, or counted as a lost
attempt (at the hold's end, when another worker may still say it runs them). It applies
what `Recovery` (the book of reports and the hold) remembers, through `Transitions`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gpufn.scheduler.calls.recovery import Recovery, Report
from gpufn.scheduler.calls.transitions import Transitions
from gpufn.scheduler.nouns.events import Send
from gpufn.scheduler.nouns.records import Device, Invocation
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")


class Adoption:
    def __init__(self, recovery: Recovery, tx: Transitions, devices: dict[str, Device],
                 invocations: dict[str, Invocation], out: list[Send]) -> None:
        self.recovery = recovery
        self.tx = tx
        self.devices = devices
        self.invocations = invocations
        self.out = out

    def _send(self, peer: bytes, msg: p.Message) -> None:
        self.out.append(Send(peer, msg))

    def recovered(self, ids: Iterable[str], d: Device | None, now: float) -> None:
        """A worker (or supervisor) reported calls after a restart: those already
        resubmitted and waiting in the hold are taken over, or count as run."""
        for inv_id in ids:
            inv = self.invocations.get(inv_id)
            if inv is None:
                continue  # its caller resubmits it later (or never)
            claim = self.recovery.claim(inv_id)
            if (inv.state is InvState.QUEUED and inv.attempts and isinstance(claim, Report)
                    and self.adopt(inv, claim, now, queued=True)):
                continue  # counted as lost and queued again, not started yet: its run goes on
            if inv.state is not InvState.QUEUED or inv.attempts:
                if isinstance(claim, Report) and not claim.held and d is not None:
                    # The hold ended before this worker was back, and the call was placed
                    # again: the old run stops (it may have had an effect: said, not hidden).
                    log.warning("[%s] %s was placed again before %s said it runs it; "
                                "stopping that run", inv_id, inv.function.name, d.key)
                    self._send(d.control or d.worker or b"", p.Cancel(
                        inv_id, "placed again after the restart", True, claim.dispatch_token))
                continue
            if not (isinstance(claim, Report) and self.adopt(inv, claim, now, queued=True)):
                self.ran_before(inv, now)

    def ran_before(self, inv: Invocation, now: float) -> None:
        """A resubmitted call ran on a worker that cannot hand it over: a lost attempt,
        decided at the hold's end (another worker may still say it runs it)."""
        if self.recovery.holding(now):
            self.recovery.suspects.add(inv.id)
        else:
            self.tx.lost_before_restart(inv, now)

    def decide_suspects(self, now: float) -> None:
        for inv_id in self.recovery.decided(now):
            inv = self.invocations.get(inv_id)
            if inv is not None:
                self.tx.lost_before_restart(inv, now)

    def adopt(self, inv: Invocation, report: Report, now: float, queued: bool) -> bool:
        """Take over a resubmitted call its worker runs or holds the Result of; False if
        that cannot be (the worker is gone, or the call spans devices): it counts as run."""
        d = self.devices.get(report.device)
        if (d is None or d.worker != report.worker or not d.takes_work
                or inv.spec.count > 1):
            return False
        self.tx.adopt(inv, d, report.dispatch_token, report.attempt, now, queued,
                      report.ran_seconds)
        if report.held:
            self._send(d.worker, p.Resend(inv.id, report.dispatch_token))
        return True

