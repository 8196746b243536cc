"""A spawned call of a deployed function whose spawner left survives a head restart: the
durable scheduler notes it on disk (once a second, its row leaving with its Result), the
next one admits it again on its version, takes it over from the worker that runs or holds
it (never a second run), counts a `ran` report as a lost attempt, merges it with its
spawner's own resubmit, and keeps its Result for `FunctionCall.from_id`. Also: a call
counted as lost and queued again is taken over when its worker reports it late."""

from __future__ import annotations

from pathlib import Path

from gpufn.scheduler.nouns.states import InvState
from gpufn.scheduler.stores.deployments import DeploymentStore
from gpufn.scheduler.stores.kept_results import DetachedCall, KeptResults
from gpufn.scheduler.stores.ops import OpsStore
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

from .core_harness import Harness
from .test_deployments import runs_of

ALIAS = p.app_alias("evals", "f")


def _durable(tmp_path: Path, devices: int = 1) -> Harness:
    """A `gpufn serve` scheduler on `tmp_path`: its books on disk."""
    return Harness(devices=devices, state_dir=str(tmp_path),
                   ops=OpsStore(tmp_path / "ops.sqlite"), restart_grace_seconds=3.0)


def _deploy(h: Harness, retries: int = 0, code: str = "c1") -> None:
    fn = {"name": "f", "function_id": f"base-{code}", "code_id": code,
          "spec": make_spec(retries=retries).to_wire(), "models": [], "ncode": 1}
    h.feed(b"cli", p.Deploy(7, "evals", {"code_hash": code}, [fn], (code.encode(),)))
    assert [s.msg for s in h.of_type(p.AppReply)][-1].ok


def _killed(h: Harness) -> None:
    """SIGKILL after a second: what was written by then is on disk, nothing else."""
    h.core.streams.results.close()  # the writes queued so far reach the disk
    h.core.apps.store.close()
    h.core.ops.store.close()


def _spawned_and_left(tmp_path: Path, n: int = 2, retries: int = 0) -> tuple[Harness, list[str]]:
    """The first scheduler: `n` spawned calls (the first runs, the others wait), their
    spawner leaves, a second passes (they are noted), then the head is killed."""
    h = _durable(tmp_path)
    h.start_worker(0)
    _deploy(h, retries)
    ids = [h.submit(ALIAS, keep=True) for _ in range(n)]
    h.feed(b"cli", p.Goodbye("notebook closed"))
    h.tick(1.5)
    assert h.core.invocations[ids[0]].state is InvState.RUNNING
    _killed(h)
    return h, ids


def _back(h: Harness, index: int = 0, **report: object) -> bytes:
    peer = f"w{index}".encode()
    msg = h.hello(peer, p.Role.WORKER, info={"device": f"n:{index}", "incarnation": 3, **report})
    assert isinstance(msg, p.Welcome) and msg.ok, msg
    return peer


def _done(h: Harness, worker: bytes, inv: str, token: int, value: bytes = b"value") -> None:
    h.feed(worker, p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=token, duration=1.0),
                            (value,)))


def _found_later(h: Harness, inv: str) -> p.Result:
    """`FunctionCall.from_id(inv).get()` from a new process."""
    h.hello(b"later", p.Role.CLIENT)
    h.feed(b"later", p.Attach(inv))
    return [s.msg for s in h.sent if s.peer == b"later" and isinstance(s.msg, p.Result)
            and s.msg.invocation_id == inv][-1]


def _noted(tmp_path: Path) -> list[str]:
    book = KeptResults(tmp_path / "results.sqlite")
    try:
        return [c.invocation_id for c in book.detached()]
    finally:
        book.close()


def test_a_running_and_a_queued_call_are_admitted_again_and_run_once(tmp_path: Path) -> None:
    first, (running, queued) = _spawned_and_left(tmp_path)
    token = first.token(running)
    assert sorted(_noted(tmp_path)) == sorted([running, queued])
    h = _durable(tmp_path)  # the next `gpufn serve`: nobody resubmits them
    assert {running, queued} <= set(h.core.invocations)
    w = _back(h, running={running: [token, 1]})
    assert h.core.invocations[running].state is InvState.RUNNING
    assert not runs_of(h, running)  # taken over, not run again
    _done(h, w, running, token, b"first")
    [run] = runs_of(h, queued)  # it never ran: it runs now, on its version
    assert run.code_id == "c1" and run.meta.attempt_number == 1
    _done(h, w, queued, run.dispatch_token, b"second")
    res = _found_later(h, running)
    assert res.ok and res.frames == (b"first",) and res.meta.attempts == 1
    assert _found_later(h, queued).frames == (b"second",)
    _killed(h)
    assert _noted(tmp_path) == []  # each row left with its Result
    third = _durable(tmp_path)  # and nothing is admitted a second time
    assert not third.core.invocations and _found_later(third, queued).frames == (b"second",)
    _killed(third)


def test_a_readmitted_call_waits_for_the_hold(tmp_path: Path) -> None:
    """Another device's worker is back first: the call is not placed there, since its own
    worker, not back yet, may say it runs it."""
    first = _durable(tmp_path, devices=2)
    first.start_worker(0)
    first.start_worker(1)
    _deploy(first)
    inv = first.submit(ALIAS, keep=True)
    [run] = first.runs()
    index = int(first.core.invocations[inv].devices[0].split(":")[1])
    first.feed(b"cli", p.Goodbye("closed"))
    first.tick(1.5)
    _killed(first)
    h = _durable(tmp_path, devices=2)
    _back(h, 1 - index)  # the idle device's worker
    h.tick(0.5)
    assert not runs_of(h, inv)  # the hold: not placed on it
    w = _back(h, index, running={inv: [run.dispatch_token, 1]})
    _done(h, w, inv, run.dispatch_token, b"once")
    assert _found_later(h, inv).frames == (b"once",) and not runs_of(h, inv)
    _killed(h)


def test_a_noted_call_whose_result_is_kept_is_not_run_again(tmp_path: Path) -> None:
    h = _durable(tmp_path)
    w = h.start_worker(0)
    _deploy(h)
    inv = h.submit(ALIAS, keep=True)
    fid = h.core.invocations[inv].function.function_id
    h.finish(w, inv)
    _killed(h)
    book = KeptResults(tmp_path / "results.sqlite")  # noted after its Result (a torn order)
    book.save_calls([DetachedCall(inv, fid, "", 0.0, make_spec().to_wire(), (b"args",))], [])
    book.close()
    h2 = _durable(tmp_path)
    assert not h2.core.invocations and not runs_of(h2, inv)
    assert _found_later(h2, inv).ok
    _killed(h2)
    assert _noted(tmp_path) == []


def test_a_result_the_worker_holds_is_asked_for_and_kept(tmp_path: Path) -> None:
    first, (running, _queued) = _spawned_and_left(tmp_path)
    token = first.token(running)
    h = _durable(tmp_path)
    w = _back(h, held={running: [token, 1]})  # it finished while the head was away
    assert [s.msg for s in h.of_type(p.Resend)] == [p.Resend(running, token)]
    _done(h, w, running, token, b"held")
    assert _found_later(h, running).frames == (b"held",)
    assert not runs_of(h, running)
    _killed(h)


def test_a_call_said_to_have_run_counts_as_a_lost_attempt(tmp_path: Path) -> None:
    _first, (running, _queued) = _spawned_and_left(tmp_path)
    h = _durable(tmp_path)
    _back(h, ran=[running])  # ran there; its Result is gone
    h.tick(3.5)  # decided at the hold's end
    res = _found_later(h, running)
    assert not res.ok and res.error_kind == "WorkerLost" and "retries=N" in res.message
    assert not runs_of(h, running)
    _killed(h)


def test_with_retries_left_it_runs_again_as_its_next_attempt(tmp_path: Path) -> None:
    _first, (running,) = _spawned_and_left(tmp_path, n=1, retries=1)
    h = _durable(tmp_path)
    w = _back(h, ran=[running])
    h.tick(3.5)
    [run] = runs_of(h, running)
    assert run.meta.attempt_number == 2
    _done(h, w, running, run.dispatch_token)
    res = _found_later(h, running)
    assert res.ok and res.meta.attempts == 2
    _killed(h)


def test_a_spawner_that_resubmits_it_too_gets_the_one_call(tmp_path: Path) -> None:
    h = _durable(tmp_path)
    h.start_worker(0)
    _deploy(h)
    inv = h.submit(ALIAS, keep=True)
    token = h.token(inv)
    h.tick(1.5)  # noted, although its spawner is still there
    _killed(h)
    h2 = _durable(tmp_path)
    h2.hello(b"back", p.Role.CLIENT, info={"resubmit": 1, "instance": "previous"})
    h2.feed(b"back", p.Submit(inv, ALIAS, {}, True, (b"args",)))  # its client comes back
    w = _back(h2, running={inv: [token, 1]})
    assert len(h2.core.invocations) == 1 and not runs_of(h2, inv)
    _done(h2, w, inv, token, b"one")
    assert [r.frames for r in [s.msg for s in h2.sent if s.peer == b"back"
                               and isinstance(s.msg, p.Result)]] == [(b"one",)]
    assert not runs_of(h2, inv)
    _killed(h2)


def test_calls_that_end_within_the_second_are_never_written(tmp_path: Path) -> None:
    h = _durable(tmp_path)
    w = h.start_worker(0)
    _deploy(h)
    inv = h.submit(ALIAS, keep=True)
    h.finish(w, inv)
    h.tick(1.5)
    _killed(h)
    assert _noted(tmp_path) == []
    assert not _durable(tmp_path).core.invocations


def test_a_scheduler_that_is_not_durable_notes_nothing(tmp_path: Path) -> None:
    h = Harness(devices=1, state_dir=str(tmp_path))  # the embedded one: its workers die with it
    h.start_worker(0)
    _deploy(h)
    h.submit(ALIAS, keep=True)
    h.tick(1.5)
    _killed(h)
    assert _noted(tmp_path) == []


def test_after_a_final_stop_calls_not_ended_are_not_admitted_again(tmp_path: Path) -> None:
    h = _durable(tmp_path)
    h.start_worker(0)
    _deploy(h)
    inv = h.submit(ALIAS, keep=True)
    h.tick(1.5)
    queued = h.submit(ALIAS, keep=True)
    h.tick(1.5)
    h.core.streams.close(final=True)  # the shell's close after a drain's grace ran out
    h2 = _durable(tmp_path)
    assert not h2.core.invocations
    for call in (inv, queued):
        res = _found_later(h2, call)
        assert res.error_kind == "ConnectionLost" and "gpufn shutdown" in res.message
    _killed(h2)


def test_a_requeued_suspect_whose_worker_reports_it_late_is_taken_over() -> None:
    """The hold ended before the worker came back: the call was counted as lost and
    queued again. Its worker then says it runs it: that run goes on (retry not started)."""
    h = Harness(devices=2, restart_grace_seconds=3.0)
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 1, "instance": "previous"})
    h.hello(b"sup2", p.Role.SUPERVISOR, info={"node": "n", "devices": [
        d.to_wire() for d in h.infos], "ran": ["c1"]})  # a journal said c1 ran
    h.feed(b"back", p.Submit("c1", h.register("f", retries=1), {}, frames=(b"x",)))
    h.tick(3.5)
    inv = h.core.invocations["c1"]
    assert inv.state is InvState.QUEUED and inv.attempts == 1  # no worker yet: it waits
    msg = h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 3,
                                              "running": {"c1": [42, 1]}}, pid=7)
    assert isinstance(msg, p.Welcome) and msg.ok
    assert not [s for s in h.of_type(p.Cancel) if s.msg.invocation_id == "c1"]
    assert not runs_of(h, "c1") and inv.state is InvState.RUNNING
    _done(h, b"w0", "c1", 42, b"late")
    res = h.results(b"back")["c1"]
    assert res.ok and res.frames == (b"late",) and res.meta.attempts == 1


def test_it_keeps_its_version_through_a_rolling_update_and_a_restart(tmp_path: Path) -> None:
    h = _durable(tmp_path)
    h.start_worker(0)
    _deploy(h, code="c1")
    running, queued = h.submit(ALIAS, keep=True), h.submit(ALIAS, keep=True)
    _deploy(h, code="c2")  # v2: the calls in flight stay on v1 (their bindings are saved)
    assert DeploymentStore.in_state_dir(str(tmp_path)).pins()
    h.feed(b"cli", p.Goodbye("closed"))
    h.tick(1.5)
    token = h.token(running)
    _killed(h)
    h2 = _durable(tmp_path)
    w = _back(h2, running={running: [token, 1]})
    _done(h2, w, running, token)
    [run] = runs_of(h2, queued)
    assert run.code_id == "c1"
    assert DeploymentStore.in_state_dir(str(tmp_path)).pins() == {}  # each binding done
    _killed(h2)
