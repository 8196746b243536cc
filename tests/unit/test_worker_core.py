"""The worker's sans-I/O core: scheduler messages in, actions out (no processes, no threads)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest

from gpufn.exceptions import GpufnError, SerializationError, kind_of
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.worker import core as wc
from gpufn.worker.device_set import helper as multidevice
from gpufn.worker.executor import Call, Executor
from gpufn.worker.output import OutputRouter

pytestmark = pytest.mark.timeout(30)


def double(x: int) -> int:
    return 2 * x


def _core() -> wc.WorkerCore:
    core = wc.WorkerCore("n:0", "cpu", "10.0.0.5")
    _, frames = ser.dump_code(double, "double")
    assert core.handle(p.LoadCode("c1", "double", tuple(frames))) == []
    return core


def _run(meta: dict[str, Any], inv: str = "i1", token: int = 7, code_id: str = "c1") -> p.Run:
    return p.Run(inv, "f1", code_id, "double", token, p.RunMeta(**meta),
                 tuple(ser.dumps(((3,), {}))))


def _call(ex: wc.Execute) -> Call:
    """The executor's call for `ex` as the shell builds it, less the shell's resources
    (models, the group, the helper)."""
    finish = next((s.finish for s in ex.steps if isinstance(s, wc.JoinGroup)), None)
    return Call(ex.invocation_id, ex.name, ex.fn, ex.frames, ex.context("cpu"), finish=finish,
                dispatch_token=ex.dispatch_token, batch=ex.meta.batch,
                models=dict(ex.meta.models or {}))


def _gang(rank: int, store_host: str = "") -> dict[str, Any]:
    return {"gang_id": "g1", "generation": 3, "rank": rank, "world_size": 2,
            "store_host": store_host, "store_port": 4242, "backend": "gloo",
            "devices": ["n:0", "n:1"]}


def test_run_executes_with_its_context() -> None:
    core = _core()
    actions = core.handle(_run({"attempt_number": 2, "inline": True, "models": {"m": "k1"}}))
    assert [type(a) for a in actions] == [wc.Execute]
    ex = actions[0]
    assert isinstance(ex, wc.Execute) and ex.inline
    assert ex.fn(*ser.loads(ex.frames)[0]) == 6
    assert ex.dispatch_token == 7  # the dispatch token, echoed in the Result
    ctx = ex.context("cpu")
    assert (ctx.invocation_id, ctx.function, ctx.device, ctx.devices) == ("i1", "double", "cpu", ["cpu"])
    assert ctx.attempt == 2  # the attempt number, not the token
    assert (ctx.rank, ctx.world_size) == (0, 1)
    assert ex.meta.models == {"m": "k1"}
    assert ex.steps == ()  # nothing to prepare but its models
    assert set(core.running) == {"i1"}


def test_run_defaults_to_a_thread_and_the_first_attempt() -> None:
    ex = _core().handle(_run({}))[0]
    assert isinstance(ex, wc.Execute) and not ex.inline
    assert ex.context("cpu").attempt == 1 and ex.meta.batch is None and ex.meta.models == {}


def test_batch_meta_reaches_the_call() -> None:
    ex = _core().handle(_run({"batch": [1, 2]}))[0]
    assert isinstance(ex, wc.Execute) and ex.meta.batch == [1, 2]


def test_unknown_code_fails_the_call() -> None:
    core = _core()
    [send] = core.handle(_run({}, code_id="nope"))
    assert isinstance(send, wc.Emit) and isinstance(send.msg, p.Result)
    r = send.msg
    assert (r.invocation_id, r.ok, r.error_kind) == ("i1", False, kind_of(GpufnError))
    assert "has no code nope" in r.message and r.meta == p.ResultMeta(dispatch_token=7)
    assert not core.running


def test_code_that_cannot_be_unpickled_names_the_fix() -> None:
    core = _core()
    assert core.handle(p.LoadCode("c2", "broken", (b"not a pickle",))) == []
    [send] = core.handle(_run({}, code_id="c2"))
    assert isinstance(send, wc.Emit) and isinstance(send.msg, p.Result)
    r = send.msg
    assert r.error_kind == kind_of(SerializationError) and not r.ok
    assert "could not be unpickled on worker n:0" in r.message and "importable" in r.message
    # the same code id sent again, readable now, clears the error
    _, frames = ser.dump_code(double, "double")
    core.handle(p.LoadCode("c2", "double", tuple(frames)))
    assert isinstance(core.handle(_run({}, code_id="c2"))[0], wc.Execute)


def test_cancel_interrupts() -> None:
    core = _core()
    assert core.handle(p.Cancel("i1", "user", True, 7)) == [wc.Interrupt("i1", 7)]
    assert wc.control_actions(p.Cancel("i1")) == [wc.Interrupt("i1", 0)]


def test_group_abort_is_an_abort_action() -> None:
    msg = p.GroupOp(p.GroupOpKind.ABORT, {"gang_id": "g1", "generation": 3, "reason": "rank 1 died"})
    expected = [wc.AbortGroup("rank 1 died", "g1", 3)]
    assert _core().handle(msg) == expected
    assert wc.control_actions(msg) == expected  # the control thread's path says the same
    assert wc.control_actions(p.GroupOp(p.GroupOpKind.ABORT, {}))[0] == wc.AbortGroup(
        "aborted by the scheduler", None, None)


@pytest.mark.parametrize("rank,gather,returned", [(0, False, 6), (1, False, wc.Unused.VALUE), (1, True, 6)])
def test_gang_rank_joins_its_group_first(rank: int, gather: bool, returned: object) -> None:
    core = _core()
    actions = core.handle(_run({"gang": _gang(rank), "gather": gather}))
    assert [type(a) for a in actions] == [wc.Execute]
    [ex] = actions
    assert isinstance(ex, wc.Execute)
    [join] = ex.steps
    assert isinstance(join, wc.JoinGroup)
    assert join.gang.store_host == "10.0.0.5"  # the store runs where the scheduler is
    assert (join.gang.gang_id, join.gang.generation, join.gang.rank) == ("g1", 3, rank)
    ctx = ex.context("cpu")
    assert (ctx.rank, ctx.world_size) == (rank, 2)
    assert join.finish(6) == returned


@pytest.mark.parametrize("rank,gather", [(0, False), (1, False), (1, True)])
def test_only_a_rank_whose_value_is_read_pickles_it(rank: int, gather: bool) -> None:
    """Ranks other than 0 without gather send a Result with no frames (nothing pickled)."""
    ex = _core().handle(_run({"gang": _gang(rank), "gather": gather}))[0]
    assert isinstance(ex, wc.Execute)
    results: list[p.Message] = []
    Executor(OutputRouter(), results.append).run_inline(_call(ex))  # the group join is the shell's
    [res] = results
    assert isinstance(res, p.Result) and res.ok and res.meta.rank == rank
    if rank == 0 or gather:
        assert ser.loads(res.frames) == 6
    else:
        assert res.frames == ()


def test_a_warm_gang_s_spec_is_read_once_and_a_new_generation_again() -> None:
    core = _core()
    specs = [core.handle(_run({"gang": g}, inv=f"i{n}"))[0]
             for n, g in enumerate([_gang(0), _gang(0), {**_gang(0), "generation": 4}])]
    a, b, c = (s.steps[0].gang for s in specs
               if isinstance(s, wc.Execute) and isinstance(s.steps[0], wc.JoinGroup))
    assert a is b and a.store_host == "10.0.0.5"
    assert c is not a and c.generation == 4 and c.store_host == "10.0.0.5"


def test_gang_keeps_a_store_host_it_was_given() -> None:
    ex = _core().handle(_run({"gang": _gang(0, "10.9.9.9")}))[0]
    assert isinstance(ex, wc.Execute) and isinstance(join := ex.steps[0], wc.JoinGroup)
    assert join.gang.store_host == "10.9.9.9"


def test_multi_device_runs_in_the_helper_with_the_attempt_number() -> None:
    core = _core()
    devices = [{"key": "n:0", "kind": "cpu", "uuid": ""}, {"key": "n:1", "kind": "cpu", "uuid": ""}]
    actions = core.handle(_run({"multi": devices, "attempt_number": 1}, token=42))
    assert [type(a) for a in actions] == [wc.Execute]
    [ex] = actions
    assert isinstance(ex, wc.Execute)
    [helper] = ex.steps
    assert isinstance(helper, wc.RunInHelper)
    assert helper.devices == devices and helper.code_id == "c1"
    assert ser.load_code(helper.code_frames)(5) == 10  # the code, to send to the helper
    assert ex.context("cpu").devices == ["cpu", "cpu"]
    assert ex.context("cpu").attempt == 1 and ex.dispatch_token == 42


def test_model_orders_are_model_actions() -> None:
    core = _core()
    assert core.handle(p.LoadModel("k1", {"name": "m"}, (b"loader",))) == [
        wc.StartLoad("k1", {"name": "m"}, (b"loader",))]
    assert core.handle(p.EvictModel("k1", True)) == [wc.Evict("k1", True)]


def test_shutdown_exits() -> None:
    assert _core().handle(p.Shutdown("bye")) == [wc.Exit("bye")]
    assert _core().handle(p.Shutdown()) == [wc.Exit("scheduler asked")]


def test_done_sends_the_result_and_counts() -> None:
    core = _core()
    core.handle(_run({}, inv="a"))
    core.handle(_run({}, inv="b"))
    assert set(core.running) == {"a", "b"}
    result = p.Result("a", True, "", "", p.ResultMeta(dispatch_token=7))
    assert [a.msg for a in core.done(result)] == [result]
    assert set(core.running) == {"b"} and core.completed == 1


def test_a_run_the_shell_failed_to_start_fails_alone() -> None:
    core = _core()
    msg = _run({}, inv="a")
    core.handle(msg)
    [send] = core.failed(msg, RuntimeError("no helper"))
    assert isinstance(send, wc.Emit) and isinstance(send.msg, p.Result)
    assert send.msg.error_kind == kind_of(GpufnError) and "no helper" in send.msg.message
    assert send.msg.meta == p.ResultMeta(dispatch_token=7)
    assert not core.running and core.completed == 0
    assert core.failed(p.LoadModel("k", {}), RuntimeError("x")) == []


def test_run_meta_round_trips_typed() -> None:
    run = _run({"attempt_number": 3, "inline": True, "gang": _gang(1), "gather": True,
                "models": {"a": "k"}, "timeout": 5})
    m = p.decode(p.encode(run)).meta  # type: ignore[attr-defined]
    assert isinstance(m, p.RunMeta) and m == run.meta
    assert (m.attempt_number, m.inline, m.gather, m.models) == (3, True, True, {"a": "k"})
    assert m.gang is not None and m.multi is None and m.batch is None


def test_helper_pipe_carries_protocol_messages() -> None:
    a, b = mp.Pipe()
    try:
        msgs: list[p.Message] = [
            p.HelperRun("i1", "f", "c1", 2, 1, (b"code", memoryview(b"args"))),
            p.Output("i1", "stdout", "hi\n"),
            p.HelperResult("i1", False, "ValueError", "bad", "tb", (b"exc",)),
            p.Shutdown("closing"),
        ]
        for m in msgs:
            multidevice.send(a, m)
        back = [multidevice.recv(b) for _ in msgs]
        assert back[1:] == msgs[1:]
        run = back[0]
        assert isinstance(run, p.HelperRun) and (run.attempt, run.code_frames) == (2, 1)
        assert [bytes(f) for f in run.frames] == [b"code", b"args"]
    finally:
        a.close()
        b.close()
