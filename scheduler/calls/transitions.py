"""Invocation transitions, each with all of its effects, in one place.

Like Dask's worker state machine, `TABLE` maps each (start, finish) move of an
invocation to the one function that performs it, and every move is dispatched through
it (`dispatch`, `requeue`, `finish`); nothing else changes an invocation's state. The
functions update the record (its own `start`/`requeue`), the devices it holds, the
queue, the counters and the gang formations, and queue the messages that the move
implies (runs, model orders, cancels, results). They never call back into the core;
`RunObserver`s (usage, attached callers) are told when runs and calls end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields, replace

from gpufn.exceptions import Cancelled, GpufnError, WorkerLost, kind_of
from gpufn.memory_pool.ledger import Fit
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books import batches, gang_verdict
from gpufn.scheduler.books.gang_book import GangBook
from gpufn.scheduler.books.model_book import ModelBook
from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.nouns.events import Send
from gpufn.scheduler.nouns.records import Device, Invocation, Peer
from gpufn.scheduler.nouns.settings import Counters, SchedulerConfig
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import INV_TRANSITIONS, InvState, check
from gpufn.scheduler.placement.device_fit import gang_inline, is_short
from gpufn.wire import protocol as p
from gpufn.wire.rendezvous import DEFAULT_TIMEOUT_S, GangSpec, resolve_backend
from gpufn.wire.spec import retry_delay

log = logging.getLogger("gpufn.scheduler")

_TERMINAL = (InvState.SUCCEEDED, InvState.FAILED, InvState.CANCELLED)
# A call lost with its worker before it started is queued again with no attempt used, at
# most this many times: one whose setup takes its worker down each time (its code's
# import, a model's load) would go round for ever; the losses after count as attempts.
UNSTARTED_LOSSES = 3
_GANG_FIELD = [f.name for f in fields(p.RunMeta)].index("gang")



class RunObserver:
    """Told by `Transitions` of the ends of runs and calls; override what you watch."""

    def run_ended(self, inv: Invocation, state: InvState, now: float) -> None:
        """A run ended: finished in `state`, or QUEUED when it was queued again."""

    def call_ended(self, inv: Invocation, result: p.Result) -> None:
        """The call's terminal Result, once, after its caller was sent it."""


class Transitions:
    def __init__(self, config: SchedulerConfig, devices: dict[str, Device], queue: ReadyQueue,
                 invocations: dict[str, Invocation], peers: dict[bytes, Peer], counters: Counters,
                 gangs: GangBook, models: ModelBook, out: list[Send]) -> None:
        self.config = config
        self.devices = devices
        self.queue = queue
        self.invocations = invocations
        self.peers = peers
        self.counters = counters
        self.gangs = gangs
        self.models = models
        self.out = out
        self.now = 0.0  # the time of the event being handled (set by the core)
        self.dirty = False  # devices were freed or calls queued: a pass is worth running
        self.tokens = 0  # dispatch tokens (see Invocation.dispatch_token)
        self.rendezvous_port: int | None = None
        self.failing: set[Invocation] = set()  # gangs waiting for their ranks to settle
        self.observers: list[RunObserver] = []  # told of run and call ends, in order

    def send(self, peer: bytes, msg: p.Message) -> None:
        self.out.append(Send(peer, msg))

    @staticmethod
    def _move(inv: Invocation, to: InvState) -> Callable[..., None]:
        """The function that performs `inv`'s move to `to` (see `TABLE`); an illegal move
        raises `IllegalTransition` with the call's history."""
        check(f"invocation {inv.id} ({inv.function.name})", INV_TRANSITIONS, inv.state, to,
              inv.history)
        return TABLE[(inv.state, to)]

    # ------------------------------------------------------------------ the moves

    def dispatch(self, inv: Invocation, devices: tuple[Device, ...], plans: dict[str, Fit],
                 now: float) -> None:
        """QUEUED -> RUNNING: hold the devices, admit the models, send the runs."""
        self._move(inv, InvState.RUNNING)(self, inv, devices, plans, now)

    def requeue(self, inv: Invocation, now: float, why: str, retry: bool = False,
                not_before: float | None = None) -> None:
        """RUNNING -> QUEUED: the run ended without a result; the call waits again. A
        retry backs off first (`not_before`, else the lost-worker backoff) and then prefers
        devices other than the ones it was lost on."""
        self._move(inv, InvState.QUEUED)(self, inv, now, why, retry, not_before)

    def finish(self, inv: Invocation, now: float, state: InvState, error: GpufnError | None = None,
               result: p.Result | None = None, release: bool = True) -> None:
        """Move an invocation to a terminal state and tell its client (exactly once). A
        queued call leaves the queue. With release=False a running call keeps its hold on
        its devices until its workers report that they stopped (a cancelled call still
        occupies its worker)."""
        self._move(inv, state)(self, inv, now, state, error, result, release)

    def _dispatch(self, inv: Invocation, devices: tuple[Device, ...], plans: dict[str, Fit],
                  now: float) -> None:
        self.tokens += 1
        shape = Shape.of(inv.spec)
        inv.start(now, tuple(d.key for d in devices), self.tokens, shape)
        for m in inv.members:
            m.start(now, inv.devices, inv.dispatch_token, shape)
        fn = inv.function
        for d, meta in zip(devices, self._run_metas(inv, devices), strict=True):
            assert d.worker is not None
            d.running[inv.id] = inv
            d.running_by_fn[fn.code_id] += 1
            plan = plans.get(d.key)
            if plan is not None:
                admitted = self.models.admit(inv, d, plan, now, self.devices)
                for target, order in admitted.orders:  # model orders go first
                    assert target.worker is not None
                    self.send(target.worker, order)
                inv.cold = admitted.cold
                if meta is not None:
                    meta.models = admitted.names
                    if plan.load or plan.restore or plan.waiting:
                        meta.inline = False  # it waits for a model: never on the main thread
            else:
                d.ledger.reserve(inv.id, inv.spec.memory)
            if meta is None:
                continue  # a held device of a HELD_SET: nothing runs there
            if fn.code_id not in d.code:
                self.send(d.worker, p.LoadCode(fn.code_id, fn.name, fn.code_frames))
                d.code.add(fn.code_id)
            self.send(d.worker, p.Run(inv.id, fn.function_id, fn.code_id, fn.name,
                                       inv.dispatch_token, meta, inv.frames))
        self.advance_starts(devices[0], now)

    def sweep_shards(self, now: float) -> None:
        """Send the orders that remove stale shards (see `ModelBook.sweep`)."""
        for d, order in self.models.sweep(self.devices, now):
            if d.worker is not None:
                self.send(d.worker, order)

    def run_meta(self, inv: Invocation, d: Device) -> p.RunMeta:
        """What a single-device call's worker is told with its run (a lease's template)."""
        meta = self._run_metas(inv, (d,))[0]
        assert meta is not None
        return meta

    def _run_metas(self, inv: Invocation, devices: tuple[Device, ...]) -> list[p.RunMeta | None]:
        """What each device's worker is told with the run (None: it runs nothing)."""
        spec = inv.spec
        # (`gpufn.context().attempt`: the runs that started, this one too; a dispatch lost
        # with its worker before it started was no attempt)
        base = p.RunMeta(attempt_number=inv.attempts - inv.unstarted_losses, timeout=spec.timeout,
                         concurrency=spec.concurrency,
                         inline=is_short(inv, self.config.short_call_seconds),
                         app=inv.function.app, version=inv.function.version,
                         retry_on=list(spec.retry_on) or None, host_memory=spec.host_memory,
                         shm_owner=self._shm_owner(inv, devices[0]), priority=spec.priority)
        if inv.shape is Shape.BATCH:
            base.batch = [len(m.frames) for m in inv.members]
            base.members = [m.id for m in inv.members]
        if inv.shape is Shape.GANG:
            formation, warm = self.gangs.form(inv.devices)
            inv.gang = (formation.gang_id, formation.generation)
            inv.function.warm_gang = inv.devices
            if not warm or not formation.backend:  # a warm group keeps the backend it has
                formation.backend = resolve_backend(devices[0].info.kind)
            assert self.rendezvous_port is not None
            base.gather, base.warm = spec.gather, warm
            base.inline = gang_inline(inv, self.config.short_call_seconds, warm)
            gang = GangSpec(formation.gang_id, formation.generation, 0, len(devices), "",
                            self.rendezvous_port, formation.backend,
                            spec.timeout or DEFAULT_TIMEOUT_S, inv.devices, formation.nonce).to_wire()
            # One spec for the formation; each rank's copy differs only in its rank.
            values = base.to_wire()  # type: ignore[attr-defined]
            metas: list[p.RunMeta | None] = []
            for rank in range(len(devices)):
                values[_GANG_FIELD] = {**gang, "rank": rank}
                metas.append(p.RunMeta(*values))
            return metas
        if inv.shape is Shape.HELD_SET:
            # One process pinned to every granted device runs the call on the first
            # device's worker; the other devices are held idle for it.
            multi = [{"key": d.key, "uuid": d.info.uuid, "kind": d.info.kind} for d in devices]
            return [replace(base, multi=multi)] + [None] * (len(devices) - 1)
        return [base]

    def _shm_owner(self, inv: Invocation, d: Device) -> int:
        """The caller's pid when its big results may go through shared memory: it asked,
        and it shares the device's host and user (see gpufn/wire/shm.py); else 0."""
        if not inv.shm:
            return 0
        caller, sup = self.peers.get(inv.client), self.peers.get(d.supervisor)
        if caller is None or sup is None or not caller.info.host or caller.info.host != sup.info.host:
            return 0
        return caller.pid

    def _requeue(self, inv: Invocation, now: float, why: str, retry: bool,
                 not_before: float | None) -> None:
        for o in self.observers:
            o.run_ended(inv, InvState.QUEUED, now)
        lost_on = inv.devices
        inv.requeue(now)
        if retry:
            inv.lost_on = lost_on
            inv.not_before = (not_before if not_before is not None
                              else now + self.config.retry_delay(max(1, inv.counted_attempts)))
        else:
            inv.not_before = 0.0
        self.queue.push(inv, now)
        self.dirty = True
        if retry:
            self.counters.retried += 1
            # A raised exception that Retries(on=...) matches is retried as the caller asked
            # (INFO; its `why` states the delay); a lost worker is worth a WARNING.
            raised = not_before is not None
            log.log(logging.INFO if raised else logging.WARNING, "[%s] %s: %s%s", inv.id,
                    inv.function.name, why,
                    "" if raised else f"; retrying in {inv.not_before - now:.2g}s")
        else:
            log.info("[%s] %s: %s; queued again", inv.id, inv.function.name, why)

    def _drop(self, inv: Invocation, now: float, state: InvState, error: GpufnError | None,
              result: p.Result | None, release: bool) -> None:
        """QUEUED -> FAILED or CANCELLED: refused, expired, unplaceable or cancelled."""
        self.queue.discard(inv)
        self._finish(inv, now, state, error, result, release)

    def _finish(self, inv: Invocation, now: float, state: InvState, error: GpufnError | None,
                result: p.Result | None, release: bool) -> None:
        inv.to(state, now)
        for o in self.observers:
            o.run_ended(inv, state, now)
        if release:
            for key in inv.devices:
                self.release_device(inv, self.devices.get(key))
        self.invocations.pop(inv.id, None)
        if inv.members:  # a batch carrier: its calls get the outcome, not a client
            for m in inv.members:
                if m.state is InvState.RUNNING and state is not InvState.SUCCEEDED:
                    res = (p.Result(m.id, False, result.error_kind, result.message,
                                    self.meta(m, now, result.meta), result.frames)
                           if result is not None else None)
                    self.finish(m, now, state, error, res, release=False)
            return
        if state is InvState.SUCCEEDED:
            self.counters.succeeded += 1
        elif state is InvState.CANCELLED:
            self.counters.cancelled += 1
        else:
            self.counters.failed += 1
        if result is None:
            assert error is not None
            result = p.Result(inv.id, False, kind_of(error), str(error), self.meta(inv, now))
        if inv.client in self.peers:
            self.send(inv.client, result)
        for o in self.observers:
            o.call_ended(inv, result)

    def meta(self, inv: Invocation, now: float, base: p.ResultMeta | None = None,
             owned: bool = False) -> p.ResultMeta:
        """The caller's result meta: what the worker reported plus where and when it ran
        (`owned`: `base` is this call's alone, decoded for it, and is filled in place)."""
        meta = (base if owned else replace(base)) if base is not None else p.ResultMeta()
        meta.devices = list(inv.devices)
        meta.attempts = inv.attempts
        meta.queued_s = (inv.started or now) - inv.submitted
        meta.cold_start = inv.cold or (inv.carrier.cold if inv.carrier else "")
        return meta

    def release_device(self, inv: Invocation, d: Device | None) -> None:
        """Free what a call holds on one device."""
        if d is None:
            return
        d.stopping.pop(inv.id, None)
        if d.running.pop(inv.id, None) is None:
            return
        self.advance_starts(d, self.now)  # a pipelined call behind it starts now
        code = inv.function.code_id  # with_options() variants share one concurrency limit
        d.running_by_fn[code] -= 1
        if d.running_by_fn[code] <= 0:
            del d.running_by_fn[code]
        d.ledger.release(inv.id, self.now)
        self.dirty = True

    def release_reporter(self, inv: Invocation, d: Device) -> None:
        """A process of the call ended on `d`: free what its end frees (see `Shape`)."""
        for key in inv.shape.frees_on_report(inv.devices, d.key):
            self.release_device(inv, self.devices.get(key))
        self.release_device(inv, d)

    def advance_starts(self, d: Device, now: float) -> None:
        """Mark calls on a device as really running (their timeout clock starts) once
        their models are resident and no earlier call of theirs holds their slot. A lease
        holds none here: its worker runs a call sent beside it between the lease's calls,
        at most one of them later (its clock had waited for the lease's end, so a call
        pipelined beside its function's lease was never timed)."""
        busy: dict[str, int] = {}
        waiting = []
        for inv in d.running.values():
            if inv.state is not InvState.RUNNING or inv.lease is not None:
                continue
            if inv.run_started is not None:
                busy[inv.function.code_id] = busy.get(inv.function.code_id, 0) + 1
            else:
                waiting.append(inv)
        for inv in sorted(waiting, key=lambda i: (i.started or now, i.seq)):
            code = inv.function.code_id
            if busy.get(code, 0) >= inv.spec.concurrency:
                continue
            if any(d.ledger.state(k) is not Residency.RESIDENT for k in inv.function.model_keys):
                continue
            inv.run_started = now
            busy[code] = busy.get(code, 0) + 1

    def stop_ranks(self, inv: Invocation, reason: str) -> None:
        """Interrupt every process of the call still holding a device (a gang also tears
        its group down); the devices are freed as the processes report."""
        gang = inv.gang
        if gang is not None:
            self.gangs.broken(inv.devices)
        for key in inv.shape.runners(inv.devices):
            d = self.devices.get(key)
            target = (d.control or d.worker) if d is not None else None
            if d is None or inv.id not in d.running or target is None:
                continue
            d.stopping.setdefault(inv.id, self.now)
            self.send(target, p.Cancel(inv.id, reason, True, inv.dispatch_token))
            if gang is not None:
                self.send(target, p.GroupOp(p.GroupOpKind.ABORT, {"gang_id": gang[0], "generation": gang[1],
                                                       "reason": reason}))

    def preempt(self, victim: Invocation, beneficiary: Invocation, now: float) -> None:
        """Stop a preemptible call and queue it again (its device stays held until its
        worker reports it stopped)."""
        reason = (f"preempted by {beneficiary.function.name} call {beneficiary.id} "
                  f"(priority {beneficiary.spec.priority} > {victim.spec.priority})")
        self.counters.preempted += 1
        victim.preemptions += 1
        beneficiary.preempt_asked = now
        self.stop_ranks(victim, reason)
        self.requeue(victim, now, reason)

    def cancel_running(self, inv: Invocation, now: float, reason: str) -> None:
        """Tell the caller at once; the devices stay held until the worker stops the call."""
        self.stop_ranks(inv, reason)
        self.finish(inv, now, InvState.CANCELLED, Cancelled(
            f"{inv.function.name} call {inv.id} was cancelled while running ({reason})"),
            release=False)

    def finish_batch(self, carrier: Invocation, msg: p.Result, now: float) -> None:
        if not msg.ok:  # the batch as a whole failed: every member gets the error
            self.finish(carrier, now, InvState.FAILED, result=msg)
            return
        results = batches.split_result(carrier, msg)
        self.finish(carrier, now, InvState.SUCCEEDED, result=msg)
        for m, res in zip(carrier.members, results, strict=False):
            if m.state is InvState.RUNNING:
                self.finish(m, now, InvState.SUCCEEDED if res.ok else InvState.FAILED,
                             result=p.Result(m.id, res.ok, res.error_kind, res.message,
                                             self.meta(m, now, res.meta), res.frames),
                             release=False)

    def gang_failing(self, inv: Invocation, now: float, reason: str) -> None:
        if inv.failing_since is None:
            inv.failing_since = now
            self.failing.add(inv)
            self.stop_ranks(inv, reason)

    def settle(self, inv: Invocation, now: float, force: bool = False) -> None:
        """Finish a multi-device call once its verdict is in (see `gang_verdict`)."""
        if inv.state is not InvState.RUNNING:
            return
        v = gang_verdict.verdict(inv, force)
        if isinstance(v, gang_verdict.Succeeded):
            if v.run_time is not None:  # the inline rule's measure (see gang_verdict)
                inv.function.observe_runtime(v.run_time, inv.devices[0])
            self.finish(inv, now, InvState.SUCCEEDED, result=p.Result(
                inv.id, True, "", "", self.meta(inv, now, v.meta), v.frames), release=False)
        elif isinstance(v, gang_verdict.Lost):
            self.retry_or_fail_lost(inv, now, f"{v.why} (rank {v.rank})")
        elif isinstance(v, gang_verdict.Failed):
            msg = v.result
            self.retry_or_fail(inv, now, p.Result(
                inv.id, False, msg.error_kind, msg.message,
                self.meta(inv, now, replace(msg.meta, rank=v.rank)), msg.frames), release=False)

    def lost_with_worker(self, inv: Invocation, d: Device, now: float, why: str,
                         started: bool) -> None:
        """The worker of `d` died while `inv` ran there (`started`: its clock had started,
        as the caller read it before freeing anything): retry or fail a single-device
        call; a gang's other ranks stop and keep their devices until they report."""
        self.counters.lost += 1
        never_started = not started and not inv.members
        self.release_reporter(inv, d)
        if not inv.shape.multi_device:
            if never_started:
                self._lost_unstarted(inv)
            self.retry_or_fail_lost(inv, now, why)
            return
        inv.lost_ranks[inv.devices.index(d.key)] = why
        self.gang_failing(inv, now, why)
        self.settle(inv, now)

    def failed_with_worker(self, inv: Invocation, d: Device, now: float, error: GpufnError) -> None:
        """The worker of `d` was stopped for what ran there (over its host-memory limit):
        the call fails with `error`, never retried; a gang's other ranks stop."""
        self.counters.lost += 1
        self.release_reporter(inv, d)
        if not inv.shape.multi_device:
            self.finish(inv, now, InvState.FAILED, error)  # a batch's calls all get it
            return
        rank = inv.devices.index(d.key)
        inv.rank_results[rank] = p.Result(inv.id, False, kind_of(error), str(error),
                                          p.ResultMeta(rank=rank))
        self.gang_failing(inv, now, str(error))
        self.settle(inv, now)

    def adopt(self, inv: Invocation, d: Device, dispatch_token: int, attempt: int, now: float,
              queued: bool, ran_seconds: float = 0.0) -> None:
        """A resubmitted call that `d`'s worker runs (or ran, holding its Result) since the
        previous scheduler (see `recovery.py`): it becomes RUNNING there as that dispatch,
        without a Run; its Result is handled as any other. Not a placement, so not in
        `TABLE`; the record's own move (`Invocation.start`) checks QUEUED -> RUNNING, and a
        queued call leaves the queue here. Its run started `ran_seconds` ago, as its worker
        says: its device time is billed from then and its timeout counts from then."""
        inv.start(now, (d.key,), dispatch_token, Shape.SINGLE)
        inv.attempts = max(1, attempt)
        inv.started = inv.run_started = now - max(0.0, ran_seconds)
        if queued:
            self.queue.discard(inv)
        d.running[inv.id] = inv
        d.running_by_fn[inv.function.code_id] += 1
        d.ledger.reserve(inv.id, inv.spec.memory)
        needs = self.models.request(inv).needs()
        if needs and all(d.ledger.state(n.name) is Residency.RESIDENT for n in needs):
            d.ledger.acquire(inv.id, needs, now, inv.function.name)  # not evicted under it
        self.dirty = True
        log.info("[%s] %s: taken over on %s from the previous scheduler (attempt %d)",
                 inv.id, inv.function.name, d.key, inv.attempts)

    def lost_before_restart(self, inv: Invocation, now: float,
                            why: str = "its worker was running it when the scheduler restarted",
                            error: type[GpufnError] = WorkerLost) -> None:
        """A resubmitted call that ran before (a worker ran it under the previous scheduler,
        see `recovery.py`, or it was stopped when its client was forgotten): that run counts
        as an attempt lost."""
        if inv.state is not InvState.QUEUED or inv.attempts:
            return  # dispatched by this scheduler already: that loss was counted then
        inv.attempts += 1
        self.counters.lost += 1
        if inv.counted_attempts <= inv.spec.retries:
            self.counters.retried += 1
            log.warning("[%s] %s: %s; queued again", inv.id, inv.function.name, why)
            return
        log.warning("[%s] %s: %s; failed (no retries left)", inv.id, inv.function.name, why)
        self.finish(inv, now, InvState.FAILED, error(
            f"{inv.function.name} call {inv.id}: {why}, so whether it completed is unknown."
            " Set retries=N in @gpu to run it again in such a case."))

    def carry_attempts(self, inv: Invocation, attempts: int, raised: bool, device: str,
                       now: float) -> float:
        """A call resubmitted by its client after `attempts` under a lease (the last lost
        with its worker, or `raised` an exception its `Retries(on=...)` matches): they
        count against its retries as dispatches here would; when it may start (the
        backoff its scheduled retry would wait)."""
        inv.attempts = attempts
        inv.lost_on = (device,) if device else ()
        n = max(1, inv.counted_attempts)
        if n <= inv.spec.retries:
            self.counters.retried += 1
        return now + (retry_delay(inv.spec, n) if raised else self.config.retry_delay(n))

    def out_of_retries(self, inv: Invocation, now: float, raised: bool, lost: str = "") -> None:
        """A resubmitted call whose attempts under a lease used its retries (this is the
        rule, said once, here); `lost`: why its lease's worker was lost, if known."""
        why = ("raised an exception it retries on" if raised
               else "its worker was lost during a lease" + (f" ({lost})" if lost else ""))
        log.warning("[%s] %s: %s; failed (no retries left)", inv.id, inv.function.name, why)
        fix = "" if raised else (" Whether it completed there is unknown. Set retries=N "
                                 "in @gpu to run it again in such a case."
                                 if inv.spec.retries == 0 else "")
        used = (f"after {inv.attempts} attempt(s), more than its retries "
                f"({inv.spec.retries}) allow" if inv.spec.retries else "and it has no retries")
        self.finish(inv, now, InvState.FAILED, WorkerLost(
            f"{inv.function.name} call {inv.id}: {why} {used}.{fix}"))

    def retry_or_fail(self, inv: Invocation, now: float, result: p.Result,
                      release: bool = True) -> None:
        """A run ended with `result`: finish the call with it, unless it raised an exception
        its `Retries(on=...)` matches (the worker judged: `meta.retryable`), retries are
        left and it streamed nothing yet; then it is queued again, to start no earlier
        than its backoff delay from now."""
        if (not result.ok and result.meta.retryable and not inv.members and not inv.items
                and inv.counted_attempts <= inv.spec.retries):
            n = inv.counted_attempts
            delay = retry_delay(inv.spec, n)
            if release:
                for key in inv.devices:
                    self.release_device(inv, self.devices.get(key))
            self.requeue(inv, now, f"raised {result.meta.error_type or 'an exception'}; retry "
                                   f"{n} of {inv.spec.retries} in {delay:g}s", retry=True,
                         not_before=now + delay)
            return
        self.finish(inv, now, InvState.SUCCEEDED if result.ok else InvState.FAILED,
                    result=result, release=release)

    @staticmethod
    def _lost_unstarted(inv: Invocation) -> None:
        """It never ran: queued again with no retry used, up to UNSTARTED_LOSSES times."""
        if inv.unstarted_losses < UNSTARTED_LOSSES:
            inv.unstarted_losses += 1

    def retry_or_fail_lost(self, inv: Invocation, now: float, why: str) -> None:
        if inv.members:  # a lost batch: each of its calls is retried or fails on its own
            for m in inv.members:
                if m.state is InvState.RUNNING:
                    if inv.run_started is None:  # the batch never started
                        self._lost_unstarted(m)
                    self.retry_or_fail_lost(m, now, why)
            self.finish(inv, now, InvState.FAILED, release=False)
            return
        if inv.counted_attempts <= inv.spec.retries and not inv.items:
            self.requeue(inv, now, why, retry=True)
            return
        hint = "" if inv.spec.retries else " Set retries=N in @gpu to retry on another worker."
        if inv.unstarted_losses >= UNSTARTED_LOSSES:
            hint = (f" Its worker was lost {inv.unstarted_losses} more time(s) before it "
                    "started: its code's import or its models' load may take the worker "
                    "down (see the worker's log).")
        if inv.items:
            hint = f" It had streamed {inv.items} value(s), so it was not retried."
        log.warning("[%s] %s: %s; failed with WorkerLost (no retries left)", inv.id,
                    inv.function.name, why)
        self.finish(inv, now, InvState.FAILED, WorkerLost(
            f"{inv.function.name} call {inv.id}: {why} after {inv.attempts} attempt(s).{hint}"),
            release=False)


# (from, to) -> the function that performs the move; every move is dispatched through it.
TABLE: dict[tuple[InvState, InvState], Callable[..., None]] = {
    (InvState.QUEUED, InvState.RUNNING): Transitions._dispatch,
    (InvState.RUNNING, InvState.QUEUED): Transitions._requeue,
    (InvState.QUEUED, InvState.FAILED): Transitions._drop,  # refused, expired, unplaceable
    (InvState.QUEUED, InvState.CANCELLED): Transitions._drop,
    **{(InvState.RUNNING, t): Transitions._finish for t in _TERMINAL},
}
