"""Each piece the scheduler core is composed of, tested alone (no SchedulerCore): shapes,
invocation records, the transition table, batches, gang verdicts, the model book, the
intake checks and the placement pass."""

from __future__ import annotations

from typing import Any

import pytest

from gpufn.exceptions import Cancelled
from gpufn.memory_pool.ledger import DeviceLedger, Fit, HostLedger
from gpufn.memory_pool.probe import simulated_devices
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books import batches, gang_verdict
from gpufn.scheduler.books.model_book import ModelBook
from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.calls.intake import Intake
from gpufn.scheduler.calls.transitions import TABLE, Transitions
from gpufn.scheduler.nouns.records import Device, FunctionRecord, Invocation
from gpufn.scheduler.nouns.settings import SchedulerConfig
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import INV_TRANSITIONS, DeviceState, InvState
from gpufn.scheduler.placement.placement_pass import (
    Dispatch,
    NeedRendezvous,
    PlacementPass,
    Preempt,
    WakeAt,
)
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec
from tests.unit.core_harness import Harness

GiB = 2**30
_seq = 0


def _fn(name: str = "f", models: tuple[str, ...] = (), **options: Any) -> FunctionRecord:
    fn = FunctionRecord(f"id-{name}", f"code-{name}", name, make_spec(**options), (b"code",))
    fn.model_keys = models
    return fn


def _inv(fn: FunctionRecord, submitted: float = 0.0, **options: Any) -> Invocation:
    global _seq
    _seq += 1
    spec = make_spec(fn.spec, **options) if options else fn.spec
    inv = Invocation(f"i{_seq}", fn, b"cli", spec, (b"args",), submitted, _seq)
    inv.history.append(("queued", submitted))
    return inv


def _devices(n: int = 2, memory: int = 8 * GiB) -> dict[str, Device]:
    host = HostLedger(64 * GiB)
    out = {}
    for info in simulated_devices("n", n, memory):
        d = Device(info=info, supervisor=b"sup", ledger=DeviceLedger(memory, host=host, key=info.key))
        d.state, d.worker = DeviceState.READY, f"w{info.index}".encode()
        out[d.key] = d
    return out


# --------------------------------------------------------------------------- shapes & records


def test_shapes_say_who_runs_reports_and_frees() -> None:
    devs = ("a", "b", "c")
    assert Shape.of(make_spec()) is Shape.SINGLE
    assert Shape.of(make_spec(batch_size=4)) is Shape.BATCH
    assert Shape.of(make_spec(count=3)) is Shape.GANG
    assert Shape.of(make_spec(count=3, spmd=False)) is Shape.HELD_SET
    assert Shape.GANG.runners(devs) == devs and Shape.GANG.reporters(devs) == 3
    assert Shape.HELD_SET.runners(devs) == ("a",) and Shape.HELD_SET.reporters(devs) == 1
    assert Shape.HELD_SET.frees_on_report(devs, "a") == devs  # its one process ended
    assert Shape.HELD_SET.frees_on_report(devs, "b") == ("b",)
    assert Shape.GANG.frees_on_report(devs, "b") == ("b",)
    assert not Shape.SINGLE.multi_device and Shape.HELD_SET.multi_device


def test_start_and_requeue_own_the_records_fields() -> None:
    inv = _inv(_fn(count=2), deadline=5.0)
    inv.deadline = 5.0
    inv.start(1.0, ("a", "b"), 7, Shape.GANG)
    assert (inv.state, inv.devices, inv.dispatch_token, inv.attempts) == (InvState.RUNNING, ("a", "b"), 7, 1)
    assert inv.deadline is None and inv.run_started is None and inv.reporters == 2
    inv.rank_results[0] = "r"
    inv.lost_ranks[1] = "gone"
    inv.failing_since, inv.cold, inv.gang = 2.0, "loaded", ("g", 1)
    inv.requeue(3.0)
    assert inv.state is InvState.QUEUED and inv.devices == () and inv.started is None
    assert (inv.rank_results, inv.lost_ranks, inv.failing_since, inv.cold, inv.gang) == ({}, {}, None, "", None)
    inv.preemptions = 1
    assert inv.counted_attempts == 0


def test_every_allowed_move_has_exactly_one_transition_function() -> None:
    allowed = {(a, b) for a, targets in INV_TRANSITIONS.items() for b in targets}
    assert set(TABLE) == allowed
    for move in TABLE.values():
        assert callable(move) and getattr(Transitions, move.__name__) is move


def test_a_move_the_table_does_not_list_raises_with_the_history() -> None:
    from gpufn.scheduler.nouns.states import IllegalTransition

    h = Harness(devices=1)
    h.start_worker(0)
    fid = h.register("f")
    inv = h.core.invocations[h.submit(fid)]
    assert inv.state is InvState.RUNNING
    with pytest.raises(IllegalTransition, match=r"running -> running.*history: queued"):
        h.core.tx.dispatch(inv, (h.core.devices["n:0"],), {}, h.now)


def test_a_queued_call_that_is_finished_leaves_the_queue() -> None:
    h = Harness(devices=1)  # its worker never starts: the call stays queued
    fid = h.register("f")
    inv = h.core.invocations[h.submit(fid)]
    assert len(h.core.queue) == 1
    h.core.tx.finish(inv, h.now, InvState.CANCELLED, Cancelled("no"))
    assert len(h.core.queue) == 0 and inv.state is InvState.CANCELLED


# --------------------------------------------------------------------------- batches


def test_batches_are_due_when_full_or_waited_and_split_per_member() -> None:
    fn = _fn("b", batch_size=2, batch_wait_ms=10)
    q = ReadyQueue()
    a = _inv(fn, submitted=1.0)
    q.push(a)
    assert batches.due(q, a) == 1.0 + 0.01
    b = _inv(fn, submitted=1.001)
    q.push(b)
    assert batches.due(q, a) is None
    carrier = batches.form(q, a, 99, 2.0)
    assert carrier.members == [a, b] and a.carrier is carrier and len(q) == 0
    items = [{"ok": True, "n": 1}, {"ok": False, "n": 1, "error_kind": "", "message": "bad",
                                    "type": "ValueError", "traceback": "tb"}]
    res = p.Result(carrier.id, True, "", "", p.ResultMeta(duration=0.5, batch_items=items),
                   (b"x", b"e"))
    ra, rb = batches.split_result(carrier, res)
    assert (ra.invocation_id, ra.ok, ra.frames, ra.meta.batch_size) == (a.id, True, (b"x",), 2)
    assert (rb.ok, rb.message, rb.meta.error_type, rb.frames) == (False, "bad", "ValueError", (b"e",))
    assert ra.meta.batch_items is None


# --------------------------------------------------------------------------- gang verdicts


def _gang(gather: bool = False) -> Invocation:
    inv = _inv(_fn("g", count=2, gather=gather))
    inv.start(0.0, ("a", "b"), 1, Shape.GANG)
    return inv


def test_gang_verdicts() -> None:
    inv = _gang(gather=True)
    inv.rank_results[1] = p.Result(inv.id, True, "", "", p.ResultMeta(), (b"one",))
    assert gang_verdict.verdict(inv) is None  # rank 0 has not reported
    inv.rank_results[0] = p.Result(inv.id, True, "", "", p.ResultMeta(duration=1.0), (b"zero",))
    v = gang_verdict.verdict(inv)
    assert isinstance(v, gang_verdict.Succeeded) and v.frames == (b"zero", b"one")
    assert v.meta.gather == [1, 1] and v.meta.duration == 1.0

    inv = _gang()
    inv.failing_since = 1.0
    inv.rank_results[0] = p.Result(inv.id, False, "", "peer gone", p.ResultMeta(comm_error=True))
    assert gang_verdict.verdict(inv) is None  # waits for rank 1 ...
    assert isinstance(gang_verdict.verdict(inv, force=True), gang_verdict.Failed)  # ... unless forced
    inv.rank_results[1] = p.Result(inv.id, False, "", "real", p.ResultMeta())
    v = gang_verdict.verdict(inv)
    assert isinstance(v, gang_verdict.Failed) and v.rank == 1  # the root cause, not the first

    inv = _gang()  # a rank stopped because the other failed may report before it
    inv.failing_since = 1.0
    inv.rank_results[1] = p.Result(inv.id, False, "Cancelled", "stopped: rank 0 failed",
                                   p.ResultMeta())
    inv.rank_results[0] = p.Result(inv.id, False, "RuntimeError", "break", p.ResultMeta())
    v = gang_verdict.verdict(inv)
    assert isinstance(v, gang_verdict.Failed) and v.rank == 0  # its own error, not Cancelled

    inv.lost_ranks[1] = "worker died"
    v = gang_verdict.verdict(inv)
    assert isinstance(v, gang_verdict.Lost) and (v.rank, v.why) == (1, "worker died")


# --------------------------------------------------------------------------- model book


def _book_with_model(size: int = 2 * GiB) -> tuple[ModelBook, str]:
    book = ModelBook()
    (key,) = book.register([{"name": "m", "code_id": "abcdef012345", "memory": size,
                             "nframes": 1}], (b"loader",))
    return book, key


def test_model_book_plans_resident_first_and_orders_admission() -> None:
    book, key = _book_with_model()
    devs = _devices(2)
    fn = _fn("u", (key,), memory="1GiB")
    inv = _inv(fn)
    d0, d1 = devs.values()
    best = book.best_plan(inv, [d0, d1], devs.values(), now=0.0)
    assert best is not None
    d, plan = best
    adm = book.admit(inv, d, plan, 0.0, devs)
    assert [type(m).__name__ for _, m in adm.orders] == ["LoadModel"]
    assert adm.cold == "loaded" and adm.names == {"m": key}
    book.on_event(d, p.ModelEvent(key, p.ModelState.RESIDENT, 2 * GiB, 0.5), 0.5)
    assert d.ledger.state(key) is Residency.RESIDENT and book.models[key].loads == 1
    d.ledger.release(inv.id, 1.0)
    again = book.best_plan(_inv(fn), [d0, d1], devs.values(), now=1.0)
    assert again is not None and again[0] is d and not again[1].load  # where it is resident


def test_model_book_waits_for_the_holding_device_rather_than_load_a_second_copy() -> None:
    book, key = _book_with_model()
    devs = _devices(2)
    d0, d1 = devs.values()
    fn = _fn("u", (key,), memory="1GiB")
    first = _inv(fn)
    plan = d0.ledger.fit(book.request(first))
    assert isinstance(plan, Fit)
    book.admit(first, d0, plan, 0.0, devs)
    book.on_event(d0, p.ModelEvent(key, p.ModelState.RESIDENT, 2 * GiB, 5.0), 0.0)  # slow loader
    fn.observe_runtime(0.1, d0.key)
    first.start(0.0, (d0.key,), 1, Shape.SINGLE)
    d0.running[first.id] = first
    # d0 is busy for ~0.1 s; loading a copy on d1 would take ~5 s: wait for d0.
    assert book.best_plan(_inv(fn), [d1], devs.values(), now=0.0) is None


def test_model_book_says_why_a_model_never_fits() -> None:
    book, key = _book_with_model(size=20 * GiB)
    why = book.never_fits(_fn("big", (key,)), 0, _devices(1).values())
    assert why is not None and "big" in why and "[m]" in why


# --------------------------------------------------------------------------- intake


def test_intake_refuses_unschedulable_and_full_queues() -> None:
    devs = _devices(1, memory=8 * GiB)
    q = ReadyQueue()
    intake = Intake(SchedulerConfig(max_queue=1), devs, q, ModelBook())
    fn = _fn("f")
    assert intake.refusal(fn, make_spec(memory="100GiB"), per_call=True).__class__.__name__ == "Unschedulable"
    assert intake.refusal(fn, fn.spec, per_call=False) is None
    q.push(_inv(fn))
    assert type(intake.refusal(fn, fn.spec, per_call=False)).__name__ == "QueueFull"


# --------------------------------------------------------------------------- placement pass


def _pass(devs: dict[str, Device], q: ReadyQueue, **cfg: Any) -> PlacementPass:
    return PlacementPass(SchedulerConfig(**cfg), devs, q, ModelBook())


def _run(pp: PlacementPass, now: float, port: int | None) -> list[Any]:
    """Drive a pass as the core does, applying each dispatch before it goes on."""
    out = []
    for decision in pp.run(now, port):
        out.append(decision)
        if isinstance(decision, Dispatch):
            pp.queue.pop(decision.inv.function.function_id)
            decision.inv.start(now, tuple(d.key for d in decision.devices), 1,
                               Shape.of(decision.inv.spec))
            for d in decision.devices:
                d.running[decision.inv.id] = decision.inv
    return out


def test_pass_dispatches_waits_for_batches_and_asks_for_the_store() -> None:
    devs, q = _devices(2), ReadyQueue()
    single = _inv(_fn("s"))
    q.push(single)
    [d] = _run(_pass(devs, q), 0.0, None)
    assert isinstance(d, Dispatch) and d.inv is single and len(d.devices) == 1

    q = ReadyQueue()
    q.push(_inv(_fn("b", batch_size=4, batch_wait_ms=50), submitted=0.0))
    [w] = _run(_pass(devs, q), 0.01, None)
    assert isinstance(w, WakeAt) and abs(w.when - 0.05) < 1e-9

    devs, q = _devices(2), ReadyQueue()
    q.push(_inv(_fn("g", count=2)))
    assert isinstance(_run(_pass(devs, q), 0.0, None)[0], NeedRendezvous)
    [g] = _run(_pass(devs, q), 0.0, 1234)
    assert isinstance(g, Dispatch) and len(g.devices) == 2


def test_pass_preempts_a_lower_priority_preemptible_call_when_full() -> None:
    devs, q = _devices(1), ReadyQueue()
    (d,) = devs.values()
    low = _inv(_fn("low", preemptible=True, memory="6GiB"))
    low.start(0.0, (d.key,), 1, Shape.SINGLE)
    d.running[low.id] = low
    d.running_by_fn[low.function.code_id] += 1
    d.ledger.reserve(low.id, low.spec.memory)
    high = _inv(_fn("high", priority=5, memory="6GiB"))
    q.push(high)
    [pre] = _run(_pass(devs, q), 1.0, None)
    assert isinstance(pre, Preempt) and pre.victim is low and pre.beneficiary is high
