"""The scheduler's operational books without processes: the log store, the usage meter, the
queue's depth by priority, and the ops desk (logs, usage, drain) driven through the core."""

from __future__ import annotations

import pytest

from gpufn.scheduler.books.logs import LogStore, matches
from gpufn.scheduler.books.usage import BOUNDS, BUCKET_S, Key, UsageMeter
from gpufn.scheduler.books.users import UserStore
from gpufn.wire import protocol as p

from .core_harness import Harness


def test_log_store_is_bounded_by_lines_and_bytes() -> None:
    s = LogStore(max_lines=5, max_bytes=40, max_functions=2)
    for i in range(10):
        s.add("", "f", f"inv{i}", "stdout", f"line {i}\n", float(i))
    lines = s.query("f", 10.0)["lines"]
    assert [ln["text"] for ln in lines] == [f"line {i}" for i in range(5, 10)]
    s.add("", "g", "x", "stdout", "y" * 30 + "\n" + "z" * 30, 11.0)
    assert [ln["text"] for ln in s.query("g", 12.0)["lines"]] == ["z" * 30]  # 60 B > 40 B
    s.add("", "h", "x", "stdout", "new", 12.0)  # a third function: the least recent goes
    assert not s.query("f", 13.0)["found"] and s.query("h", 13.0)["found"]


def test_log_store_since_after_and_targets() -> None:
    s = LogStore()
    s.add("app", "fn", "a1", "stdout", "old", 0.0)
    s.add("app", "other", "a2", "stderr", "new", 100.0)
    s.add("", "adhoc", "b1", "stdout", "mine", 100.0)
    assert [ln["text"] for ln in s.query("app", 110.0)["lines"]] == ["old", "new"]
    assert [ln["text"] for ln in s.query("app", 110.0, since=60)["lines"]] == ["new"]
    assert [ln["text"] for ln in s.query("app.fn", 110.0)["lines"]] == ["old"]
    res = s.query("app", 110.0)
    assert s.query("app", 110.0, after=res["next"])["lines"] == []
    assert s.query("fn", 110.0)["found"] is False  # a deployed function needs its app
    assert matches("adhoc", "", "adhoc") and not matches("adhoc", "app", "adhoc")
    assert s.query("adhoc", 110.0)["lines"][0]["age"] == pytest.approx(10.0)


def test_log_store_finds_one_calls_lines_by_its_id() -> None:
    """`gpufn logs ID`: the id `gpufn status` and FunctionCall.id show, and each line's
    prefix; only that call's lines, with `since`, `after` and the user's filter kept."""
    s = LogStore()
    s.add("app", "fn", "call-1", "stdout", "one", 100.0, user="ann")
    s.add("app", "fn", "call-2", "stdout", "two", 100.0, user="ann")
    s.add("app", "fn", "call-1", "stderr", "one again", 105.0, user="ann")
    res = s.query("call-1", 110.0)
    assert res["found"] and [ln["text"] for ln in res["lines"]] == ["one", "one again"]
    assert [ln["function"] for ln in res["lines"]] == ["fn", "fn"]
    assert [ln["text"] for ln in s.query("call-1", 110.0, since=7)["lines"]] == ["one again"]
    assert s.query("call-1", 110.0, after=res["next"])["lines"] == []
    assert s.query("call-1", 110.0, user="bob")["lines"] == []
    assert s.query("call-3", 110.0)["found"] is False
    assert [ln["text"] for ln in s.query("app", 110.0)["lines"]] == ["one", "two", "one again"]


def test_usage_meter_splits_device_time_over_minutes_and_counts_gangs() -> None:
    m = UsageMeter()
    k = Key("app", "train", 1, "ann")
    t0 = 10 * BUCKET_S
    m.record_devices(k, t0 + 30, t0 + 150, 4)  # 120 s on 4 devices
    m.record_call(k, "succeeded", t0 + 20, t0 + 30, t0 + 150)
    now = t0 + 150
    (row,) = m.report(now, by="function")
    assert row["device_seconds"] == pytest.approx(480.0) and row["calls"] == 1
    assert row["queue_wait_seconds"] == pytest.approx(10.0)
    # The last 60 s (two buckets: the current one, partly inside, counts whole)
    assert m.report(now, since=60)[0]["device_seconds"] == pytest.approx(4 * 90.0)
    assert m.report(now, by="user")[0]["user"] == "ann"
    with pytest.raises(ValueError, match="--by"):
        m.report(now, by="host")
    assert m.calls_total[("app", "train", 1, "succeeded")] == 1
    assert m.duration[("app", "train")].counts[BOUNDS.index(120.0)] == 1  # in (60, 120]


def test_calls_that_ran_at_once_are_metered_as_each_call_alone_would_be() -> None:
    """A lease's report meters its calls together (per key, outcome and minute): the
    same minutes, counts, outcomes and histograms as one record_call per call."""
    k, other = Key("app", "f", 1, "ann"), Key("app", "f", 1, "bob")
    t0 = 10 * BUCKET_S
    spans = [(t0 + 59.0, t0 + 59.5), (t0 + 59.9, t0 + 60.2), (t0 + 61.0, t0 + 61.0),
             (t0 + 130.0, t0 + 129.0), (t0 + 5.0, t0 + 65.0)]
    alone, together = UsageMeter(), UsageMeter()
    alone.track = together.track = True
    for started, ended in spans:
        alone.record_call(k, "succeeded", started, started, ended)
    alone.record_call(other, "failed", t0, t0, t0 + 1.0)
    together.record_ran(k, "succeeded", spans)
    together.record_ran(other, "failed", [(t0, t0 + 1.0)])
    together.record_ran(other, "failed", [])
    now = t0 + 200
    for by in ("function", "user"):
        assert together.report(now, by=by) == alone.report(now, by=by)
    for since in (60.0, 120.0, 180.0):
        assert together.report(now, since=since) == alone.report(now, since=since)
    assert together.calls_total == alone.calls_total
    assert together.queue_wait == alone.queue_wait and together.duration == alone.duration
    assert sorted(map(repr, together.take_dirty())) == sorted(map(repr, alone.take_dirty()))
    assert together.duration[("app", "f")].counts[BOUNDS.index(60.0)] == 1  # the 60 s one


def test_queue_depth_by_priority_is_a_counter() -> None:
    h = Harness(devices=1)
    fid = h.register("f")
    h.submit(fid, priority=1)
    h.submit(fid, priority=5)
    h.submit(fid, priority=5)
    assert h.core.queue.depth_by_priority() == {(fid, 1): 1, (fid, 5): 2}
    h.feed(b"cli", p.Cancel("inv2"))
    assert h.core.queue.depth_by_priority() == {(fid, 1): 1, (fid, 5): 1}
    rows = h.core.status(h.now)["queue_by_priority"]
    assert [(r["priority"], r["queued"]) for r in rows] == [(5, 1), (1, 1)]
    w = h.start_worker(0)
    assert h.runs(w)  # dispatched: no longer counted
    assert h.core.queue.depth_by_priority() == {(fid, 1): 1}  # the priority-5 call went first


def _ask(h: Harness, msg: p.Message) -> p.QueryReply:
    out = h.feed(b"cli", msg)
    return next(s.msg for s in out if isinstance(s.msg, p.QueryReply))


def test_ops_desk_keeps_output_meters_calls_by_user_and_drains() -> None:
    store = UserStore()
    _, bob_token = store.create("bob", 0.0)
    h = Harness(devices=2, users=store)
    h.hello(b"bob", p.Role.CLIENT, token=bob_token, info={"user": "an OS label"})
    w0, w1 = h.start_worker(0), h.start_worker(1)
    fid = h.register("f")
    a = h.submit(fid)
    h.feed(w0, p.Output(a, "stdout", "hello\nworld\n"))
    h.finish(w0, a, duration=2.0)
    h.feed(b"bob", p.Register(fid, "code-f", "f", h.core.functions[fid].spec.to_wire(), [], (b"c",)))
    b = "bob1"
    h.feed(b"bob", p.Submit(b, fid, {}, frames=(b"args",)))
    logs = _ask(h, p.Query(1, p.QueryKind.LOGS, {"target": "f"})).data
    assert [ln["text"] for ln in logs["lines"]] == ["hello", "world"]
    assert logs["lines"][0]["invocation_id"] == a
    assert not _ask(h, p.Query(2, p.QueryKind.LOGS, {"target": "g"})).data["found"]
    usage = _ask(h, p.Query(3, p.QueryKind.USAGE, {"by": "user"})).data["rows"]
    assert {r["user"]: r["calls"] for r in usage} == {"admin": 1}  # bob's call still runs
    assert usage[0]["device_seconds"] == pytest.approx(2.0)
    # Drain: bob's running call may finish, new calls are refused, then the shell stops.
    ack = _ask(h, p.Drain(4, 30.0, "test")).data
    assert ack["running"] == 1 and ack["dropped_queued"] == 0
    assert not h.core.ops.stop_now(h.now)
    late = h.submit(fid)
    assert h.results()[late].error_kind == "ConnectionLost"
    runner = w0 if b in h.core.devices["n:0"].running else w1
    h.feed(runner, p.Result(b, True, "", "", p.ResultMeta(dispatch_token=h.token(b)), (b"v",)), 1.0)
    assert h.core.ops.stop_now(h.now)
    usage = _ask(h, p.Query(5, p.QueryKind.USAGE, {"by": "user"})).data["rows"]
    assert {r["user"]: r["calls"] for r in usage} == {"admin": 1, "bob": 1}


def test_drain_drops_queued_calls_and_ends_after_its_grace() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    fid = h.register("f")
    running, queued = h.submit(fid), h.submit(fid)
    assert [r.invocation_id for r in h.runs(w)] == [running]
    ack = _ask(h, p.Drain(1, 5.0)).data
    assert ack == {"running": 1, "dropped_queued": 1, "grace": 5.0, "already_draining": False}
    assert h.results()[queued].error_kind == "Cancelled"
    assert not h.core.ops.stop_now(h.now + 4.9) and h.core.ops.stop_now(h.now + 5.0)


def test_only_clients_may_drain() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    out = h.feed(w, p.Drain(1, 0.0))
    refused = next(s.msg for s in out if isinstance(s.msg, p.Error))
    assert "may not send Drain" in refused.message and not h.core.ops.draining


def test_grafana_dashboard_parses_and_uses_the_exported_names() -> None:
    import json
    import re
    from pathlib import Path

    from gpufn.scheduler import metrics

    path = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "gpufn-dashboard.json"
    dash = json.loads(path.read_text())
    exprs = " ".join(t["expr"] for panel in dash["panels"] for t in panel["targets"])
    used = set(re.findall(r"gpufn_[a-z_]+", exprs))
    pytest.importorskip("prometheus_client")
    snap = {"calls": [], "device_seconds": [], "queue_wait": [], "duration": [], "queue": [],
            "devices": [], "workers": [], "loads": 0, "evictions": 0, "deployments": []}
    exported = set()
    for fam in metrics.families(snap):
        exported |= {fam.name, f"{fam.name}_total", f"{fam.name}_bucket"}
    assert used and used <= exported, used - exported
    for name in ("gpufn_calls_total", "gpufn_queue_depth", "gpufn_queue_wait_seconds_bucket",
                 "gpufn_call_duration_seconds_bucket", "gpufn_device_memory_used_bytes",
                 "gpufn_models_resident", "gpufn_workers", "gpufn_deployment_info"):
        assert name in used
