"""The leases a client holds: its repeat calls of a function go straight to a worker.

A call the client marks `Submit.lease` may come back with a LeaseGrant ahead of its
Result: for a second or so (or until the scheduler revokes it because another call
waits) the next calls of that function go to that worker as DirectRuns, answered
straight back. Every DirectRun gets an answer from a live worker: its Result, or a
LeaseRefused (the lease ended first) after which the call goes through the scheduler
as usual. A worker lost during a lease is said by the scheduler (the lease's Result,
not ok): the calls in flight there are sent again through the scheduler, which runs
those its journal says never started as if first sent and counts the others' attempt
(`lost`); a call that raised an exception its `Retries(on=...)` matches is sent again
likewise. Either way the Submit carries the attempt used (`retried`), so the retry
budget and backoff are the scheduled path's. An endpoint that does not answer a probe
(a notebook outside the cluster's network) turns leases off for this client, said once.
Thread-safe: callers take leases, the I/O thread (or a blocking call's channel) grants.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from gpufn.wire import config
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.client")

PREFIX = "lease:"
MARGIN_SECONDS = 0.05  # stop using a lease this long before the worker's end
PROBE_SECONDS = 2.0  # an endpoint that does not answer a probe this fast is unreachable
# While a function has no lease, at most this many of its calls go to the scheduler at a
# time (the others wait in the client for a lease); once the scheduler has answered its
# calls with no lease granted for DENIED_AFTER_SECONDS, they go to the scheduler freely
# for DENIED_SECONDS. (At the first such answer, a .map's whole window of calls had gone
# to the scheduler, when a lease came some 50 ms later: the one of its client's other
# function that held the device ending once idle, or the grants of devices still busy.)
HEAD_WINDOW = 64
DENIED_SECONDS = 1.0
DENIED_AFTER_SECONDS = 0.1
# Calls in flight under one lease at most: enough to keep its worker busy (it runs up to
# 64 short calls a round); a .map's others wait in the client or go to the scheduler, so
# the devices whose leases come later get their share instead of the first lease all.
LEASE_DEPTH = 64
# ...and at most about this much work by the function's run time seen so far (at least
# MIN_DEPTH calls: one running, one waiting): 64 calls of 5 ms queued on one lease held
# 0.3 s of work there while other devices idled, and what was left at its end came back
# refused (half a 4-device map's calls, sent twice).
DEPTH_SECONDS = 0.02
MIN_DEPTH = 2
RUN_TIME_WEIGHT = 0.2  # of each new run time in the function's moving average
# While a lease of the function is open (and full), a few of its calls at the scheduler
# are enough for devices no lease holds to take some (each one's end brings a lease
# there); the rest wait in the client for room. A hand-over (the scheduler gave queued
# calls to a lease: no device took them) holds the function's calls back from the
# scheduler a while: sending more would only have them handed over again.
LEASED_HEAD_WINDOW = 4
HANDED_SECONDS = 0.05


def is_lease(invocation_id: str) -> bool:
    return invocation_id.startswith(PREFIX)


def enabled() -> bool:
    """Leases unless GPUFN_LEASES=0."""
    return config.env_str("GPUFN_LEASES", "1") not in ("0", "false", "no", "off")


def retried(submit: p.Submit, grant: p.LeaseGrant, raised: bool) -> p.Submit:
    """`submit` again, through the scheduler, after an attempt under `grant` that was
    lost with its worker or `raised` an exception its function retries on: that attempt
    counts against its retries there, as a scheduled one would."""
    return replace(submit, prior_attempts=submit.prior_attempts + 1, prior_raised=raised,
                   prior_device=grant.device)


def lost(submit: p.Submit, grant: p.LeaseGrant) -> p.Submit:
    """`submit` again, through the scheduler, after its worker was lost under `grant`
    (whatever its retries): the scheduler reads the dead worker's journal, runs it as
    if first sent when it never started there, else counts the attempt (a retry, or
    WorkerLost with none left)."""
    return replace(retried(submit, grant, raised=False), prior_lease=grant.lease_id)


def should_retry(result: p.Result, grant: p.LeaseGrant) -> bool:
    """A leased call's answer that it runs again: it raised an exception its
    `Retries(on=...)` matches (the worker judged) and its function has retries."""
    return not result.ok and result.meta.retryable and grant.retries > 0


def leasable(submit: p.Submit) -> bool:
    """A plain call: no per-call options, its Result not kept for `from_id`."""
    return not submit.options and not submit.keep


class Reach(Enum):
    UNKNOWN = "unknown"
    PROBING = "probing"
    OK = "ok"
    UNREACHABLE = "unreachable"


@dataclass(slots=True)
class Held:
    """One lease: the grant, the calls left, the calls sent under it not answered yet."""

    grant: p.LeaseGrant
    ends_at: float
    left: int
    calls: set[str] = field(default_factory=set)
    dead: bool = False
    done: list[dict[str, object]] = field(default_factory=list)  # answered: id, ok

    def report(self) -> p.LeaseReport | None:
        """For a lease lost with its worker: the calls answered under it (the scheduler
        meters those the worker could not report)."""
        return p.LeaseReport(self.grant.lease_id, self.done) if self.done else None


class Leases:
    def __init__(self) -> None:
        self.on = enabled()
        self._lock = threading.Lock()
        self._by_fn: dict[str, list[Held]] = {}
        self._by_id: dict[str, Held] = {}
        self._call: dict[str, Held] = {}
        self.reach: dict[str, Reach] = {}
        self.direct_calls = 0  # calls sent under a lease (for tests and benchmarks)
        self._at_head: dict[str, str] = {}  # call id -> function id, sent to the scheduler
        self._head_count: dict[str, int] = {}  # function id -> its calls at the scheduler
        self._denied: dict[str, float] = {}  # function id -> until when it is not held back
        # function id -> (first, latest) answer from the scheduler without a lease, lately
        self._unleased: dict[str, tuple[float, float]] = {}
        self._handed: dict[str, float] = {}  # function id -> until when it is held back
        self._run_time: dict[str, float] = {}  # function id -> moving average, seconds
        # Endpoints of leases held when the scheduler forgot us (it restarted): their
        # workers may have died meanwhile, unsaid; a probe clears or ends them.
        self.suspect: set[str] = set()

    def mark(self, submit: p.Submit, stream: bool = False) -> p.Submit:
        """The Submit as sent: asking for a lease after it when it may have one."""
        if not self.on or stream or submit.lease or not leasable(submit):
            return submit
        # (not dataclasses.replace: 7 us a call, a tenth of a leased .map's client time)
        return p.Submit(submit.invocation_id, submit.function_id, submit.options, submit.keep,
                        submit.shm, True, submit.prior_attempts, submit.prior_raised,
                        submit.prior_device, submit.prior_lease, submit.frames)

    def holds(self, lease_id: str) -> bool:
        """A grant of a lease already held hands it more queued calls (`reclaimed`)."""
        with self._lock:
            return lease_id in self._by_id

    def granted(self, grant: p.LeaseGrant, now: float) -> bool:
        """Take a grant; False when leases are off (the caller returns it)."""
        if not self.on or self.reach.get(grant.endpoint) is Reach.UNREACHABLE:
            return False
        held = Held(grant, now + grant.seconds - MARGIN_SECONDS, grant.max_calls)
        self._denied.pop(grant.function_id, None)  # a lease came after all: hold back again
        self._unleased.pop(grant.function_id, None)
        with self._lock:
            self._by_id[grant.lease_id] = held
            self._by_fn.setdefault(grant.function_id, []).append(held)
        return True

    def take(self, submit: p.Submit, now: float) -> Held | None:
        """A live lease on a reachable worker for this call's function, the call counted
        under it; None: it goes through the scheduler."""
        if not self.on or not submit.lease:
            return None
        with self._lock:
            best: Held | None = None
            depth = self._depth(submit.function_id)
            for held in self._by_fn.get(submit.function_id, ()):
                if (not self._open(held, now) or len(held.calls) >= depth
                        or self.reach.get(held.grant.endpoint) is not Reach.OK):
                    continue
                if best is None or len(held.calls) < len(best.calls):
                    best = held  # the least loaded of its workers (a .map spreads)
            if best is None:
                return None
            best.left -= 1
            best.calls.add(submit.invocation_id)
            self._call[submit.invocation_id] = best
            self.direct_calls += 1
            return best

    def _open(self, held: Held, now: float) -> bool:
        """It takes calls now, or will once its worker answered the probe."""
        return (not held.dead and held.left > 0 and now < held.ends_at
                and self.reach.get(held.grant.endpoint) is not Reach.UNREACHABLE)

    def _depth(self, function_id: str) -> int:
        """Calls in flight under one lease of this function at most (see DEPTH_SECONDS);
        MIN_DEPTH until one of its calls was answered."""
        mean = self._run_time.get(function_id)
        if mean is None:
            return MIN_DEPTH
        if mean <= DEPTH_SECONDS / LEASE_DEPTH:
            return LEASE_DEPTH
        return max(MIN_DEPTH, min(LEASE_DEPTH, int(DEPTH_SECONDS / mean)))

    def observe(self, function_id: str, seconds: float | None) -> None:
        """A call of the function ran this long (its Result's meta)."""
        if seconds is None or seconds < 0:
            return
        mean = self._run_time.get(function_id)
        self._run_time[function_id] = (seconds if mean is None else
                                       mean + RUN_TIME_WEIGHT * (seconds - mean))

    def handed(self, function_id: str, now: float) -> None:
        """The scheduler handed queued calls of the function to a lease of ours."""
        self._handed[function_id] = now + HANDED_SECONDS

    def adopt(self, lease_id: str, invocation_id: str) -> Held | None:
        """A queued call the scheduler handed to this lease (`LeaseGrant.reclaimed`):
        taken by it when it has room (the scheduler no longer has the call either way);
        None: the caller routes it as a new call (another lease, the client, or the
        scheduler)."""
        self.left_head(invocation_id)  # the scheduler no longer has it
        with self._lock:
            held = self._by_id.get(lease_id)
            if held is None or len(held.calls) >= self._depth(held.grant.function_id):
                return None
            held.left -= 1
            held.calls.add(invocation_id)
            self._call[invocation_id] = held
            self.direct_calls += 1
        return held

    def endpoint_of(self, invocation_id: str) -> str | None:
        """The worker a call under a lease went to (None: not under a lease)."""
        held = self._call.get(invocation_id)
        return held.grant.endpoint if held is not None else None

    def in_flight(self, invocation_id: str) -> bool:
        """Sent under a lease and not answered: its worker answers it, not the scheduler."""
        return invocation_id in self._call

    def hold_back(self, function_id: str, now: float) -> bool:
        """Keep this call of a function in the client for now (`take` found no lease
        with room): a lease of it is open and full, and a few of its calls are at the
        scheduler or it handed some over lately (LEASED_HEAD_WINDOW); or, with none
        open, enough of its calls are at the scheduler and a lease may come (none
        refused lately)."""
        if not self.on or now < self._denied.get(function_id, 0.0):
            return False
        at_head = self._head_count.get(function_id, 0)
        with self._lock:
            open_ = any(self._open(h, now) for h in self._by_fn.get(function_id, ()))
        if open_:
            return at_head >= LEASED_HEAD_WINDOW or now < self._handed.get(function_id, 0.0)
        return at_head >= HEAD_WINDOW

    def to_head(self, function_id: str, invocation_id: str) -> None:
        """A call that asks for a lease goes to the scheduler (under the client's lock)."""
        self._at_head[invocation_id] = function_id
        self._head_count[function_id] = self._head_count.get(function_id, 0) + 1

    def from_head(self, invocation_id: str, now: float, seconds: float | None = None,
                  devices: Sequence[str] = ()) -> bool:
        """The scheduler answered one (it ran `seconds` on `devices`); True when calls
        held back should move now (a lease came with it, or none did: then its calls go
        to the scheduler a while). One it ran beside an open lease of ours on the same
        device holds the function's calls back from the scheduler a while, as a hand-over
        does: no other device was free for it, and each such call costs the scheduler a
        full dispatch (3% of a 2-device .map's calls, half the scheduler's CPU)."""
        fid = self.left_head(invocation_id)
        if fid is None:
            return False
        self.observe(fid, seconds)
        with self._lock:
            open_ = [h for h in self._by_fn.get(fid, ()) if not h.dead and now < h.ends_at]
            beside = bool(devices) and any(h.grant.device in devices for h in open_)
            leased = bool(open_)
        if beside:
            self.handed(fid, now)
        if not leased:
            first, latest = self._unleased.get(fid, (now, now))
            if now - latest > DENIED_SECONDS:  # an old spell: this one starts now
                first = now
            self._unleased[fid] = (first, now)
            if now - first >= DENIED_AFTER_SECONDS:
                self._denied[fid] = now + DENIED_SECONDS
        return True

    def left_head(self, invocation_id: str) -> str | None:
        """The scheduler no longer has this call (answered, or handed to a lease): off its
        function's count there; the function's id, or None if it was not counted."""
        fid = self._at_head.pop(invocation_id, None)
        if fid is not None:
            left = self._head_count[fid] = self._head_count.get(fid, 1) - 1
            if left <= 0:
                del self._head_count[fid]
        return fid

    def answered(self, invocation_id: str, ok: bool, seconds: float | None = None,
                 retry: bool = False) -> Held | None:
        """Its worker answered it (`retry`: it raised an exception its function retries
        on, so it runs again through the scheduler); the lease it ran under."""
        held = self.withdraw(invocation_id)
        if held is not None:
            held.done.append({"id": invocation_id, "ok": ok, "retry": True} if retry
                             else {"id": invocation_id, "ok": ok})
            self.observe(held.grant.function_id, seconds)
        return held

    def refused(self, msg: p.LeaseRefused) -> None:
        """The worker did not run these: the lease is over for them and for us."""
        with self._lock:
            held = self._by_id.get(msg.lease_id)
            if held is not None:
                held.dead = True
            for inv in msg.invocation_ids:
                h = self._call.pop(inv, None)
                if h is not None:
                    h.calls.discard(inv)
        self._prune()

    def suspect_all(self) -> set[str]:
        """The scheduler forgot us: every held lease's worker is in doubt until probed."""
        with self._lock:
            self.suspect |= {h.grant.endpoint for h in self._by_id.values()}
            return set(self.suspect)

    def dead_worker(self, endpoint: str) -> list[Held]:
        """A probe of a suspect endpoint went unanswered: its leases are over, here."""
        with self._lock:
            ids = [i for i, h in self._by_id.items() if h.grant.endpoint == endpoint]
            self.suspect.discard(endpoint)
        return [h for h in (self.ended(i) for i in ids) if h is not None]

    def ended(self, lease_id: str) -> Held | None:
        """The scheduler says the lease ended; the calls still in flight under it."""
        with self._lock:
            held = self._by_id.pop(lease_id, None)
            if held is None:
                return None
            held.dead = True
            for inv in held.calls:
                self._call.pop(inv, None)
            fns = self._by_fn.get(held.grant.function_id, [])
            if held in fns:
                fns.remove(held)
        return held

    def _prune(self) -> None:
        now = time.monotonic()
        with self._lock:
            for fn, helds in list(self._by_fn.items()):
                keep = [h for h in helds if not h.dead and now < h.ends_at] + [
                    h for h in helds if (h.dead or now >= h.ends_at) and h.calls]
                if keep:
                    self._by_fn[fn] = keep
                else:
                    del self._by_fn[fn]

    def endpoints_to_probe(self) -> list[str]:
        """Endpoints granted but never probed (they are marked PROBING)."""
        out = []
        with self._lock:
            for helds in self._by_fn.values():
                for h in helds:
                    ep = h.grant.endpoint
                    if ep not in self.reach:
                        self.reach[ep] = Reach.PROBING
                        out.append(ep)
        return out

    def unreachable(self, endpoint: str) -> list[str]:
        """A probe went unanswered: leases are off for this client (said once); the
        ids of the leases held, to give back."""
        first = self.on
        with self._lock:
            self.reach[endpoint] = Reach.UNREACHABLE
            self.on = False
            ids = list(self._by_id)
        if first:
            log.warning("this client cannot reach the worker at %s directly (outside the "
                        "cluster's network?); its calls go through the scheduler, as before",
                        endpoint.split("?")[0])
        return ids

    def withdraw(self, invocation_id: str) -> Held | None:
        """A call off its lease (the lease it was under, if any). Alone: taken but never
        sent (its worker's probe went unanswered), so not among the calls answered under
        it (it goes through the scheduler, which meters it there; a lost lease's report
        must not count it too)."""
        with self._lock:
            held = self._call.pop(invocation_id, None)
            if held is not None:
                held.calls.discard(invocation_id)
            return held
