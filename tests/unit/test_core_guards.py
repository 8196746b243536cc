"""Rules of the last release held at the scheduler core (through the core harness, no
processes): worker generations, attempts a lost call is charged, rollback and deploys to
a stopped app, and usage metering of gangs, retries and preemptions. Each test fails
under a one-line mutation listed in scripts/mutate.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gpufn.memory_pool.probe import simulated_devices
from gpufn.scheduler.core import RendezvousReady
from gpufn.scheduler.nouns.states import DeviceState, InvState
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

from .core_harness import GiB, Harness

MODEL = {"name": "enc", "code_id": "0123456789abc", "memory": GiB, "pin": False,
         "offload": True, "nframes": 1}


@pytest.fixture(autouse=True)
def _no_scheduler_errors(caplog: pytest.LogCaptureFixture) -> Any:
    """A handler that raises is logged and skipped (the core serves on): fail on it here."""
    yield
    # (caplog.records would hold the teardown phase's records only)
    errors = [r.getMessage() for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, errors


def _with_model(h: Harness, name: str, **options: Any) -> str:
    spec = make_spec(**options)
    fid = f"{name}-{hash(spec)}"
    h.feed(b"cli", p.Register(fid, f"code-{name}", name, spec.to_wire(), [dict(MODEL)],
                              (b"code", b"loader")))
    return fid


def _usage(h: Harness, by: str = "function") -> list[dict[str, Any]]:
    h.feed(b"cli", p.Query(77, p.QueryKind.USAGE, {"by": by}))
    reply = [s.msg for s in h.of_type(p.QueryReply) if s.msg.request_id == 77][-1]
    assert reply.ok, reply
    return list(reply.data["rows"])


# --------------------------------------------------------------------------- generations


def test_late_exit_notices_of_restarts_that_never_said_hello_spare_the_serving_worker() -> None:
    """The supervisor restarted the worker three times before one said Hello; its notices
    about those earlier generations arrive after the newest serves."""
    h = Harness(devices=1)
    h.start_worker(0, pid=100, incarnation=1)
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed by signal 9", 1))
    w = h.start_worker(0, peer=b"w-gen4", pid=400, incarnation=4)
    h.feed(b"sup", p.WorkerExited("n:0", 200, 1, "exit code 1", 2))
    h.feed(b"sup", p.WorkerExited("n:0", 300, p.GAVE_UP, "failed to start", 3))
    d = h.core.devices["n:0"]
    assert (d.state, d.worker, d.incarnation) == (DeviceState.READY, w, 4)
    inv = h.submit(h.register("f"))
    assert [r.invocation_id for r in h.runs(w)] == [inv]
    h.finish(w, inv)
    assert h.results()[inv].ok


def test_in_order_exit_notices_of_restarts_that_never_said_hello_are_applied() -> None:
    """Without a worker since generation 1, the notices of generations 2..5 are news: the
    last one (the supervisor gave up) fails the device."""
    h = Harness(devices=1)
    h.start_worker(0, pid=100, incarnation=1)
    f = h.register("f")
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))
    for gen in (2, 3, 4):
        h.feed(b"sup", p.WorkerExited("n:0", 100 + gen, 1, "exit code 1", gen))
    h.feed(b"sup", p.WorkerExited("n:0", 105, p.GAVE_UP, "failed to start 5 times", 5))
    assert h.core.devices["n:0"].state is DeviceState.FAILED
    inv = h.submit(f)
    assert h.results()[inv].error_kind == "Unschedulable"


# --------------------------------------------------------------------------- attempts


def test_a_call_lost_here_is_not_charged_again_when_its_worker_re_registers_listing_it() -> None:
    h = Harness(devices=1, retry_backoff_seconds=5.0, restart_grace_seconds=1.0)
    h.start_worker(0, pid=100, incarnation=1)
    inv = h.submit(h.register("f", retries=1))
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))  # lost: its one retry
    assert h.core.invocations[inv].state is InvState.QUEUED
    # The device's next worker registers and lists the calls it ran lately: this one.
    w = h.hello(b"w-gen2", p.Role.WORKER, pid=200,
                info={"device": "n:0", "incarnation": 2, "ran": [inv]})
    assert isinstance(w, p.Welcome) and w.ok
    h.tick(1.1)  # the report is decided when the first seconds' hold ends; the retry waits
    assert inv not in h.results(), "the call was charged its lost run twice"
    h.tick(5.0)
    run = [r for r in h.runs(b"w-gen2") if r.invocation_id == inv]
    assert run and run[-1].meta.attempt_number == 2
    h.finish(b"w-gen2", inv)
    res = h.results()[inv]
    assert res.ok and res.meta.attempts == 2


def test_a_call_lost_while_its_model_loads_runs_again_without_a_retry() -> None:
    h = Harness(devices=1, retry_backoff_seconds=0.1)
    h.start_worker(0, pid=100, incarnation=1)
    inv = h.submit(_with_model(h, "embed"))  # retries=0
    assert [s for s in h.of_type(p.LoadModel) if s.peer == b"w0"], "no model load ordered"
    h.tick(5.0)  # the load takes a while; the call waits for it
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))
    assert inv not in h.results(), "a call that never started used up its retries"
    assert h.core.invocations[inv].state is InvState.QUEUED
    w = h.start_worker(0, peer=b"w-gen2", pid=200, incarnation=2)
    h.tick(0.2)
    key = next(iter(h.core.models.models))
    h.feed(w, p.ModelEvent(key, p.ModelState.RESIDENT, GiB, 1.0))
    h.finish(w, inv)
    res = h.results()[inv]
    assert res.ok and res.meta.attempts == 2


def test_a_call_lost_after_its_model_loaded_uses_its_retry() -> None:
    """The other side of the rule: once its model is resident the call ran, and a loss
    then costs a retry (retries=0: it fails)."""
    h = Harness(devices=1)
    w = h.start_worker(0, pid=100, incarnation=1)
    inv = h.submit(_with_model(h, "embed"))
    key = next(iter(h.core.models.models))
    h.feed(w, p.ModelEvent(key, p.ModelState.RESIDENT, GiB, 1.0))
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))
    assert h.results()[inv].error_kind == "WorkerLost"


# --------------------------------------------------------------------------- deployments


def _deploy(h: Harness, app: str, code: str, models: bool = False) -> p.AppReply:
    fn = {"name": "f", "function_id": f"base-{code}", "code_id": code,
          "spec": make_spec().to_wire(), "models": [dict(MODEL)] if models else [],
          "ncode": 1}
    frames: tuple[bytes, ...] = (code.encode(), b"loader") if models else (code.encode(),)
    h.feed(b"cli", p.Deploy(7, app, {"code_hash": code}, [fn], frames))
    return [s.msg for s in h.of_type(p.AppReply)][-1]


def _command(h: Harness, command: str, **args: Any) -> p.AppReply:
    h.feed(b"cli", p.AppCommand(9, command, args))
    return [s.msg for s in h.of_type(p.AppReply)][-1]


def _code_run(h: Harness, inv: str) -> str:
    return [r for r in h.runs() if r.invocation_id == inv][-1].code_id


def test_rollback_without_a_version_goes_to_the_version_before_the_current_one() -> None:
    h = Harness(devices=1, state_dir="")
    w = h.start_worker(0)
    for code in ("v1", "v2", "v3"):
        assert _deploy(h, "app", code).ok
    reply = _command(h, "rollback", app="app")
    assert reply.ok and reply.data["version"] == 4, reply
    inv = h.submit(p.app_alias("app", "f"))
    assert _code_run(h, inv) == "v2"
    h.finish(w, inv)
    versions = _command(h, "history", app="app").data["versions"]
    assert versions[-1]["rollback_of"] == 2


def _call_with_model(h: Harness, w: bytes, alias: str) -> str:
    inv = h.submit(alias)
    key = next(iter(h.core.models.models))
    if h.core.devices["n:0"].ledger.state(key).value != "resident":
        h.feed(w, p.ModelEvent(key, p.ModelState.RESIDENT, GiB, 0.5))
    h.finish(w, inv)
    assert h.results()[inv].ok
    return inv


@pytest.mark.parametrize("changed", [False, True], ids=["unchanged-code", "changed-code"])
@pytest.mark.parametrize("evicted_first", [True, False], ids=["after-eviction", "while-running"])
def test_deploying_to_a_stopped_app_starts_it_again(changed: bool, evicted_first: bool) -> None:
    """docs/operations.md (Deploy): a deploy of a stopped app, with changed code or not,
    makes it active again; its calls run and its models stay on the devices (also when
    it is deployed again before the stop's release of its models happened)."""
    h = Harness(devices=1, state_dir="")
    w = h.start_worker(0)
    assert _deploy(h, "app", "v1", models=True).ok
    alias = p.app_alias("app", "f")
    _call_with_model(h, w, alias)
    running = h.submit(alias)  # the stop lets it finish; its model is in use meanwhile
    assert _command(h, "stop", app="app").ok
    stopped = h.submit(alias)
    assert h.results()[stopped].error_kind == "AppStopped"
    h.tick(0.1)
    assert not h.of_type(p.EvictModel), "the stop evicted a model a running call uses"
    if evicted_first:
        h.finish(w, running)
        assert h.results()[running].ok, "the stop did not let the running call finish"
        h.tick(0.1)
        evicted = [s.msg.model for s in h.of_type(p.EvictModel)]
        assert evicted, "stopping the app did not release its model"
        h.feed(w, p.ModelEvent(evicted[-1], p.ModelState.EVICTED, 0, 0.1))
        h.tick(0.1)

    reply = _deploy(h, "app", "v2" if changed else "v1", models=True)
    assert reply.ok
    assert (reply.data["version"], reply.data["unchanged"]) == ((2, False) if changed else (1, True))
    [app] = _command(h, "list").data["apps"]
    assert (app["state"], app["version"]) == ("active", reply.data["version"])
    if not evicted_first:
        h.finish(w, running)
        assert h.results()[running].ok, "the stop did not let the running call finish"
    before = len(h.of_type(p.EvictModel))
    inv = _call_with_model(h, w, alias)
    assert _code_run(h, inv) == ("v2" if changed else "v1")
    for _ in range(3):
        h.tick(1.0)
    assert len(h.of_type(p.EvictModel)) == before, "the started app's model was evicted"
    again = _call_with_model(h, w, alias)
    assert not h.results()[again].meta.cold_start  # its model stayed resident


# --------------------------------------------------------------------------- usage


def test_a_gang_call_is_metered_as_its_devices_times_its_run_time() -> None:
    h = Harness(devices=4, islands=1)
    ws = {f"n:{i}": h.start_worker(i) for i in range(4)}
    h.sent += h.core.handle(RendezvousReady(4242), h.now)
    inv = h.submit(h.register("g3", count=3))
    runs = [r for r in h.runs() if r.invocation_id == inv]
    assert len(runs) == 3
    h.now += 2.0  # it runs 2 s on 3 devices
    for r in runs:
        key = r.meta.gang["devices"][r.meta.gang["rank"]]
        h.feed(ws[key], p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=h.token(inv)),
                                 (b"x",)))
    assert h.results()[inv].ok
    [row] = _usage(h)
    assert row["calls"] == 1 and row["outcomes"] == {"succeeded": 1}
    assert row["device_seconds"] == pytest.approx(6.0)


def test_a_retried_call_counts_once_as_succeeded_with_both_runs_device_time() -> None:
    h = Harness(devices=1, retry_backoff_seconds=0.5)
    h.start_worker(0, pid=100, incarnation=1)
    inv = h.submit(h.register("f", retries=1))
    h.tick(2.0)  # the first run: 2 s, then its worker dies
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))
    w = h.start_worker(0, peer=b"w-gen2", pid=200, incarnation=2)
    h.tick(0.6)
    assert h.core.invocations[inv].state is InvState.RUNNING
    h.finish(w, inv, duration=3.0)  # the second run: 3 s
    assert h.results()[inv].ok
    [row] = _usage(h)
    assert row["calls"] == 1 and row["outcomes"] == {"succeeded": 1}
    assert row["device_seconds"] == pytest.approx(5.0)


def test_a_preempted_call_counts_once_as_succeeded_with_both_runs_device_time() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    low = h.register("bg", preemptible=True)
    high = h.register("bg", priority=5)
    fns = list(h.core.functions.values())
    fns[1].code_id = fns[0].code_id
    victim = h.submit(low)
    h.now += 2.0  # the victim's first run: 2 s until it is preempted
    urgent = h.submit(high)
    assert h.core.counters.preempted == 1
    h.feed(w, p.Result(victim, False, "Cancelled", "preempted",
                       p.ResultMeta(dispatch_token=h.token(victim))), dt=0.5)
    h.finish(w, urgent, duration=1.0)
    assert h.core.invocations[victim].state is InvState.RUNNING
    h.finish(w, victim, duration=4.0)  # its second run: 4 s
    assert h.results()[victim].ok
    rows = {r["function"]: r for r in _usage(h)}
    assert rows["bg"]["calls"] == 2 and rows["bg"]["outcomes"] == {"succeeded": 2}
    # the victim's 2 s + 4 s, the urgent call's 1 s
    assert rows["bg"]["device_seconds"] == pytest.approx(7.0)


# --------------------------------------------------------------------------- beyond the list:
# generations


def test_a_fenced_worker_that_comes_back_is_refused_and_its_supervisor_told_to_kill_it() -> None:
    h = Harness(devices=1, heartbeat_timeout=5.0)
    h.start_worker(0, pid=100, incarnation=1)
    h.tick(6.0)  # no heartbeat: lost, fenced
    h.start_worker(0, peer=b"w-gen2", pid=200, incarnation=2)
    kills = len(h.of_type(p.KillWorker))
    back = h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1}, pid=100)
    assert isinstance(back, p.Welcome) and not back.ok
    new = [s for s in h.of_type(p.KillWorker)[kills:] if s.peer == b"sup"]
    assert [k.msg.pid for k in new] == [100], "the fenced worker was refused but left running"


def test_exit_notices_without_a_generation_are_judged_by_pid() -> None:
    h = Harness(devices=1)
    h.start_worker(0, pid=100, incarnation=0)
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 0))
    d = h.core.devices["n:0"]
    assert d.worker is None  # about the worker it had: applied
    w = h.start_worker(0, peer=b"w-next", pid=200, incarnation=0)
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 0))  # late, about pid 100
    assert d.worker == w and d.state is DeviceState.READY


def test_an_exit_notice_from_another_supervisor_is_not_applied() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    other = [d.to_wire() for d in simulated_devices("m", 1, 8 * GiB)]
    h.hello(b"sup-m", p.Role.SUPERVISOR, info={"node": "m", "devices": other})
    h.feed(b"sup-m", p.WorkerExited("n:0", 100, -9, "killed", 1))
    assert h.core.devices["n:0"].worker == w


def test_a_restarted_supervisor_counts_generations_anew() -> None:
    h = Harness(devices=1, heartbeat_timeout=5.0)
    h.start_worker(0, pid=100, incarnation=3)
    h.tick(6.0)  # lost: generation 3 fenced
    h.hello(b"sup-again", p.Role.SUPERVISOR,
            info={"node": "n", "devices": [d.to_wire() for d in h.infos]})
    msg = h.hello(b"w-first", p.Role.WORKER, info={"device": "n:0", "incarnation": 1}, pid=300)
    assert isinstance(msg, p.Welcome) and msg.ok, "the new supervisor's first worker was refused"
    assert h.core.devices["n:0"].state is DeviceState.READY


# --------------------------------------------------------------------------- recovery, retries


def test_a_workers_report_of_what_it_ran_is_remembered_for_minutes() -> None:
    h = Harness(devices=3, restart_grace_seconds=3.0)
    f = h.register("once")
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1, "ran": ["old"]})
    h.tick(200.0)
    h.hello(b"w1", p.Role.WORKER, info={"device": "n:1", "incarnation": 1, "ran": ["recent"]})
    h.tick(200.0)  # "old" is past the memory now, "recent" is not
    h.hello(b"w2", p.Role.WORKER, info={"device": "n:2", "incarnation": 1, "ran": ["new"]})
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 2})
    h.feed(b"back", p.Submit("recent", f, {}, frames=(b"args",)))
    assert h.results(b"back")["recent"].error_kind == "WorkerLost"


def test_a_stream_that_delivered_a_value_is_not_retried_when_its_worker_is_lost() -> None:
    h = Harness(devices=1, retry_backoff_seconds=0.1)
    h.start_worker(0, pid=100, incarnation=1)
    inv = h.submit(h.register("gen", retries=3))
    h.feed(b"w0", p.Item(inv, h.token(inv), 0, frames=(b"v0",)))
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))
    res = h.results()[inv]
    assert res.error_kind == "WorkerLost" and "streamed 1 value(s)" in res.message


def test_a_retried_gang_moves_away_from_the_devices_it_was_lost_on() -> None:
    h = Harness(devices=4, islands=1, retry_backoff_seconds=0.1)
    ws = {f"n:{i}": h.start_worker(i, pid=100 + i, incarnation=1) for i in range(4)}
    h.sent += h.core.handle(RendezvousReady(4242), h.now)
    inv = h.submit(h.register("g", count=2, retries=1))
    first = tuple(h.runs()[-1].meta.gang["devices"])
    lost, survivor = first
    h.feed(b"sup", p.WorkerExited(lost, 100 + int(lost[-1]), -9, "killed", 1))
    h.feed(ws[survivor], p.Result(inv, False, "Cancelled", "stopped",
                                  p.ResultMeta(dispatch_token=h.token(inv))))
    h.start_worker(int(lost[-1]), peer=b"again", pid=300, incarnation=2)
    h.tick(0.2)
    again = tuple(h.runs()[-1].meta.gang["devices"])
    assert h.runs()[-1].invocation_id == inv and not set(again) & set(first), again


def test_a_preemption_does_not_count_against_retries() -> None:
    h = Harness(devices=1, retry_backoff_seconds=0.1)
    w = h.start_worker(0, pid=100, incarnation=1)
    low = h.register("bg", preemptible=True, retries=1)
    high = h.register("bg", priority=5)
    fns = list(h.core.functions.values())
    fns[1].code_id = fns[0].code_id
    victim = h.submit(low)
    urgent = h.submit(high)  # preempts the victim
    h.feed(w, p.Result(victim, False, "Cancelled", "preempted",
                       p.ResultMeta(dispatch_token=h.token(victim))))
    h.finish(w, urgent)
    assert h.core.invocations[victim].state is InvState.RUNNING  # its second run
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))  # lost: its one retry
    assert victim not in h.results(), "the preemption used up the call's retry"
    w2 = h.start_worker(0, peer=b"w-gen2", pid=200, incarnation=2)
    h.tick(0.2)
    h.finish(w2, victim)
    assert h.results()[victim].ok and h.results()[victim].meta.attempts == 3


def test_a_stream_that_delivered_a_value_is_never_preempted() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    low = h.register("gen", preemptible=True)
    high = h.register("gen", priority=5)
    fns = list(h.core.functions.values())
    fns[1].code_id = fns[0].code_id
    stream = h.submit(low)
    h.feed(w, p.Item(stream, h.token(stream), 0, frames=(b"v0",)))
    h.submit(high)
    assert h.core.counters.preempted == 0
    assert not [s for s in h.of_type(p.Cancel) if s.msg.invocation_id == stream]


# --------------------------------------------------------------------------- streams


def test_only_rank_zero_values_of_a_gang_reach_the_caller() -> None:
    h = Harness(devices=2, islands=1)
    ws = {f"n:{i}": h.start_worker(i) for i in range(2)}
    h.sent += h.core.handle(RendezvousReady(4242), h.now)
    inv = h.submit(h.register("g", count=2))
    devices = h.runs()[-1].meta.gang["devices"]
    h.feed(ws[devices[1]], p.Item(inv, h.token(inv), 0, frames=(b"rank1",)))
    h.feed(ws[devices[0]], p.Item(inv, h.token(inv), 0, frames=(b"rank0",)))
    got = [s.msg.frames for s in h.of_type(p.Item) if s.peer == b"cli"]
    assert got == [(b"rank0",)]


# --------------------------------------------------------------------------- deployments


def _deploy_fn(h: Harness, app: str, code: str, model: dict[str, Any] | None = None,
               spec: dict[str, Any] | None = None, **meta: Any) -> p.AppReply:
    fn = {"name": "f", "function_id": f"base-{app}-{code}", "code_id": code,
          "spec": spec if spec is not None else make_spec().to_wire(),
          "models": [model] if model else [], "ncode": 1}
    frames: tuple[bytes, ...] = (code.encode(), b"loader") if model else (code.encode(),)
    h.feed(b"cli", p.Deploy(7, app, {"code_hash": f"{app}-{code}", **meta}, [fn], frames))
    return [s.msg for s in h.of_type(p.AppReply)][-1]


def test_stopping_an_app_keeps_a_model_another_app_uses() -> None:
    h = Harness(devices=1, state_dir="")
    w = h.start_worker(0)
    for app in ("one", "two"):
        assert _deploy_fn(h, app, "c", dict(MODEL)).ok
    _call_with_model(h, w, p.app_alias("one", "f"))
    assert _command(h, "stop", app="two").ok
    for _ in range(3):
        h.tick(1.0)
    assert not h.of_type(p.EvictModel), "the model app one still uses was evicted"


def test_calls_in_the_last_hour_forget_older_calls() -> None:
    h = Harness(devices=1, state_dir="")
    w = h.start_worker(0)
    _deploy(h, "app", "v1")
    inv = h.submit(p.app_alias("app", "f"))
    h.finish(w, inv)
    [app] = _command(h, "list").data["apps"]
    assert app["functions"][0]["calls_1h"] == 1
    h.tick(2 * 3600.0)
    h.hello(b"cli", p.Role.CLIENT)  # it fell silent meanwhile: say Hello again
    [app] = _command(h, "list").data["apps"]
    assert app["functions"][0]["calls_1h"] == 0


def test_a_rollback_of_a_stopped_app_leaves_the_calls_the_stop_let_finish() -> None:
    h = Harness(devices=1, state_dir="")
    w = h.start_worker(0)
    _deploy(h, "app", "v1")
    _deploy(h, "app", "v2")
    running = h.submit(p.app_alias("app", "f"))
    _command(h, "stop", app="app")
    reply = _command(h, "rollback", app="app", strategy="recreate")
    assert reply.ok and reply.data["previous"] is None  # nothing served: nothing replaced
    h.finish(w, running)
    assert h.results()[running].ok, "the rollback cancelled a call the stop let finish"


def test_a_deploy_says_drain_first_when_the_new_models_do_not_fit_beside_the_old() -> None:
    h = Harness(devices=1, memory=8 * GiB, state_dir="")
    h.start_worker(0)
    big = dict(MODEL, memory=5 * GiB)
    assert _deploy_fn(h, "app", "v1", dict(big, name="old")).ok
    reply = _deploy_fn(h, "app", "v2", dict(big, name="new", code_id="fedcba9876543"))
    assert reply.ok and any(n.startswith("drain first") for n in reply.data["notes"]), reply
    small = _deploy_fn(h, "app", "v3", dict(MODEL, name="small", code_id="aaaaaaaaaaaaa"))
    assert not any(n.startswith("drain first") for n in small.data["notes"])


def test_a_deploy_with_a_bad_spec_fails_and_adds_no_version() -> None:
    h = Harness(devices=1, state_dir="")
    reply = _deploy_fn(h, "app", "v1", spec={"count": 0})
    assert not reply.ok and reply.error_kind == "InvalidSpec"
    h.feed(b"cli", p.AppCommand(9, "history", {"app": "app"}))
    assert not [s.msg for s in h.of_type(p.AppReply)][-1].ok  # no such app


# --------------------------------------------------------------------------- usage, drain


def test_a_batch_meters_its_device_time_once_shared_by_its_calls() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    f = h.register("b", batch_size=2, batch_wait_ms=50)
    a, b = h.submit(f), h.submit(f)  # a full batch: dispatched at once
    (run,) = h.runs(w)
    items = [{"ok": True, "n": 1}, {"ok": True, "n": 1}]
    h.feed(w, p.Result(run.invocation_id, True, "", "",
                       p.ResultMeta(dispatch_token=run.dispatch_token, batch_items=items),
                       (b"x", b"y")), dt=2.0)
    assert h.results()[a].ok and h.results()[b].ok
    [row] = _usage(h)
    assert row["calls"] == 2 and row["device_seconds"] == pytest.approx(2.0)


def test_a_drain_drops_every_queued_call_and_a_second_drain_never_extends_the_grace() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    f = h.register("f")
    running, q1, q2 = h.submit(f), h.submit(f), h.submit(f)
    assert [r.invocation_id for r in h.runs(w)] == [running]
    h.feed(b"cli", p.Drain(1, 5.0))
    assert h.results()[q1].error_kind == h.results()[q2].error_kind == "Cancelled"
    h.feed(b"cli", p.Drain(2, 30.0))
    assert h.core.ops.stop_now(h.now + 5.0), "a second drain extended the first one's grace"


# --------------------------------------------------------------------------- models


def _model_fn(h: Harness, name: str, model: str, mem: int, **options: Any) -> str:
    spec = make_spec(**options)
    fid = f"{name}-{hash(spec)}"
    desc = dict(MODEL, name=model, code_id=f"{model}-codeid-000", memory=mem)
    h.feed(b"cli", p.Register(fid, f"code-{name}", name, spec.to_wire(), [desc],
                              (b"code", b"loader")))
    return fid


def test_a_call_is_planned_again_once_when_its_model_is_larger_than_declared() -> None:
    h = Harness(devices=1, memory=8 * GiB)
    w = h.start_worker(0)
    a = h.submit(_model_fn(h, "g", "m", 1 * GiB))
    key = next(iter(h.core.models.models))
    h.feed(w, p.ModelEvent(key, p.ModelState.LOAD_FAILED, 2 * GiB, 0.0, "OutOfMemory", "bigger"))
    h.feed(w, p.Result(a, False, "OutOfMemory", "oom", p.ResultMeta(dispatch_token=h.token(a))))
    assert a not in h.results()  # planned again with the size it learned
    h.tick(0.1)
    h.feed(w, p.ModelEvent(key, p.ModelState.LOAD_FAILED, 3 * GiB, 0.0, "OutOfMemory", "bigger"))
    h.feed(w, p.Result(a, False, "OutOfMemory", "oom", p.ResultMeta(dispatch_token=h.token(a))))
    assert h.results()[a].error_kind == "OutOfMemory", "planned again and again"


def test_one_model_swap_at_a_time_per_device() -> None:
    """While one model loads on a device, a call that would evict another model there to
    load its own waits (no thrash); it goes once the load is done."""
    h = Harness(devices=1, memory=10 * GiB)
    w = h.start_worker(0)
    fa, fb, fc = (_model_fn(h, n, f"model-{n}", 4 * GiB) for n in ("a", "b", "c"))
    a = h.submit(fa)
    ka, kb = (next(k for k in h.core.models.models if k.startswith(f"model-{n}")) for n in "ab")
    h.feed(w, p.ModelEvent(ka, p.ModelState.RESIDENT, 4 * GiB, 1.0))
    h.finish(w, a)
    b = h.submit(fb)  # model b loads beside a
    assert [r.invocation_id for r in h.runs(w)][-1] == b
    c = h.submit(fc)  # would need to evict model a while b still loads
    assert c not in [r.invocation_id for r in h.runs(w)], "a second swap started at once"
    h.feed(w, p.ModelEvent(kb, p.ModelState.RESIDENT, 4 * GiB, 1.0))
    h.tick(0.1)
    assert c in [r.invocation_id for r in h.runs(w)]
