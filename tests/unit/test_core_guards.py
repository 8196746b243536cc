"""Rules of the last release held at the scheduler core (through the core harness, no
processes): worker generations, attempts a lost call is charged, rollback and deploys to
a stopped app, and usage metering of gangs, retries and preemptions. Each test fails
under a one-line mutation listed in scripts/mutate.py."""

from __future__ import annotations

from typing import Any

import pytest

from gpufn.scheduler.core import RendezvousReady
from gpufn.scheduler.states import DeviceState, InvState
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

from .core_harness import GiB, Harness

MODEL = {"name": "enc", "code_id": "0123456789abc", "memory": GiB, "pin": False,
         "offload": True, "nframes": 1}


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
    h = Harness(devices=1, retry_backoff_seconds=0.2)
    h.start_worker(0, pid=100, incarnation=1)
    inv = h.submit(h.register("f", retries=1))
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed", 1))  # lost: its one retry
    assert h.core.invocations[inv].state is InvState.QUEUED
    # The device's next worker registers and lists the calls it ran lately: this one.
    w = h.hello(b"w-gen2", p.Role.WORKER, pid=200,
                info={"device": "n:0", "incarnation": 2, "ran": [inv]})
    assert isinstance(w, p.Welcome) and w.ok
    assert inv not in h.results(), "the call was charged its lost run twice"
    h.tick(0.3)
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
    if evicted_first:
        h.finish(w, running)
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
    before = len(h.of_type(p.EvictModel))
    inv = _call_with_model(h, w, alias)
    assert _code_run(h, inv) == ("v2" if changed else "v1")
    for _ in range(3):
        h.tick(1.0)
    assert len(h.of_type(p.EvictModel)) == before, "the started app's model was evicted"
    again = _call_with_model(h, w, alias)
    assert h.results()[again].meta.cold_start is False  # its model stayed resident


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
