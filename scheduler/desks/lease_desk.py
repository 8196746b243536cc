"""Leases: a client's repeat calls of one function go straight to a worker.

When a call of a single-device function ends on an otherwise idle device and nothing at
all waits in the queue, the call's client may be granted a lease on that device: a
pseudo-call (id `lease:...`, `Invocation.lease`) holds the slot, the worker takes the
client's DirectRuns for `seconds` or `max_calls`, and the scheduler sees only the grant
and, at the end, one Result listing what ran, which it meters and logs as it would
the calls themselves. A call that starts waiting (anyone's, any priority) revokes every
lease at once, so it waits at most for the leased call running now; so do a drain and
the client's departure. A lease lost with its worker tells its client, which retries
or fails the calls it had in flight (`gpufn/client/leases.py`).
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from gpufn.exceptions import Cancelled, Timeout, WorkerLost, kind_of
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books.usage import Key as UsageKey
from gpufn.scheduler.desks.lost_leases import LostLeases, Parked, Verdict
from gpufn.scheduler.desks.surface import CoreView
from gpufn.scheduler.nouns.records import Device, Invocation
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")

PREFIX = "lease:"
CANCELLED = kind_of(Cancelled)
TIMEOUT = kind_of(Timeout)
RENEW_SECONDS = 0.1  # a lease this close to its end may be renewed (`_ending`)
ACCOUNTED_MEMORY = 1024  # leases whose metered calls are remembered (a late or repeated report)


_SUCCEEDED, _CANCELLED, _FAILED = _OUTCOMES = (
    InvState.SUCCEEDED.value, InvState.CANCELLED.value, InvState.FAILED.value)


def is_lease(invocation_id: str) -> bool:
    return invocation_id.startswith(PREFIX)


class LeaseDesk:
    def __init__(self, core: CoreView, ops: Any) -> None:
        self.core = core
        self.ops = ops  # the OpsDesk: usage and logs
        self.open: dict[str, Invocation] = {}
        self._metered: OrderedDict[str, set[str]] = OrderedDict()  # lease -> calls metered
        self._lost: OrderedDict[str, tuple[bytes, UsageKey]] = OrderedDict()  # lost leases
        self._idle_asked: set[str] = set()  # open leases asked to end once idle
        self.lost_calls = LostLeases()  # did a call lost with its lease's worker start?
        self.granted = 0
        self.leased_calls = 0

    # ------------------------------------------------------------------ grants

    def grant(self, inv: Invocation, d: Device, now: float) -> Invocation | None:
        """`inv` just ended on `d`: lease `d` to its client if it may (see the module);
        the grant goes out now, ahead of the call's Result, and the lease is dispatched
        by `start` once the call has left the device."""
        cfg = self.core.config
        core = self.core
        if cfg.lease_seconds <= 0 or not self._leasable(inv, d):
            return None
        peer = core.peers.get(inv.client)
        worker = core.peers.get(d.worker) if d.worker is not None else None
        if peer is None or not inv.wants_lease or worker is None or not worker.info.direct:
            return None
        if getattr(self.ops, "draining", False):
            return None
        queued = core.queue.only_of(inv.function.function_id, inv.client)
        if queued is None or not all(self._may_go_under(q) for q in queued):
            return None  # someone else's call waits, or one of its own that takes no lease
        if not self._only_its_own(d, inv, now):
            # Another client's lease held the device while this call ran beside it: the
            # device is wanted by more than its holder, so that lease ends (as when a call
            # waits); this client's next call here may get one. (A leased .map left its
            # client's leases idle on every device for up to their second, and the
            # blocking calls of another thread of that process ran beside them unleased.)
            # A lease of this client's other function gives way only once idle (a thread
            # alternating two functions keeps it; a finished .map's leases, idle, had
            # kept the next function's calls off leases for up to their second).
            for other in list(d.running.values()):
                if other.lease is None:
                    continue
                if other.client != inv.client:
                    self._revoke(other, now, "revoked: another client's calls run beside it")
                elif other.function is not inv.function and not self._ending(other, now):
                    self._end_when_idle(other)
            return None
        if any(self._same(lease, inv) and d.key in lease.devices
               and not self._ending(lease, now) for lease in self.open.values()):
            return None  # it has one here (a grant in flight): no second
        # Its worker judges a leased call's exception retryable (`ResultMeta.retryable`)
        # only when the function retries: then the client sends it again (`Submit.
        # prior_attempts`), and its attempt here is not metered as a call (`_meter`).
        spec = replace(inv.spec, timeout=None, retries=0, preemptible=False, deadline=None,
                       retry_on=inv.spec.retry_on if inv.spec.retries > 0 else ())
        lease = Invocation(f"{PREFIX}{secrets.token_hex(8)}", inv.function, inv.client, spec,
                           (), now, inv.seq)
        lease.user, lease.shm = inv.user, inv.shm
        lease.lease = [secrets.token_hex(16), cfg.lease_seconds, cfg.lease_max_calls]
        core.send(inv.client, p.LeaseGrant(
            lease.id, inv.function.function_id, worker.info.direct, lease.lease[0],
            cfg.lease_seconds, cfg.lease_max_calls, inv.spec.retries,
            self._reclaim(queued, now), d.key))
        return lease

    def _reclaim(self, queued: list[Invocation], now: float) -> list[str]:
        """Hand the lease its share of the client's queued calls (the newest, as many as
        one of the devices that take work would run): the scheduler forgets them, the
        client sends them to the worker. The others stay for the other devices."""
        if not queued:
            return []
        core = self.core
        devices = sum(1 for d in core.devices.values() if d.takes_work) or 1
        # Every k-th call in queue order, from the first: the lease and the other devices
        # go on through the queue side by side, in its order (a .map(cost=...)).
        return self._take(sorted(queued, key=lambda i: (core.queue.key(i), i.seq))[::devices], now)

    def _take(self, share: list[Invocation], now: float) -> list[str]:
        """These queued calls are the lease's now: the scheduler forgets them."""
        core = self.core
        for q in share:
            core.queue.discard(q)
            q.to(InvState.CANCELLED, now)
            core.invocations.pop(q.id, None)
        counters = getattr(core, "counters", None)
        if counters is not None:
            counters.submitted -= len(share)  # counted again from the lease's Result
        return [q.id for q in share]

    def _only_its_own(self, d: Device, inv: Invocation, now: float) -> bool:
        """Nothing runs on `d` but calls of the same client and function (a .map's calls
        pipelined there), or its lease there that is ending: a lease beside them takes
        nobody's place."""
        return all(self._same(other, inv) and (other.lease is None or self._ending(other, now))
                   for other in d.running.values())

    @staticmethod
    def _may_go_under(queued: Invocation) -> bool:
        """A queued call a lease may take over: its client asked, and it is no retry (a
        retry keeps its attempt count and backoff with the scheduler; its worker would
        run it as a first attempt)."""
        return queued.wants_lease and not queued.attempts

    @staticmethod
    def _same(a: Invocation, b: Invocation) -> bool:
        return a.client == b.client and a.function is b.function

    @staticmethod
    def _ending(lease: Invocation, now: float) -> bool:
        """A lease in its last quarter (at least its last RENEW_SECONDS): its client has
        stopped, or soon stops, using it (`gpufn/client/leases.py` MARGIN_SECONDS), so a
        call of its client that ends here may renew it with a new lease at once; else
        each lease's end sent its client's calls through the scheduler until the old
        lease's Result came back (~7% of a tight loop's calls)."""
        if lease.lease is None or lease.run_started is None or lease.preempt_asked is not None:
            return False
        seconds = float(lease.lease[1])
        return now >= lease.run_started + seconds - max(RENEW_SECONDS, seconds / 4)

    def _leasable(self, inv: Invocation, d: Device) -> bool:
        """A caller's plain single-device call: not a batch, a gang, a device set, a
        generator, a spawned call whose Result is kept, or one the worker must adopt."""
        return (inv.shape is Shape.SINGLE and not inv.members and inv.carrier is None
                and inv.lease is None and not inv.items and inv.spec.count == 1
                # A call that uses shared models stays with the scheduler, which weighs
                # waiting for the device holding them against loading another copy.
                and not inv.function.model_keys
                and inv.spec.batch_size is None and not inv.spec.affinity
                and inv.id not in self.core.streams.keep
                and d.takes_work)

    def start(self, lease: Invocation, d: Device, now: float) -> None:
        """Hold a slot of `d` for the lease and open it on the worker."""
        core, tx = self.core, self.core.tx
        if d.worker is None or not d.takes_work or not self._only_its_own(d, lease, now):
            self._end_at_client(lease, "the device was taken meanwhile")
            return
        needs = core.models.request(lease).needs()
        if needs and not all(d.ledger.state(n.name) is Residency.RESIDENT for n in needs):
            self._end_at_client(lease, "its models are not resident")
            return
        tx.tokens += 1
        lease.start(now, (d.key,), tx.tokens, Shape.SINGLE)
        lease.run_started = now
        d.running[lease.id] = lease
        d.running_by_fn[lease.function.code_id] += 1
        d.ledger.reserve(lease.id, lease.spec.memory)
        if needs:
            d.ledger.acquire(lease.id, needs, now, lease.function.name)  # not evicted under it
        core.invocations[lease.id] = lease
        self.open[lease.id] = lease
        self.lost_calls.opened(lease.id, d.key, d.worker_pid)
        self.granted += 1
        fn = lease.function
        meta = tx.run_meta(lease, d)
        meta.timeout = fn.spec.timeout  # each call's: the worker times them (not the lease)
        meta.models = {core.models.models[k].name: k for k in fn.model_keys}
        meta.lease = [*(lease.lease or ()), lease.user]
        if fn.code_id not in d.code:
            core.send(d.worker, p.LoadCode(fn.code_id, fn.name, fn.code_frames))
            d.code.add(fn.code_id)
        core.send(d.worker, p.Run(lease.id, fn.function_id, fn.code_id, fn.name,
                                  lease.dispatch_token, meta, ()))

    def _end_at_client(self, lease: Invocation, why: str) -> None:
        if lease.client in self.core.peers:
            self.core.send(lease.client, p.Result(lease.id, True, "", why))

    # ------------------------------------------------------------------ revocation

    def revoke_if_waiting(self, now: float, everything: bool = False) -> None:
        """After a scheduling pass: a call waits (or the scheduler drains): every lease
        stops taking calls; its slot frees when its running call ends."""
        queue = self.core.queue
        draining = everything or getattr(self.ops, "draining", False)
        if not self.open or not (draining or len(queue)):
            return
        takers: dict[tuple[bytes, str], int] | None = None  # leases that may take them
        queued: dict[tuple[bytes, str], list[Invocation] | None] = {}
        for lease in list(self.open.values()):
            if lease.preempt_asked is not None:
                continue
            if not draining:
                key = (lease.client, lease.function.function_id)
                if key not in queued:
                    queued[key] = queue.only_of(key[1], lease.client)
                mine = queued[key]
                # only its own client's calls of it wait, and each may go under a lease
                # (not a spawned call whose Result is kept, a stream, per-call options)
                if mine is not None and all(self._may_go_under(q) for q in mine):
                    if mine and not self._ending(lease, now):
                        if takers is None:
                            takers = self._takers(now)
                        left = takers.get(key, 0)
                        if left:
                            self._hand_over(lease, mine, now, left)
                            takers[key] = left - 1
                            queued[key] = queue.only_of(key[1], lease.client)
                    continue
            self._revoke(lease, now, "revoked: a call waits")

    def _revoke(self, lease: Invocation, now: float, why: str) -> None:
        """The lease takes no more calls; its slot frees when its running call ends."""
        if lease.preempt_asked is not None:
            return
        lease.preempt_asked = now
        target = self._control_of(lease)
        if target is not None:
            self.core.send(target, p.Cancel(lease.id, why, True, lease.dispatch_token))

    def _end_when_idle(self, lease: Invocation) -> None:
        """Ask the lease's worker to end it once no call has used it for a moment
        (`worker/leases.py` IDLE_SECONDS): once per lease."""
        if lease.preempt_asked is not None or lease.id in self._idle_asked:
            return
        if len(self._idle_asked) >= len(self.open):
            self._idle_asked &= self.open.keys()
        target = self._control_of(lease)
        if target is not None:
            self._idle_asked.add(lease.id)
            self.core.send(target, p.Cancel(lease.id, "its client's other calls want the device",
                                            False, lease.dispatch_token))

    def _control_of(self, lease: Invocation) -> bytes | None:
        """Where the lease's device takes cancels (its worker's control channel)."""
        d = self.core.devices.get(lease.devices[0]) if lease.devices else None
        return (d.control or d.worker) if d is not None else None

    def forward_cancel(self, client: bytes, msg: p.Cancel) -> None:
        """A client cancels a call the scheduler does not know: one it sent under a lease
        (it also told the worker, whose main thread reads that only between calls: a
        running inline call is interrupted from the worker's control thread, as a
        scheduled one is). To the devices of that client's open leases."""
        for lease in self.open.values():
            target = self._control_of(lease) if lease.client == client else None
            if target is not None:
                self.core.send(target, p.Cancel(msg.invocation_id, msg.reason or
                                                "cancelled by the caller", True, 0))

    def _takers(self, now: float) -> dict[tuple[bytes, str], int]:
        """(client, function) -> its leases that may take its queued calls: none while a
        device runs one of its calls without a lease (that device takes the next, and its
        end may bring a lease there)."""
        takers: dict[tuple[bytes, str], int] = {}
        for lease in self.open.values():
            if lease.preempt_asked is None and not self._ending(lease, now):
                key = (lease.client, lease.function.function_id)
                takers[key] = takers.get(key, 0) + 1
        for d in self.core.devices.values():
            for inv in d.running.values():
                if inv.lease is None:
                    takers.pop((inv.client, inv.function.function_id), None)
        return takers

    def _hand_over(self, lease: Invocation, queued: list[Invocation], now: float,
                   leases: int) -> None:
        """Its client's calls of its function wait, no device took them in this pass and
        none runs one of them without a lease (it would take the next, and its end may
        bring a lease there): this lease, one of `leases` of theirs, takes its share (as
        at its grant), the same grant sent again with them. Else they would wait for the
        lease's end (its client sends calls to the scheduler while its leases are full,
        for other devices to take)."""
        d = self.core.devices.get(lease.devices[0]) if lease.devices else None
        worker = self.core.peers.get(d.worker) if d is not None and d.worker else None
        if (worker is None or not worker.info.direct or lease.lease is None
                or lease.client not in self.core.peers):
            return
        fn = lease.function
        share = sorted(queued, key=lambda i: (self.core.queue.key(i), i.seq))[::leases]
        secret, seconds, max_calls = lease.lease[:3]
        self.core.send(lease.client, p.LeaseGrant(
            lease.id, fn.function_id, worker.info.direct, str(secret), float(seconds),
            int(max_calls), fn.spec.retries, self._take(share, now), d.key if d else ""))

    # ------------------------------------------------------------------ ends

    def on_result(self, d: Device | None, msg: p.Result, now: float) -> None:
        """A lease's Result from its worker: meter what ran (once), free its slot."""
        lease = self.core.invocations.get(msg.invocation_id)
        self._account(msg, lease, d, now)
        if d is None:
            return
        held = d.running.get(msg.invocation_id)
        if held is None:
            return
        if held.state is InvState.RUNNING:
            self._finish(held, now, msg)
        else:  # cancelled meanwhile (its client left): the slot frees now
            self.open.pop(held.id, None)
            self.core.tx.release_device(held, d)

    def lost(self, lease: Invocation, d: Device, now: float, why: str) -> None:
        """Its worker died: the client learns it (and retries or fails what it had there,
        and says which calls it got answers for: `_on_report`)."""
        key = self._key(lease)
        assert key is not None
        self._lost[lease.id] = (lease.client, key)
        while len(self._lost) > ACCOUNTED_MEMORY:
            self._lost.popitem(last=False)
        self.core.tx.release_device(lease, d)
        self.lost_calls.lost(lease.id, why)
        err = WorkerLost(f"the worker of {d.key} was lost during a lease ({why})")
        self._finish(lease, now, p.Result(lease.id, False, kind_of(err), str(err)), release=False)

    def resubmitted(self, peer: bytes, msg: p.Submit, now: float) -> p.Submit | None:
        """A call its client sends again after its lease's worker was lost: the Submit to
        admit (its attempt there uncounted if the worker's journal says it never started),
        or None while it waits for that journal (`worker_exited`, `tick`)."""
        where = self.lost_calls.worker(msg.prior_lease)
        d = self.core.devices.get(where[0]) if where is not None else None
        alive = d is not None and d.worker is not None and (d.key, d.worker_pid) == where
        verdict = self.lost_calls.verdict(msg, alive)
        if verdict is Verdict.WAIT:
            self.lost_calls.park(peer, msg, now)
            return None
        return LostLeases.decided(msg, verdict)

    def worker_exited(self, msg: p.WorkerExited) -> list[Parked]:
        """Its journal: the calls that waited for it, each to admit (`Parked.msg`)."""
        return [self._release(w, self.lost_calls.verdict(w.msg))
                for w in self.lost_calls.journal(msg)]

    def tick(self, now: float) -> list[Parked]:
        """Calls that waited for a journal that did not come: their attempt counts."""
        return [self._release(w, Verdict.MAY_HAVE_RUN) for w in self.lost_calls.expired(now)]

    @staticmethod
    def _release(w: Parked, verdict: Verdict) -> Parked:
        return Parked(w.peer, LostLeases.decided(w.msg, verdict), w.until)

    def _finish(self, lease: Invocation, now: float, msg: p.Result, release: bool = True) -> None:
        core = self.core
        self.open.pop(lease.id, None)
        state = InvState.SUCCEEDED if msg.ok else InvState.FAILED
        lease.to(state, now)
        self.ops.run_ended(lease, state, now)  # the device time it held
        if release:
            for key in lease.devices:
                core.tx.release_device(lease, core.devices.get(key))
        core.invocations.pop(lease.id, None)
        if lease.client in core.peers:
            core.send(lease.client, p.Result(lease.id, msg.ok, msg.error_kind, msg.message))
        core.tx.dirty = True

    def handlers(self) -> dict[type, Any]:
        return {p.LeaseReport: self._on_report, p.LeaseOverrun: self._on_overrun}

    def _on_overrun(self, peer: bytes, msg: p.LeaseOverrun, now: float) -> None:
        """A call under a lease ran past its timeout and did not stop when its worker
        interrupted it: it fails with Timeout at its client (before the lease's end, on
        the same connection) and is metered so; the worker is restarted, as for a
        scheduled call past its timeout (what else ran there is lost with it)."""
        d = self.core.device_of(peer)
        if d is None:
            return
        lease = self.core.invocations.get(msg.lease_id)
        if lease is not None and lease.lease is not None and d.key in lease.devices:
            if lease.client in self.core.peers:
                self.core.send(lease.client, p.Result(msg.invocation_id, False, TIMEOUT,
                                                      msg.message))
            self._meter(msg.lease_id, [{"id": msg.invocation_id, "ok": False, "kind": TIMEOUT,
                                        "s": msg.seconds,
                                        "wall": self.core.wall(now) - msg.seconds}],
                        self._key(lease), now, lease, d)
        self.core.kill_worker(d, now, f"call {msg.invocation_id} under a lease ran past its "
                                      "timeout and did not stop when interrupted")

    def _on_report(self, peer: bytes, msg: p.LeaseReport, now: float) -> None:
        """The calls a lease ran so far (its worker), or, for a lease lost with its
        worker, the calls its client got answers for (the worker's last reports died
        with it); each call is metered once whoever says it."""
        lease = self.core.invocations.get(msg.lease_id)
        peer_rec = self.core.peers.get(peer)
        if peer_rec is not None and peer_rec.role == p.Role.CLIENT:
            lost = self._lost.get(msg.lease_id)
            if lost is None or lost[0] != peer:
                return  # only a lost lease's own client may say what ran under it
            key = lost[1]
            self._meter(msg.lease_id, [{"id": i.get("id"), "ok": bool(i.get("ok")), "s": 0.0,
                                        "retry": bool(i.get("retry"))}
                                       for i in msg.items if isinstance(i, dict)], key, now)
            return
        self._meter(msg.lease_id, msg.items, self._key(lease), now, lease,
                    self.core.device_of(peer))

    @staticmethod
    def _key(lease: Invocation | None) -> UsageKey | None:
        if lease is None:
            return None
        fn = lease.function
        return UsageKey(fn.app, fn.name, fn.version, lease.user)

    def _account(self, msg: p.Result, lease: Invocation | None, d: Device | None,
                 now: float) -> None:
        self._meter(msg.invocation_id, msg.meta.batch_items or [], self._key(lease), now, lease, d)

    def _meter(self, lease_id: str, items: list[dict[str, Any]], key: UsageKey | None,
               now: float, lease: Invocation | None = None, d: Device | None = None) -> None:
        """Meter each call a lease ran as a call of its function and user, once: `key`
        from the lease the scheduler knows, else from the worker's items (a lease of the
        scheduler before a restart); `d`, the worker's device, counts them as completed
        there (`gpufn status`), as it counts a scheduled call's Result."""
        seen = self._metered.get(lease_id)
        if seen is None:
            seen = self._metered[lease_id] = set()
            while len(self._metered) > ACCOUNTED_MEMORY:
                self._metered.popitem(last=False)
        # (an attempt that raised an exception its function retries on is not a call:
        # its client sends it again, and the scheduler meters the call when it ends)
        fresh = [i for i in items if i.get("id") not in seen and not i.get("retry")]
        if not fresh:
            return
        ran: dict[tuple[UsageKey, str], list[tuple[float, float]]] = {}
        by_outcome = dict.fromkeys(_OUTCOMES, 0)
        timeouts = 0
        wall = self.core.wall(now)
        # The worker names the lease's function and user in its first item (for all).
        k = key or next((UsageKey(str(i.get("app", "")), str(i.get("fn", "?")),
                                  int(i.get("v", 0)), str(i.get("user", "")))
                         for i in items if "fn" in i), UsageKey("", "?", 0, ""))
        for item in fresh:
            seen.add(str(item.get("id")))
            started = float(item.get("wall", wall))
            kind = item.get("kind")
            outcome = _SUCCEEDED if item.get("ok") else _CANCELLED if kind == CANCELLED else _FAILED
            by_outcome[outcome] += 1
            timeouts += kind == TIMEOUT
            ran.setdefault((k, outcome), []).append(
                (started, started + float(item.get("s", 0.0))))
        for (k, outcome), spans in ran.items():  # one meter entry per key, outcome, minute
            self.ops.usage.record_ran(k, outcome, spans)
        self.leased_calls += len(fresh)
        if d is not None:
            d.completed += len(fresh)
        if lease is not None:  # `gpufn status`'s calls per function count them too
            lease.function.calls += len(fresh)
        counters = getattr(self.core, "counters", None)
        if counters is not None:
            counters.submitted += len(fresh)
            counters.succeeded += by_outcome[_SUCCEEDED]
            counters.cancelled += by_outcome[_CANCELLED]
            counters.failed += by_outcome[_FAILED]
            counters.timeouts += timeouts
