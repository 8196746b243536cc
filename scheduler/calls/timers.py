"""A call's clocks: deadlines to start, timeouts to run, and the grace a stopping call
has. The core asks on each tick; what a clock ends, it ends through `Transitions`, and a
worker that must be killed for it is yielded (`Kill`) for the core to apply."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from gpufn.exceptions import Timeout
from gpufn.scheduler.calls.transitions import Transitions
from gpufn.scheduler.nouns.records import Device, Invocation
from gpufn.scheduler.nouns.settings import Counters, SchedulerConfig
from gpufn.scheduler.nouns.states import InvState


@dataclass(frozen=True, slots=True)
class Kill:
    """Kill the device's worker (what runs there is lost with it)."""

    device: Device
    reason: str


class Timers:
    def __init__(self, config: SchedulerConfig, tx: Transitions, devices: dict[str, Device],
                 counters: Counters) -> None:
        self.config = config
        self.tx = tx
        self.devices = devices
        self.counters = counters
        self._deadlines: list[tuple[float, int, Invocation]] = []

    def watch(self, inv: Invocation, now: float) -> None:
        """A queued call with a deadline to start by."""
        if inv.spec.deadline is not None:
            inv.deadline = now + inv.spec.deadline
            heapq.heappush(self._deadlines, (inv.deadline, inv.seq, inv))

    def expired(self, now: float) -> Iterator[Kill]:
        """End what its clock ended: stops past their grace, runs past their timeout,
        queued calls past their deadline."""
        grace = self.config.stop_grace_seconds
        for d in list(self.devices.values()):
            late = [i for i, t in d.stopping.items() if now - t > grace]
            if late:
                yield Kill(d, f"call {late[0]} did not stop within {grace:g}s of being told to")
                continue
            for inv in list(d.running.values()):
                t = inv.spec.timeout
                if (inv.state is InvState.RUNNING and t is not None and inv.run_started is not None
                        and now - inv.run_started > t):
                    yield from self._timed_out(inv, t, now)
                    break
        # Deadlines: a heap, so a tick costs O(due), not O(queued).
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, inv = heapq.heappop(self._deadlines)
            if inv.state is not InvState.QUEUED or inv.deadline is None or now <= inv.deadline:
                continue  # started (or finished) in time
            self.tx.finish(inv, now, InvState.FAILED, Timeout(
                f"{inv.function.name} call {inv.id} could not start within its deadline of "
                f"{inv.spec.deadline:g}s; it was dropped, not run late"))

    def _timed_out(self, inv: Invocation, t: float, now: float) -> Iterator[Kill]:
        """The call ran past its timeout: fail it, free held devices, kill its runners."""
        self.counters.timeouts += 1
        runners = [self.devices[k] for k in inv.shape.runners(inv.devices)
                   if inv.id in self.devices[k].running]
        for key in inv.devices:
            if key not in inv.shape.runners(inv.devices):  # held idle: free now
                self.tx.release_device(inv, self.devices.get(key))
        where = ", ".join(d.key for d in runners)
        self.tx.finish(inv, now, InvState.FAILED, Timeout(
            f"{inv.function.name} call {inv.id} ran longer than its timeout of {t:g}s "
            f"on {where}; its worker(s) were restarted. Raise timeout= if it needs longer."),
            release=False)
        for d in runners:
            yield Kill(d, f"call {inv.id} exceeded its {t:g}s timeout")

    def overran(self, inv: Invocation, duration: float | None) -> Timeout | None:
        """A call that reports success after running longer than its timeout (its worker
        finished before a tick could stop it, e.g. while the scheduler was paused) still
        fails as a timeout: the rule is the run's length, not who noticed first."""
        t = inv.spec.timeout
        if t is None or duration is None or duration <= t:
            return None
        self.counters.timeouts += 1
        return Timeout(f"{inv.function.name} call {inv.id} ran {duration:.1f}s, longer than its "
                       f"timeout of {t:g}s. Raise timeout= if it needs longer.")
