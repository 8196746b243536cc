"""A head restart, without processes: a new scheduler core takes over the calls its
workers run or ran (adopted, results asked for again, or counted as run), holds
resubmitted calls until the workers seen before are back, keeps resident models,
deployment versions, usage and logs; and the worker's side of it (held results, the run
journal, what it reports)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufn.memory_pool.probe import simulated_devices
from gpufn.scheduler.calls.recovery import ORPHAN_SECONDS
from gpufn.scheduler.stores.deployments import DeploymentStore
from gpufn.scheduler.stores.ops import OpsStore
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.wire.spec import make_spec
from gpufn.worker import core as wc
from gpufn.worker.host.held import JOURNAL_SLOTS, HeldResults, RunJournal

from .core_harness import Harness
from .test_deployments import deploy, runs_of


def _restarted(**cfg: object) -> Harness:
    """A new scheduler that a client which knew the previous one says Hello to again."""
    h = Harness(devices=2, restart_grace_seconds=3.0, **cfg)  # type: ignore[arg-type]
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 3, "instance": "previous"})
    return h


def _worker_back(h: Harness, index: int, peer: bytes | None = None, **report: object) -> bytes:
    peer = peer or f"w{index}".encode()
    msg = h.hello(peer, p.Role.WORKER, info={"device": f"n:{index}", "incarnation": 3,
                                             **report})
    assert isinstance(msg, p.Welcome) and msg.ok, msg
    return peer


def _result(h: Harness, worker: bytes, inv: str, token: int, value: bytes = b"v") -> None:
    h.feed(worker, p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=token, duration=1.0),
                            (value,)))


# --------------------------------------------------------------------------- taken over


@pytest.mark.parametrize("worker_first", [True, False])
def test_a_running_call_is_taken_over_not_run_again(worker_first: bool) -> None:
    h = _restarted()
    f = h.register("f")  # retries=0: it must never run twice
    if worker_first:
        w = _worker_back(h, 0, running={"c1": [555, 1]})
        h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    else:
        h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
        w = _worker_back(h, 0, running={"c1": [555, 1]})
    h.tick(3.5)  # past the hold: nothing is placed for it anyway
    assert not runs_of(h, "c1")
    st = h.core.status(h.now)
    assert [r["id"] for d in st["devices"] for r in d["running"]] == ["c1"]
    _result(h, w, "c1", 555, b"done")
    res = h.results(b"back")["c1"]
    assert res.ok and res.frames == (b"done",) and res.meta.attempts == 1
    assert not runs_of(h, "c1")


def test_a_taken_over_call_is_billed_and_timed_from_its_real_start() -> None:
    """The worker says how long the call has run (40 s before the restart): the device
    time billed includes those 40 s, and its 60 s timeout counts from its real start."""
    h = _restarted()
    f = h.register("f", timeout=60.0)
    w = _worker_back(h, 0, running={"c1": [555, 1, 40_000]})
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    h.tick(5.0)
    _result(h, w, "c1", 555, b"done")
    [row] = h.core.ops.answer(p.QueryKind.USAGE, {}, h.now)["rows"]
    assert row["device_seconds"] == pytest.approx(45.0, abs=0.5)
    h2 = _restarted()
    f2 = h2.register("f", timeout=60.0)
    _worker_back(h2, 0, running={"c2": [556, 1, 50_000]})
    h2.feed(b"back", p.Submit("c2", f2, {}, frames=(b"args",)))
    h2.tick(11.0)  # 61 s after it really started
    res = h2.results(b"back")["c2"]
    assert not res.ok and res.error_kind == "Timeout"


def test_a_result_the_worker_holds_is_asked_for_again() -> None:
    h = _restarted()
    f = h.register("f")
    w = _worker_back(h, 0, held={"c1": [77, 1]})
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    [resend] = [s for s in h.of_type(p.Resend)]
    assert resend.peer == w and resend.msg == p.Resend("c1", 77)
    _result(h, w, "c1", 77, b"kept")
    assert h.results(b"back")["c1"].frames == (b"kept",)
    assert not runs_of(h, "c1")


def test_a_result_that_comes_before_its_resubmit_is_kept_by_the_worker() -> None:
    """Reported running, it finished before its caller came back: the scheduler drops
    the Result (no one to give it to) but remembers the worker holds it."""
    h = _restarted()
    f = h.register("f")
    w = _worker_back(h, 0, running={"c1": [9, 1]})
    _result(h, w, "c1", 9)
    assert "c1" not in h.results(b"back")
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    assert [s.msg for s in h.of_type(p.Resend)] == [p.Resend("c1", 9)]


def test_a_result_the_worker_let_go_of_counts_as_a_lost_attempt() -> None:
    h = _restarted()
    once, twice = h.register("once"), h.register("twice", retries=1)
    w = _worker_back(h, 0, held={"a": [5, 1], "b": [6, 1]})
    h.feed(b"back", p.Submit("a", once, {}, frames=(b"x",)))
    h.feed(b"back", p.Submit("b", twice, {}, frames=(b"x",)))
    for inv, token in (("a", 5), ("b", 6)):  # what the worker answers a Resend it cannot
        h.feed(w, p.Result(inv, False, "WorkerLost", "no longer holds its result",
                           p.ResultMeta(dispatch_token=token, retryable=True)))
    res = h.results(b"back")
    assert res["a"].error_kind == "WorkerLost" and "b" not in res
    h.tick(3.5)
    assert [r.meta.attempt_number for r in runs_of(h, "b")] == [2]


def test_a_call_whose_worker_died_after_reporting_counts_as_a_lost_attempt() -> None:
    h = _restarted()
    once = h.register("once")
    _worker_back(h, 0, running={"a": [5, 1]})
    _worker_back(h, 0, peer=b"w0-new")  # the device's worker was replaced meanwhile
    h.feed(b"back", p.Submit("a", once, {}, frames=(b"x",)))
    assert "a" not in h.results(b"back")  # decided when the hold ends
    h.tick(3.5)
    res = h.results(b"back")["a"]
    assert res.error_kind == "WorkerLost" and "retries=N" in res.message
    assert not runs_of(h, "a")


def test_calls_of_a_worker_that_died_while_the_head_was_away_count_as_run() -> None:
    """Its supervisor read the dead worker's journal and says so in its Hello."""
    h = Harness(devices=2, restart_grace_seconds=3.0)
    h.hello(b"sup2", p.Role.SUPERVISOR, info={"node": "m", "devices": [
        d.to_wire() for d in simulated_devices("m", 1, 8 * 2**30)], "ran": ["gone1"]})
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 1, "instance": "previous"})
    h.feed(b"back", p.Submit("gone1", h.register("f"), {}, frames=(b"x",)))
    h.tick(3.5)
    assert h.results(b"back")["gone1"].error_kind == "WorkerLost"
    assert not runs_of(h, "gone1")


def test_a_worker_that_runs_a_call_a_supervisor_said_ran_takes_it_over() -> None:
    """The previous scheduler retried a call whose first worker died; the dead worker's
    supervisor says it ran, the worker running the retry says it runs it: whichever
    Hello comes first, the call is taken over, not failed or run a third time."""
    h = _restarted()
    f = h.register("f", retries=0)
    h.hello(b"sup-back", p.Role.SUPERVISOR, info={"node": "n", "devices": [
        d.to_wire() for d in h.infos], "ran": ["r1"]})
    h.feed(b"back", p.Submit("r1", f, {}, frames=(b"x",)))
    w = _worker_back(h, 1, running={"r1": [42, 2]})
    h.tick(3.5)
    _result(h, w, "r1", 42, b"second")
    res = h.results(b"back")["r1"]
    assert res.ok and res.frames == (b"second",) and res.meta.attempts == 2
    assert not runs_of(h, "r1")


def test_a_second_hello_of_the_same_peers_keeps_what_was_taken_over() -> None:
    h = _restarted()
    f = h.register("f")
    w = _worker_back(h, 0, running={"c1": [5, 1]})
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"x",)))
    # Hellos queued while the scheduler was away arrive after the first was welcomed.
    h.hello(b"sup", p.Role.SUPERVISOR, info={"node": "n", "devices": [
        d.to_wire() for d in h.infos]})
    _worker_back(h, 0, running={"c1": [5, 1]})
    _result(h, w, "c1", 5, b"once")
    assert h.results(b"back")["c1"].frames == (b"once",)
    assert h.core.counters.lost == 0


@pytest.mark.parametrize("finished_after_restart", [False, True])
def test_a_held_result_is_returned_not_run_again_when_its_caller_resubmits_late(
        finished_after_restart: bool) -> None:
    """The worker holds the call's Result (said in its Hello, or sent after it with no
    caller to take it); its caller comes back long after the hold and the orphan bound:
    the Result is asked for again and returned, the call never runs a second time."""
    h = _restarted()
    f = h.register("f")  # retries=0: it must never run twice
    if finished_after_restart:
        w = _worker_back(h, 0, running={"c1": [77, 1]})
        _result(h, w, "c1", 77, b"kept")
    else:
        w = _worker_back(h, 0, held={"c1": [77, 1]})
    for _ in range(int(ORPHAN_SECONDS // 5) + 2):  # alive all along, past the orphan bound
        h.feed(w, p.Heartbeat([], {}), dt=5.0)
        h.tick()
    assert not [s for s in h.of_type(p.Cancel) if s.msg.invocation_id == "c1"]
    h.hello(b"late", p.Role.CLIENT, info={"resubmit": 1, "instance": "previous"})
    h.feed(b"late", p.Submit("c1", f, {}, frames=(b"args",)))
    assert [s.msg for s in h.of_type(p.Resend)] == [p.Resend("c1", 77)]
    _result(h, w, "c1", 77, b"kept")
    res = h.results(b"late")["c1"]
    assert res.ok and res.frames == (b"kept",)
    h.tick(5.0)
    assert not runs_of(h, "c1")


def test_an_orphan_run_is_stopped_when_no_caller_comes_back() -> None:
    h = _restarted()
    _worker_back(h, 0, running={"nobody": [5, 1]})
    h.tick(ORPHAN_SECONDS + 1)
    [cancel] = [s.msg for s in h.of_type(p.Cancel)]
    assert (cancel.invocation_id, cancel.dispatch_token) == ("nobody", 5)


def test_gang_calls_are_not_taken_over() -> None:
    h = _restarted()
    g = h.register("g", count=2, retries=0)
    _worker_back(h, 0, running={"gc": [5, 1]})
    h.feed(b"back", p.Submit("gc", g, {}, frames=(b"x",)))
    h.tick(3.5)
    assert h.results(b"back")["gc"].error_kind == "WorkerLost"


# --------------------------------------------------------------------------- the hold


def _seen_before(tmp_path: Path, keys: list[str]) -> OpsStore:
    store = OpsStore(tmp_path / "ops.sqlite")
    store.saw_devices(keys, [], 1000.0)
    return store


def test_the_hold_ends_once_every_device_seen_before_is_back(tmp_path: Path) -> None:
    h = _restarted(ops=_seen_before(tmp_path, ["n:0", "n:1"]))
    f = h.register("f")
    h.feed(b"back", p.Submit("q1", f, {}, frames=(b"x",)))
    _worker_back(h, 0)
    h.tick(0.1)
    assert not h.runs()  # n:1 may still say it runs q1
    _worker_back(h, 1)
    h.tick(0.1)  # long before the 3 s grace
    assert [(r.invocation_id, r.meta.attempt_number) for r in h.runs()] == [("q1", 1)]


def test_without_a_record_of_the_devices_the_hold_lasts_its_grace() -> None:
    h = _restarted()
    f = h.register("f")
    h.feed(b"back", p.Submit("q1", f, {}, frames=(b"x",)))
    _worker_back(h, 0)
    _worker_back(h, 1)
    h.tick(2.0)
    assert not h.runs()
    h.tick(1.5)
    assert [r.invocation_id for r in h.runs()] == ["q1"]


def test_the_ops_store_notes_the_live_devices(tmp_path: Path) -> None:
    store = OpsStore(tmp_path / "ops.sqlite")
    h = Harness(devices=2, ops=store)
    h.start_worker(0)
    h.tick(2.0)
    assert OpsStore(tmp_path / "ops.sqlite").expected_devices() == {"n:0", "n:1"}


# --------------------------------------------------------------------------- models


def test_resident_models_outlive_the_restart() -> None:
    h = _restarted()
    model = {"name": "m", "code_id": "loader1", "memory": 2**20, "nframes": 1}
    key = "m@loader1"
    _worker_back(h, 0, models=[[key, 3 * 2**20]])
    spec = make_spec()
    h.feed(b"cli", p.Register("fm", "codefm", "fm", spec.to_wire(), [model],
                              (b"code", b"loader")))
    inv = h.submit("fm")
    [run] = runs_of(h, inv)
    assert run.meta.models == {"m": key}
    assert not h.of_type(p.LoadModel)  # resident: no loader runs
    d = h.core.devices["n:0"]
    assert d.ledger.models[key].nbytes == 3 * 2**20 and d.ledger.models[key].measured


# --------------------------------------------------------------------------- versions


def test_a_call_keeps_the_version_that_admitted_it_across_a_restart(tmp_path: Path) -> None:
    h = Harness(devices=1, state_dir=str(tmp_path), slots_per_device=1)
    h.start_worker(0)
    deploy(h, "app", "v1")
    running = h.submit(p.app_alias("app", "f"))
    queued = h.submit(p.app_alias("app", "f"))  # one slot: it waits
    deploy(h, "app", "v2")  # both were admitted on v1 (nothing is written per call)
    after = h.submit(p.app_alias("app", "f"))
    h.core.apps.store.close()
    h2 = Harness(devices=1, state_dir=str(tmp_path), restart_grace_seconds=0.5)  # restarted
    h2.hello(b"back", p.Role.CLIENT, info={"resubmit": 3, "instance": "previous"})
    w2 = h2.start_worker(0)
    for inv in (running, queued, after):
        h2.feed(b"back", p.Submit(inv, p.app_alias("app", "f"), {}, frames=(b"x",)))
    h2.tick(1.0)
    for _ in range(3):  # one at a time (concurrency 1 per version's function)
        for r in h2.runs():
            if r.invocation_id not in h2.results(b"back"):
                h2.feed(w2, p.Result(r.invocation_id, True, "", "",
                                     p.ResultMeta(dispatch_token=r.dispatch_token), (b"v",)))
    assert {inv: runs_of(h2, inv)[0].code_id for inv in (running, queued, after)} == {
        running: "v1", queued: "v1", after: "v2"}
    assert DeploymentStore.in_state_dir(str(tmp_path)).pins() == {}  # each used once


# --------------------------------------------------------------------------- usage and logs


def test_usage_and_logs_outlive_a_restart_in_a_0600_file(tmp_path: Path) -> None:
    path = tmp_path / "ops.sqlite"
    h = Harness(devices=1, ops=OpsStore(path))
    w = h.start_worker(0)
    inv = h.submit(h.register("billed"))
    h.feed(w, p.Output(inv, "stdout", "hello from before\n"))
    h.finish(w, inv, duration=2.0)
    h.tick(1.5)  # saved within a second
    h.core.ops.store.close()
    for f in tmp_path.iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    h2 = Harness(devices=1, ops=OpsStore(path))  # a new scheduler on the same state dir
    [row] = h2.core.ops.answer(p.QueryKind.USAGE, {}, h2.now)["rows"]
    assert row["function"] == "billed" and row["calls"] == 1 and row["device_seconds"] > 1.9
    lines = h2.core.ops.answer(p.QueryKind.LOGS, {"target": "billed"}, h2.now)["lines"]
    assert [ln["text"] for ln in lines] == ["hello from before"]
    w2 = h2.start_worker(0)
    inv2 = h2.submit(h2.register("billed"))
    h2.feed(w2, p.Output(inv2, "stdout", "and after\n"))
    h2.finish(w2, inv2)
    [row] = h2.core.ops.answer(p.QueryKind.USAGE, {}, h2.now)["rows"]
    assert row["calls"] == 2
    lines = h2.core.ops.answer(p.QueryKind.LOGS, {"target": "billed", "after": lines[0]["seq"]},
                               h2.now)["lines"]
    assert [ln["text"] for ln in lines] == ["and after"]


def test_the_log_store_keeps_its_bounds_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "ops.sqlite"
    h = Harness(devices=1, ops=OpsStore(path))
    h.core.ops.logs.max_lines = 3
    w = h.start_worker(0)
    inv = h.submit(h.register("chatty"))
    h.feed(w, p.Output(inv, "stdout", "".join(f"line {i}\n" for i in range(10))))
    h.tick(1.5)
    rows = OpsStore(path).logs(0)
    assert [r.text for r in rows] == ["line 7", "line 8", "line 9"]


# --------------------------------------------------------------------------- the worker's side


def _res(inv: str, token: int, nbytes: int) -> p.Result:
    return p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=token), (b"x" * nbytes,))


def test_held_results_keep_the_newest_payloads_within_their_bytes() -> None:
    held = HeldResults(max_bytes=250, max_ids=4)
    for i in range(5):
        held.add(_res(f"c{i}", 10 + i, 100), attempt=1)
    kept, ran = held.report()
    assert {k: v[:2] for k, v in kept.items()} == {"c3": [13, 1], "c4": [14, 1]}  # 200 of 250 bytes
    assert ran == ["c1", "c2"]  # c0 fell out of the ids too
    assert held.get("c4") is not None and held.get("c2") is None
    held.add(_res("big", 20, 1000), attempt=2)  # the newest is kept even over the bound
    assert {k: v[:2] for k, v in held.report()[0].items()} == {"big": [20, 2]}


def test_the_run_journal_survives_its_writer(tmp_path: Path) -> None:
    path = tmp_path / "w.ran"
    j = RunJournal(path)
    for i in range(JOURNAL_SLOTS + 3):
        j.started(f"inv{i}")
    j.started("x" * 200)  # not an id gpufn makes: not noted
    j.close()
    ids = RunJournal.read(path)
    assert len(ids) == JOURNAL_SLOTS and "inv0" not in ids and f"inv{JOURNAL_SLOTS + 2}" in ids
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    RunJournal.clear(path)
    assert RunJournal.read(path) == []


def _one() -> int:
    return 1


def _values() -> Iterator[int]:
    yield 1


def test_the_worker_core_reports_what_it_can_hand_over() -> None:
    core = wc.WorkerCore("n:0")
    _, code = ser.dump_code(_one, "one")
    core.handle(p.LoadCode("c", "f", tuple(code)))
    core.handle(p.Run("single", "f", "c", "f", 5, p.RunMeta(attempt_number=2), (b"a",)))
    core.handle(p.Run("batch", "f", "c", "f", 6, p.RunMeta(batch=[1, 1], members=["m1", "m2"]),
                      (b"a", b"b")))
    _, gen = ser.dump_code(_values, "values")
    core.handle(p.LoadCode("g", "values", tuple(gen)))
    core.handle(p.Run("stream", "values", "g", "values", 7, p.RunMeta(), (b"a",)))
    running, ran, stop = core.restart_report()
    assert {k: v[:2] for k, v in running.items()} == {"single": [5, 2]}  # a generator's values sent meanwhile are gone
    assert sorted(ran) == ["m1", "m2", "stream"] and stop == ["batch", "stream"]


def test_log_lines_keep_their_owner_across_a_restart(tmp_path: Path) -> None:
    """A line a user's call printed is still only theirs (and the admin's) after the
    scheduler restarts: its owner is kept on disk with it."""
    from gpufn.scheduler.books.users import UserStore

    path = tmp_path / "ops.sqlite"
    users = UserStore()
    _, alice = users.create("alice", 0.0)
    users.create("bob", 0.0)
    h = Harness(devices=1, ops=OpsStore(path), users=users, token="admin-token")
    w = h.start_worker(0)
    assert h.hello(b"alice", p.Role.CLIENT, token=alice).ok  # type: ignore[attr-defined]
    fid = h.register("shared")
    inv = h.submit(fid, client=b"alice")
    h.feed(w, p.Output(inv, "stdout", "alice's secret\n"))
    h.finish(w, inv)
    h.tick(1.5)
    h.core.ops.store.close()
    h2 = Harness(devices=1, ops=OpsStore(path), users=users, token="admin-token")
    target = {"target": "shared"}
    assert [ln["text"] for ln in h2.core.ops.answer(p.QueryKind.LOGS, target, h2.now,
                                                     "alice")["lines"]] == ["alice's secret"]
    assert h2.core.ops.answer(p.QueryKind.LOGS, target, h2.now, "bob")["lines"] == []
    assert len(h2.core.ops.answer(p.QueryKind.LOGS, target, h2.now)["lines"]) == 1  # admin


def test_an_older_ops_file_is_tightened_to_owner_only(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    path = state / "ops.sqlite"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    store = OpsStore(path)
    store.saw_devices(["n:0"], [], 1.0)
    store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def test_a_taken_over_call_that_says_nothing_of_its_run_time_is_billed_from_its_report() -> None:
    h = _restarted()
    f = h.register("f")
    w = _worker_back(h, 0, running={"c1": [555, 1]})  # an older worker: no run time
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    h.tick(5.0)
    _result(h, w, "c1", 555, b"done")
    [row] = h.core.ops.answer(p.QueryKind.USAGE, {}, h.now)["rows"]
    assert row["device_seconds"] == pytest.approx(5.0, abs=0.01)


def test_the_hold_ends_exactly_at_its_grace() -> None:
    h = _restarted()  # its grace: 3 s from its start
    _worker_back(h, 0)
    _worker_back(h, 1)
    f = h.register("f")
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    h.tick(2.5)
    assert not runs_of(h, "c1") and h.core.recovery.holding(h.now)
    h.tick(0.5)  # exactly the grace
    assert not h.core.recovery.holding(h.now)
    assert h.core.recovery.not_before(b"back", h.now) == 0.0
    assert [r.meta.attempt_number for r in runs_of(h, "c1")] == [1]


def test_an_orphan_is_stopped_past_its_bound_and_looked_for_once_a_second() -> None:
    h = _restarted()
    w = _worker_back(h, 0, running={"nobody": [5, 1]})  # reported at h.now (1000 s)

    def beat(dt: float) -> None:  # the worker stays alive all along
        h.feed(w, p.Heartbeat([], {}), dt=dt)
        h.tick()

    for _ in range(int(ORPHAN_SECONDS // 5)):
        beat(5.0)  # the last at exactly the bound: looked at, not past it; the next look in 1 s
    beat(0.5)  # past the bound, not looked at
    assert not h.of_type(p.Cancel)
    beat(0.5)  # a second after the last look, past the bound
    [cancel] = [s.msg for s in h.of_type(p.Cancel)]
    assert (cancel.invocation_id, cancel.dispatch_token) == ("nobody", 5)


def test_an_unreadable_book_of_calls_admits_nothing_and_the_scheduler_starts(
        tmp_path: Path) -> None:
    import sqlite3

    from gpufn.scheduler.calls.recovery import Restored
    from gpufn.scheduler.stores.kept_results import DetachedCall, KeptResults

    book = KeptResults(tmp_path / "results.sqlite")
    book.save_calls([DetachedCall("c", "fid", "alice", 1.0, {}, (b"args",))], [])
    book.close()
    with sqlite3.connect(tmp_path / "results.sqlite") as db:
        db.execute("UPDATE calls SET spec = '{torn'")  # damaged: cannot be read back
    ops = OpsStore(tmp_path / "ops.sqlite")
    damaged = KeptResults(tmp_path / "results.sqlite")
    try:
        assert Restored.read(ops, damaged, 0.0, 7).detached == ()
        assert Restored.read(ops, None, 0.0, 7) == Restored(0.0, 7, frozenset(), ())
    finally:
        damaged.close()


def test_a_reported_run_time_is_billed_to_the_millisecond() -> None:
    h = _restarted()
    f = h.register("f")
    w = _worker_back(h, 0, running={"c1": [555, 1, 100_000]})  # ran 100 s before
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    h.tick(5.0)
    _result(h, w, "c1", 555, b"done")
    [row] = h.core.ops.answer(p.QueryKind.USAGE, {}, h.now)["rows"]
    assert row["device_seconds"] == pytest.approx(105.0, abs=0.01)


def test_reports_past_the_memory_are_forgotten_and_recent_ones_kept() -> None:
    """Workers said what they ran and what they hold 400 s and 200 s ago (then fell
    silent): the recent reports still count (the call ran: a lost attempt), the old ones
    are forgotten (the call runs as new)."""
    h = Harness(devices=3, restart_grace_seconds=3.0)
    f = h.register("once")
    h.hello(b"w0", p.Role.WORKER, info={"device": "n:0", "incarnation": 1, "ran": ["old"],
                                        "held": {"old-held": [5, 1]}})
    h.tick(200.0)
    h.hello(b"w1", p.Role.WORKER, info={"device": "n:1", "incarnation": 1, "ran": ["recent"],
                                        "held": {"recent-held": [6, 1]}})
    h.tick(200.0)
    h.hello(b"w2", p.Role.WORKER, info={"device": "n:2", "incarnation": 1})  # forgets here
    h.hello(b"back", p.Role.CLIENT, info={"resubmit": 4})
    for inv in ("old", "recent", "old-held", "recent-held"):
        h.feed(b"back", p.Submit(inv, f, {}, frames=(b"args",)))
    h.tick(1.0)
    res = h.results(b"back")
    assert res["recent"].error_kind == "WorkerLost"
    assert res["recent-held"].error_kind == "WorkerLost"  # its worker is gone with its Result
    assert "old" not in res and "old-held" not in res
    assert [h.core.invocations[i].state.name for i in ("old", "old-held")] in (
        ["RUNNING", "QUEUED"], ["QUEUED", "RUNNING"])  # new calls: one runs, one waits


def test_what_a_restart_carries_over_is_immutable() -> None:
    import dataclasses

    from gpufn.scheduler.calls.recovery import Restored

    with pytest.raises(dataclasses.FrozenInstanceError):
        Restored().first_token = 5  # type: ignore[misc]


@pytest.mark.parametrize("wrong", ["device", "token"])
def test_a_result_from_another_device_or_dispatch_does_not_mark_a_report_held(
        wrong: str) -> None:
    """A call reported running on n:0 (token 9): a Result for it before its resubmit from
    n:1, or from n:0 with another dispatch token, is not its run's; the worker that runs
    it is not thought to hold it: the resubmit takes the running call over, no Resend."""
    h = _restarted()
    f = h.register("f")
    w0 = _worker_back(h, 0, running={"c1": [9, 1]})
    w1 = _worker_back(h, 1)
    if wrong == "device":
        _result(h, w1, "c1", 9, b"not its run")
    else:
        _result(h, w0, "c1", 8, b"an earlier dispatch")
    assert "c1" not in h.results(b"back")
    h.feed(b"back", p.Submit("c1", f, {}, frames=(b"args",)))
    assert not h.of_type(p.Resend)
    st = h.core.status(h.now)
    assert [(d["key"], r["id"]) for d in st["devices"] for r in d["running"]] == [("n:0", "c1")]
    _result(h, w0, "c1", 9, b"done")
    assert h.results(b"back")["c1"].frames == (b"done",)
    h.tick(3.5)
    assert not runs_of(h, "c1")


def test_the_report_memory_keeps_a_report_of_exactly_its_age() -> None:
    """RAN_MEMORY_SECONDS (300 s) to the second, in each of the three books: at 1301 s
    the reports of 1000 s (301 s old) are forgotten, those of 1001 s (exactly 300 s) kept."""
    from gpufn.scheduler.calls.recovery import RAN, RAN_MEMORY_SECONDS, STOPPED, Recovery

    assert RAN_MEMORY_SECONDS == 300.0
    r = Recovery(grace=3.0)
    r.start(None, 1000.0)
    r.worker_report("n:0", b"w0", p.HelloInfo(ran=["ran-old"], running={"run-old": [1, 1]}),
                    1000.0)
    r.client_forgotten(["stopped-old"], 1000.0)
    r.worker_report("n:0", b"w0", p.HelloInfo(ran=["ran-new"], running={"run-new": [2, 1]}),
                    1001.0)
    r.client_forgotten(["stopped-new"], 1001.0)
    r.worker_report("n:1", b"w1", p.HelloInfo(), 1301.0)  # the books are looked at here
    r.client_forgotten([], 1301.0)
    assert r.claim("ran-new") == RAN and r.claim("ran-old") is None
    kept = r.claim("run-new")
    assert not isinstance(kept, str) and kept is not None and kept.dispatch_token == 2
    assert r.claim("run-old") is None
    assert r.claim("stopped-new") == STOPPED and r.claim("stopped-old") is None


def test_a_scheduler_that_saw_no_devices_before_holds_nothing(tmp_path: Path) -> None:
    """A durable scheduler whose store saw no devices (its first start) has no hold: a
    resubmitted call a supervisor said ran counts as a lost attempt at once, not after
    the grace or the first worker."""
    h = _restarted(ops=OpsStore(tmp_path / "ops.sqlite"))
    assert not h.core.recovery.holding(h.now)
    h.hello(b"sup2", p.Role.SUPERVISOR, info={"node": "m", "devices": [
        d.to_wire() for d in simulated_devices("m", 1, 8 * 2**30)], "ran": ["gone1"]})
    h.feed(b"back", p.Submit("gone1", h.register("f"), {}, frames=(b"x",)))
    assert h.results(b"back")["gone1"].error_kind == "WorkerLost"
