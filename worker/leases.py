"""Leases held on this worker: calls a client sends straight here, past the scheduler.

The scheduler opens a lease with a Run whose meta carries `lease` (it holds one slot of
this device for it). Until the lease ends (its seconds or calls are spent, or the
scheduler revokes it with a Cancel naming it) the worker takes the holder's DirectRuns,
runs them one at a time in that slot and answers each straight to the client. When it
ends, the calls not started go back to the client (LeaseRefused) and the lease's own
Result tells the scheduler what ran (`meta.batch_items`), for usage and logs. Sans-I/O:
the process shell feeds it messages and the clock and carries out what it returns.
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from gpufn.exceptions import Cancelled, kind_of
from gpufn.wire import protocol as p

GRACE_SECONDS = 0.25  # a DirectRun sent just before the client's view of the end still runs
# A client may hear of its lease (from the scheduler) before this worker does: a DirectRun
# for a lease not opened yet waits this long for it before it is refused.
EARLY_SECONDS = 2.0
REPORT_SECONDS = 0.2  # what a lease ran reaches the scheduler this often (or per REPORT_CALLS)
REPORT_CALLS = 256
ENDED_MEMORY_SECONDS = 60.0  # a DirectRun naming a lease ended this lately is refused at once
# A lease the scheduler asked to end once idle (its client's other function wants the
# device) ends when no call of it has run or waited for this long: a thread alternating
# two functions keeps it, a finished .map's idle leases give way to the next function's.
IDLE_SECONDS = 0.05


@dataclass(slots=True)
class Lease:
    """One lease: the scheduler's Run that opened it (the template of its calls)."""

    run: p.Run
    secret: str
    ends_at: float
    max_calls: int
    opened: float
    taken: int = 0
    waiting: deque[tuple[bytes, p.DirectRun]] = field(default_factory=deque)
    running: str | None = None  # the call of this lease running now
    closing: str = ""  # why it ends ("" while open)
    accounts: list[dict[str, Any]] = field(default_factory=list)
    reported: float = 0.0  # when its calls were last reported
    used: float = 0.0  # when a call of it last came or ended
    end_when_idle: bool = False  # the scheduler asked it to end once IDLE_SECONDS idle
    call_meta: p.RunMeta | None = None  # its calls' (the template's, as a first attempt)

    @property
    def lease_id(self) -> str:
        return self.run.invocation_id

    @property
    def idle(self) -> bool:
        """No call of it running or waiting here."""
        return self.running is None and not self.waiting


@dataclass(frozen=True, slots=True)
class Refuse:
    """Tell `peer` that these calls of a lease did not run."""

    peer: bytes
    msg: p.LeaseRefused


@dataclass(frozen=True, slots=True)
class Start:
    """Run this call (built from the lease's template) for `peer`."""

    peer: bytes
    run: p.Run


@dataclass(frozen=True, slots=True)
class Ended:
    """The lease is over: its Result goes to the scheduler."""

    result: p.Result


@dataclass(frozen=True, slots=True)
class Answer:
    """Send `peer` this Result of a call that never ran (cancelled while it waited)."""

    peer: bytes
    result: p.Result


LeaseAction = Refuse | Start | Ended | Answer


@dataclass
class LeaseBook:
    leases: dict[str, Lease] = field(default_factory=dict)
    calls: dict[str, tuple[str, bytes, float]] = field(default_factory=dict)  # id -> lease, peer, start
    early: dict[str, list[tuple[float, bytes, p.DirectRun]]] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)  # lease id -> when it ended here
    # Cancels that came before their call (the client sent it later, e.g. after a probe):
    # call id -> (peer, when); the call is answered Cancelled when it comes.
    cancelled: dict[str, tuple[bytes, float]] = field(default_factory=dict)

    def open(self, run: p.Run, now: float) -> None:
        assert run.meta.lease is not None
        secret, seconds, max_calls = run.meta.lease[:3]
        self.leases[run.invocation_id] = Lease(run, str(secret), now + float(seconds),
                                               int(max_calls), now, reported=now, used=now)

    def opened(self, lease_id: str, now: float) -> list[LeaseAction]:
        """After `open`: the DirectRuns that came before it, offered now."""
        out: list[LeaseAction] = []
        for _, peer, msg in self.early.pop(lease_id, []):
            out += self.offer(peer, msg, now)
        return out + self.step(now)

    def offer(self, peer: bytes, msg: p.DirectRun, now: float) -> list[LeaseAction]:
        """A DirectRun arrived: queue it under its lease, or refuse it."""
        lease = self.leases.get(msg.lease_id)
        why = ""
        if lease is None and msg.lease_id not in self.ended:
            self.early.setdefault(msg.lease_id, []).append((now, peer, msg))
            return []
        if lease is None:
            why = "the lease ended"
        elif not hmac.compare_digest(lease.secret, msg.secret):
            why = "wrong lease secret"
        elif lease.closing or now > lease.ends_at + GRACE_SECONDS:
            why = lease.closing or "the lease ran out"
        elif lease.taken >= lease.max_calls:
            why = "the lease's calls are spent"
        if why:
            return [Refuse(peer, p.LeaseRefused(msg.lease_id, [msg.invocation_id], why))]
        assert lease is not None
        lease.taken += 1
        lease.used = now
        early = self.cancelled.pop(msg.invocation_id, None)
        if early is not None and early[0] == peer:
            lease.accounts.append(self._item(lease, msg.invocation_id, False,
                                             kind_of(Cancelled), 0.0, 0.0))
            return [Answer(peer, p.Result(msg.invocation_id, False, kind_of(Cancelled),
                                          "cancelled before it started"))]
        lease.waiting.append((peer, msg))
        return self.step(now)

    def cancel(self, peer: bytes, invocation_id: str, why: str,
               now: float) -> tuple[list[LeaseAction], bool]:
        """Its client cancels a call under a lease: one not started yet is answered
        Cancelled here; (actions, whether it runs now: the shell interrupts it)."""
        for lease in self.leases.values():
            for i, (who, msg) in enumerate(lease.waiting):
                if msg.invocation_id == invocation_id and who == peer:
                    del lease.waiting[i]
                    lease.accounts.append(self._item(lease, invocation_id, False,
                                                     kind_of(Cancelled), 0.0, 0.0))
                    return [Answer(peer, p.Result(invocation_id, False, kind_of(Cancelled),
                                                  f"cancelled before it started ({why})"))], False
        entry = self.calls.get(invocation_id)
        if entry is None:  # not here yet: answered Cancelled when it comes
            self.cancelled[invocation_id] = (peer, now)
        return [], entry is not None and entry[1] == peer

    def revoke(self, lease_id: str, why: str, when_idle: bool = False) -> bool:
        """The scheduler (or a restart) ends a lease: no call starts under it any more
        (`when_idle`: once none has come or run for IDLE_SECONDS). Safe from the control
        thread: it only sets a field the main thread reads."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        if when_idle:
            lease.end_when_idle = True
        elif not lease.closing:
            lease.closing = why
        return True

    def revoke_all(self, why: str) -> None:
        for lease_id in list(self.leases):
            self.revoke(lease_id, why)

    def finished(self, result: p.Result, duration: float | None, now: float) -> bytes | None:
        """A call ended: if it was a lease's, account it and return the peer to answer."""
        entry = self.calls.pop(result.invocation_id, None)
        if entry is None:
            return None
        lease_id, peer, started = entry
        lease = self.leases.get(lease_id)
        if lease is not None:
            if lease.running == result.invocation_id:
                lease.running = None
            lease.used = now
            item = self._item(lease, result.invocation_id, result.ok, result.error_kind,
                              duration if duration is not None else now - started,
                              now - started)
            if not result.ok and result.meta.retryable:
                item["retry"] = True  # its client sends it again: metered when it ends
            lease.accounts.append(item)
        return peer

    @staticmethod
    def _item(lease: Lease, invocation_id: str, ok: bool, kind: str, seconds: float,
              ago: float) -> dict[str, Any]:
        """A call the lease ran (or cancelled), as the scheduler meters it."""
        return {"id": invocation_id, "ok": ok, "kind": kind, "s": seconds,
                "wall": time.time() - ago}

    @staticmethod
    def _said(lease: Lease, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The items as sent: the first names the lease's function, app, version and user
        for all (a scheduler that restarted meters by them; decoding them with every item
        was a third of the head's CPU per leased call)."""
        if not items:
            return items
        meta = lease.run.meta
        terms = meta.lease or []
        first = {**items[0], "fn": lease.run.name, "app": meta.app, "v": meta.version,
                 "user": str(terms[3]) if len(terms) > 3 else ""}
        return [first, *items[1:]]

    def step(self, now: float) -> list[LeaseAction]:
        """Start the next call of each idle lease; end the leases that are over."""
        out: list[LeaseAction] = []
        for lease in list(self.leases.values()):
            # Over at its end once idle (its client stopped sending MARGIN_SECONDS
            # before); a call running or waiting then may hold it up to the grace. It had
            # held its device idle through the whole grace, the calls its client sent to
            # the scheduler meanwhile waiting for it (a leased .map on 4 devices lost a
            # fifth of its rate to that).
            if not lease.closing and now > lease.ends_at and (
                    lease.idle or now > lease.ends_at + GRACE_SECONDS):
                lease.closing = "the lease ran out"
            if (not lease.closing and lease.end_when_idle and lease.idle
                    and now >= lease.used + IDLE_SECONDS):
                lease.closing = "idle while its client's other calls wanted the device"
            if lease.closing and lease.waiting:
                by_peer: dict[bytes, list[str]] = {}
                for peer, msg in lease.waiting:
                    by_peer.setdefault(peer, []).append(msg.invocation_id)
                lease.waiting.clear()
                out += [Refuse(peer, p.LeaseRefused(lease.lease_id, ids, lease.closing))
                        for peer, ids in by_peer.items()]
            if lease.running is None and lease.waiting:
                peer, msg = lease.waiting.popleft()
                lease.running = msg.invocation_id
                self.calls[msg.invocation_id] = (lease.lease_id, peer, now)
                tmpl = lease.run
                if lease.call_meta is None:  # once a lease (`replace` was 4% of a call)
                    lease.call_meta = replace(tmpl.meta, lease=None, attempt_number=1)
                out.append(Start(peer, p.Run(
                    msg.invocation_id, tmpl.function_id, tmpl.code_id, tmpl.name,
                    tmpl.dispatch_token, lease.call_meta, msg.frames)))
            elif (lease.running is None and not lease.waiting
                  and (lease.closing or lease.taken >= lease.max_calls)):
                del self.leases[lease.lease_id]
                self.ended[lease.lease_id] = now
                meta = p.ResultMeta(dispatch_token=lease.run.dispatch_token,
                                    duration=now - lease.opened,
                                    batch_items=self._said(lease, lease.accounts))
                out.append(Ended(p.Result(lease.lease_id, True, "", lease.closing or
                                          "its calls are spent", meta)))
        return out

    def refuse_late(self, now: float) -> list[LeaseAction]:
        """DirectRuns whose lease never opened here (or ended) in time: refused."""
        out: list[LeaseAction] = []
        for lease_id, waiting in list(self.early.items()):
            if now - waiting[0][0] > EARLY_SECONDS:
                del self.early[lease_id]
                out += [Refuse(peer, p.LeaseRefused(lease_id, [m.invocation_id],
                                                    "no such lease here"))
                        for _, peer, m in waiting]
        for lease_id, t in list(self.ended.items()):
            if now - t > ENDED_MEMORY_SECONDS:
                del self.ended[lease_id]
        for inv, (_, t) in list(self.cancelled.items()):
            if now - t > ENDED_MEMORY_SECONDS:
                del self.cancelled[inv]
        return out

    def reports(self, now: float) -> list[p.LeaseReport]:
        """What the open leases ran since their last report, when it is time to say it
        (so a worker that dies loses at most REPORT_SECONDS of its leases' metering)."""
        out = []
        for lease in self.leases.values():
            if lease.accounts and (now - lease.reported >= REPORT_SECONDS
                                   or len(lease.accounts) >= REPORT_CALLS):
                out.append(p.LeaseReport(lease.lease_id, self._said(lease, lease.accounts)))
                lease.accounts, lease.reported = [], now
        return out

    def startable(self) -> bool:
        """A lease has a call waiting and none running (the shell does not sleep)."""
        return any(lease.running is None and lease.waiting for lease in self.leases.values())

    def next_deadline(self) -> float | None:
        """When a lease runs out (the shell wakes then to end it)."""
        times = [lease.ends_at if lease.idle
                 else lease.ends_at + GRACE_SECONDS  # (its call's end wakes the shell)
                 for lease in self.leases.values() if not lease.closing]
        times += [lease.used + IDLE_SECONDS for lease in self.leases.values()
                  if lease.end_when_idle and lease.idle and not lease.closing]
        times += [lease.reported + REPORT_SECONDS for lease in self.leases.values()
                  if lease.accounts]
        times += [w[0][0] + EARLY_SECONDS for w in self.early.values()]
        return min(times) if times else None
