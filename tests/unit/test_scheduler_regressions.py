"""Regressions from review: each drives the pure core through a message order that once
lost, duplicated, stranded or wrongly stopped a call."""

from __future__ import annotations

from typing import Any

import pytest

from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

from .core_harness import GiB, Harness


def _with_model(h: Harness, name: str, mem: int, **options: Any) -> str:
    spec = make_spec(**options)
    fid = f"{name}-{hash(spec)}"
    models = [{"name": "m", "code_id": "abcdef0123456", "memory": mem, "pin": False,
               "offload": True, "nframes": 1}]
    h.feed(b"cli", p.Register(fid, f"code-{name}", name, spec.to_wire(), models,
                              (b"code", b"loader")))
    return fid


def test_a_batch_whose_model_was_under_declared_requeues_its_calls() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    f = _with_model(h, "b", 1 * GiB, batch_size=2, batch_wait_ms=5)
    a, b = h.submit(f), h.submit(f)
    (run,) = h.runs(w)
    key = next(iter(h.core.models.models))
    h.feed(w, p.ModelEvent(key, "load_failed", 2 * GiB, 0.0, "OutOfMemory", "too big"))
    h.feed(w, p.Result(run.invocation_id, False, "OutOfMemory", "oom", p.ResultMeta(dispatch_token=run.dispatch_token)))
    h.tick(0.1)
    again = h.runs(w)[-1]
    assert again.meta.members == [a, b] and again.meta.batch == [1, 1]  # not nested
    h.feed(w, p.ModelEvent(key, "resident", 2 * GiB, 0.1))
    items = [{"ok": True, "n": 1}, {"ok": True, "n": 1}]
    h.feed(w, p.Result(again.invocation_id, True, "", "", p.ResultMeta(dispatch_token=again.dispatch_token, batch_items=items), (b"x", b"y")))
    assert h.results()[a].frames == (b"x",) and h.results()[b].frames == (b"y",)


def test_a_model_that_fits_nowhere_once_measured_fails_its_calls() -> None:
    h = Harness(devices=1, memory=8 * GiB)
    w = h.start_worker(0)
    f = _with_model(h, "g", 4 * GiB, memory="1GiB")
    a = h.submit(f)
    key = next(iter(h.core.models.models))
    h.feed(w, p.ModelEvent(key, "load_failed", 10 * GiB, 0.0, "OutOfMemory", "needs 10GiB"))
    h.feed(w, p.Result(a, False, "OutOfMemory", "oom", p.ResultMeta(dispatch_token=h.token(a))))
    b = h.submit(f)
    h.tick(0.1)
    assert h.results()[a].error_kind == h.results()[b].error_kind == "Unschedulable"
    assert len(h.core.queue) == 0


def test_only_the_calls_that_waited_for_the_load_are_replanned() -> None:
    h = Harness(devices=1, memory=8 * GiB)
    w = h.start_worker(0)
    f = _with_model(h, "g", 1 * GiB, concurrency=2)
    a = h.submit(f)
    key = next(iter(h.core.models.models))
    h.feed(w, p.ModelEvent(key, "load_failed", 2 * GiB, 0.0, "OutOfMemory", "bigger"))
    h.feed(w, p.Result(a, False, "OutOfMemory", "oom", p.ResultMeta(dispatch_token=h.token(a))))
    assert h.core.invocations[a].state is not InvState.FAILED  # re-planned
    h.feed(w, p.ModelEvent(key, "resident", 2 * GiB, 0.1))
    h.finish(w, a)
    b = h.submit(f)  # later, a real OOM in the user's code fails alone, once
    h.feed(w, p.Result(b, False, "OutOfMemory", "user oom", p.ResultMeta(dispatch_token=h.token(b))))
    assert h.results()[b].error_kind == "OutOfMemory"
    assert len([r for r in h.runs() if r.invocation_id == b]) == 1


def test_cancelling_a_single_process_multi_device_call_frees_every_device() -> None:
    h = Harness(devices=2)
    w0 = h.start_worker(0)
    h.start_worker(1)
    f = h.register("multi", count=2, spmd=False)
    inv = h.submit(f)
    h.feed(b"cli", p.Cancel(inv))
    assert [s.peer for s in h.of_type(p.Cancel) if s.msg.invocation_id == inv] == [w0]
    h.feed(w0, p.Result(inv, False, "Cancelled", "stopped", p.ResultMeta(dispatch_token=h.token(inv))))
    assert all(not d.running for d in h.core.devices.values())
    h.tick(dt=30.0)
    assert not h.of_type(p.KillWorker)


def test_losing_a_held_device_stops_the_one_process_before_anything_reruns() -> None:
    h = Harness(devices=3)
    w0 = h.start_worker(0)
    h.start_worker(1)
    h.start_worker(2)
    f = h.register("multi", count=2, spmd=False, retries=1)
    inv = h.submit(f)
    first, second = h.core.invocations[inv].devices
    assert first == "n:0"
    h.feed(b"sup", p.WorkerExited(second, 100, -9, "killed"))
    assert inv in h.core.devices["n:0"].running  # still running there: not rerun yet
    assert [s.peer for s in h.of_type(p.Cancel)] == [w0]
    h.feed(w0, p.Result(inv, False, "Cancelled", "stopped", p.ResultMeta(dispatch_token=h.token(inv))))
    h.tick(0.25)  # the retry's backoff
    assert h.core.invocations[inv].state is InvState.RUNNING  # the retry, elsewhere or here
    assert h.core.invocations[inv].attempts == 2


def test_preemption_also_happens_when_every_slot_is_taken() -> None:
    h = Harness(devices=1, memory=8 * GiB, slots_per_device=2)
    h.start_worker(0)
    lo = h.register("lo", preemptible=True, concurrency=2, memory="1GiB")
    hi = h.register("hi", priority=5, memory="7GiB")
    h.submit(lo)
    h.submit(lo)
    h.submit(hi)
    assert h.core.counters.preempted == 1


def test_what_a_batch_prints_reaches_each_caller() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    f = h.register("b", batch_size=2, batch_wait_ms=50)
    a, b = h.submit(f), h.submit(f)
    (run,) = h.runs(w)
    h.feed(w, p.Output(run.invocation_id, "stdout", "hello\n"))
    outs = {s.msg.invocation_id for s in h.of_type(p.Output) if s.peer == b"cli"}
    assert outs == {a, b}


def test_batch_members_lost_before_the_batch_started_use_no_retry() -> None:
    h = Harness(devices=1)
    h.start_worker(0)
    f = _with_model(h, "b", 1 * GiB, batch_size=2, batch_wait_ms=5)
    a, b = h.submit(f), h.submit(f)  # the batch waits for its model to load
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed"))
    assert h.core.invocations[a].state is InvState.QUEUED
    assert h.core.invocations[b].state is InvState.QUEUED


def test_a_result_from_an_earlier_dispatch_never_releases_a_later_one() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    f = h.register("f")
    inv = h.submit(f)
    token = h.token(inv)
    h.feed(w, p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=token + 1000), (b"old",)))
    assert inv not in h.results() and inv in h.core.devices["n:0"].running
    assert h.core.counters.stale_results == 1
    h.finish(w, inv)
    assert h.results()[inv].ok and h.results()[inv].frames == (b"value",)


def test_a_submit_the_core_fails_to_handle_fails_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug while admitting a call answers that call with an error: it never hangs."""
    h = Harness(devices=1)
    h.start_worker(0)
    fid = h.register("f")

    def broken(*a: object, **k: object) -> None:
        raise NameError("a bug")

    monkeypatch.setattr(h.core.intake, "refusal", broken)
    inv = h.submit(fid)
    res = h.results()[inv]
    assert not res.ok and "could not handle Submit" in res.message and "a bug" in res.message
