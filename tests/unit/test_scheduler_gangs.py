from __future__ import annotations

import pytest

from gpufn.scheduler.core import RendezvousReady
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p

from .core_harness import Harness


def _harness(devices: int = 4, islands: int = 2, **cfg: object) -> tuple[Harness, list[bytes]]:
    h = Harness(devices=devices, islands=islands, **cfg)
    ws = [h.start_worker(i) for i in range(devices)]
    h.sent += h.core.handle(RendezvousReady(4242), h.now)
    return h, ws


def _gang_runs(h: Harness, inv: str) -> list[p.Run]:
    return [r for r in h.runs() if r.invocation_id == inv]


def test_gang_waits_for_the_rendezvous_then_gets_close_devices() -> None:
    h = Harness(devices=4, islands=2)
    for i in range(4):
        h.start_worker(i)
    fid = h.register("g", count=2)
    inv = h.submit(fid)
    assert h.core.needs_rendezvous and not _gang_runs(h, inv)
    h.sent += h.core.handle(RendezvousReady(4242), h.now)
    runs = _gang_runs(h, inv)
    assert [r.meta.gang["rank"] for r in runs] == [0, 1]
    assert runs[0].meta.gang["store_port"] == 4242
    assert tuple(runs[0].meta.gang["devices"]) in (("n:0", "n:1"), ("n:2", "n:3"))  # one island


def test_gang_success_returns_rank_zero_and_gather_returns_all() -> None:
    h, ws = _harness()
    fid = h.register("g", count=2)
    inv = h.submit(fid)
    r0, _ = _gang_runs(h, inv)
    keys = r0.meta.gang["devices"]
    w = {f"n:{i}": ws[i] for i in range(4)}
    h.feed(w[keys[1]], p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=h.token(inv)), (b"one",)))
    assert inv not in h.results()
    h.feed(w[keys[0]], p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=h.token(inv)), (b"zero",)))
    assert h.results()[inv].frames == (b"zero",)
    g = h.register("gather", count=2, gather=True)
    inv2 = h.submit(g)
    for r in _gang_runs(h, inv2):
        h.feed(w[r.meta.gang["devices"][r.meta.gang["rank"]]],
               p.Result(inv2, True, "", "", p.ResultMeta(dispatch_token=h.token(inv2)), (f"r{r.meta.gang['rank']}".encode(),)))
    res = h.results()[inv2]
    assert res.frames == (b"r0", b"r1") and res.meta.gather == [1, 1]


def test_warm_gang_is_reused_with_the_same_generation() -> None:
    h, ws = _harness()
    fid = h.register("g", count=2)
    w = {f"n:{i}": ws[i] for i in range(4)}
    gens = []
    for _ in range(2):
        inv = h.submit(fid)
        runs = _gang_runs(h, inv)
        gens.append((tuple(runs[0].meta.gang["devices"]), runs[0].meta.gang["generation"],
                     runs[0].meta.warm))
        for r in runs:
            h.feed(w[r.meta.gang["devices"][r.meta.gang["rank"]]],
                   p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=h.token(inv)), (b"x",)))
    assert gens[0][0] == gens[1][0] and gens[0][1] == gens[1][1]
    assert (gens[0][2], gens[1][2]) == (False, True)


def test_failing_rank_stops_the_others_and_the_root_cause_wins() -> None:
    h, ws = _harness()
    fid = h.register("g", count=2)
    inv = h.submit(fid)
    runs = _gang_runs(h, inv)
    keys = runs[0].meta.gang["devices"]
    w = {f"n:{i}": ws[i] for i in range(4)}
    # rank 0's communication error arrives before rank 1's own exception
    h.feed(w[keys[0]], p.Result(inv, False, "", "[rank 0 of 2] Connection reset by peer",
                                p.ResultMeta(dispatch_token=h.token(inv), comm_error=True, rank=0), (b"e0",)))
    aborts = [s for s in h.of_type(p.GroupOp) if s.msg.op == "abort"]
    assert aborts and inv not in h.results()
    h.feed(w[keys[1]], p.Result(inv, False, "", "[rank 1 of 2] ValueError", p.ResultMeta(dispatch_token=h.token(inv), rank=1),
                                (b"e1",)))
    res = h.results()[inv]
    assert res.frames == (b"e1",) and res.meta.rank == 1
    assert all(not h.core.devices[k].running for k in keys)


def test_dead_rank_gives_worker_lost_even_after_a_peer_error() -> None:
    h, ws = _harness()
    fid = h.register("g", count=2)
    inv = h.submit(fid)
    keys = _gang_runs(h, inv)[0].meta.gang["devices"]
    w = {f"n:{i}": ws[i] for i in range(4)}
    h.feed(w[keys[0]], p.Result(inv, False, "", "Connection reset by peer",
                                p.ResultMeta(dispatch_token=h.token(inv), comm_error=True), (b"e0",)))
    h.feed(b"sup", p.WorkerExited(keys[1], 100, -9, "killed by signal 9"))
    res = h.results()[inv]
    assert res.error_kind == "WorkerLost" and "rank 1" in res.message


def test_gang_failure_settles_after_a_grace_when_a_rank_is_silent() -> None:
    h, ws = _harness(gang_settle_seconds=2.0)
    fid = h.register("g", count=2)
    inv = h.submit(fid)
    keys = _gang_runs(h, inv)[0].meta.gang["devices"]
    w = {f"n:{i}": ws[i] for i in range(4)}
    h.feed(w[keys[0]], p.Result(inv, False, "", "boom", p.ResultMeta(dispatch_token=h.token(inv)), (b"e0",)))
    h.tick(dt=1.0)
    assert inv not in h.results()
    h.tick(dt=1.5)
    assert h.results()[inv].frames == (b"e0",)
    # the silent rank still holds its device until it stops, or is killed after the grace
    assert inv in h.core.devices[keys[1]].running
    h.tick(dt=10.0)
    kills = [s.msg for s in h.of_type(p.KillWorker)]
    assert [k.device for k in kills] == [keys[1]]


def test_head_gang_reserves_draining_devices_and_only_short_calls_backfill() -> None:
    h, ws = _harness(devices=2, islands=1)
    long_fn = h.register("long")
    short_fn = h.register("short")
    gang = h.register("g", count=2)
    w = {"n:0": ws[0], "n:1": ws[1]}
    # teach the scheduler run times: long = 10 s, short = 0.1 s
    for fid, dur in ((long_fn, 10.0), (short_fn, 0.1)):
        inv = h.submit(fid)
        assert any(r.invocation_id == inv for r in h.runs())
        key = next(k for k, d in h.core.devices.items() if inv in d.running)
        h.finish(w[key], inv, duration=dur)
    learned = {f["name"]: f["runtime_ewma"] for f in h.core.status(0.0)["functions"]}
    assert learned == {"long": 10.0, "short": 0.1, "g": None}
    busy = h.submit(long_fn)  # occupies one device for ~10 s
    g = h.submit(gang)  # cannot start: needs both devices
    assert not _gang_runs(h, g)
    blocked_long = h.submit(long_fn)
    short = h.submit(short_fn)
    running = {r.invocation_id for r in h.runs()}
    assert blocked_long not in running  # would delay the gang: not backfilled
    assert short in running  # finishes before the gang could start: backfilled
    key_short = next(k for k, d in h.core.devices.items() if short in d.running)
    h.finish(w[key_short], short, duration=0.1)
    key_busy = next(k for k, d in h.core.devices.items() if busy in d.running)
    h.finish(w[key_busy], busy, duration=10.0)
    assert _gang_runs(h, g)  # the gang started before the long call queued after it
    assert h.core.invocations[blocked_long].state is InvState.QUEUED


def test_spmd_false_holds_all_devices_and_runs_once() -> None:
    h, ws = _harness(devices=2, islands=1)
    fid = h.register("multi", count=2, spmd=False)
    inv = h.submit(fid)
    runs = _gang_runs(h, inv)
    assert len(runs) == 1 and len(runs[0].meta.multi) == 2
    assert all(inv in d.running for d in h.core.devices.values())
    h.finish(ws[0], inv)
    assert h.results()[inv].ok and all(not d.running for d in h.core.devices.values())


def test_a_rank_over_its_host_memory_fails_the_gang_with_host_out_of_memory() -> None:
    h, ws = _harness()
    fid = h.register("g", count=2, retries=3)
    inv = h.submit(fid)
    keys = _gang_runs(h, inv)[0].meta.gang["devices"]
    w = {f"n:{i}": ws[i] for i in range(4)}
    h.feed(b"sup", p.WorkerExited(keys[1], 100, p.OUT_OF_HOST_MEMORY,
                                  "its worker on host n used 9.00 GiB of host memory", 1))
    assert inv not in h.results()  # rank 0 is told to stop first
    h.feed(w[keys[0]], p.Result(inv, False, "Cancelled", "stopped",
                                p.ResultMeta(dispatch_token=h.token(inv), rank=0)))
    res = h.results()[inv]
    assert res.error_kind == "HostOutOfMemory" and "9.00 GiB" in res.message
    assert len(_gang_runs(h, inv)) == 2  # not retried, although retries=3


def _run_gang(h: Harness, w: dict[str, bytes], fid: str, duration: float = 0.001,
              ok: bool = True, rank0: float | None = None) -> list[p.Run]:
    """Submit one call of the gang function and let every rank report (rank 0 after
    `rank0` seconds when given, as when it waited for late peers)."""
    inv = h.submit(fid)
    runs = _gang_runs(h, inv)
    for r in runs:
        rank = r.meta.gang["rank"]
        took = rank0 if rank == 0 and rank0 is not None else duration
        h.feed(w[r.meta.gang["devices"][rank]], p.Result(
            inv, ok, "", "" if ok else "boom",
            p.ResultMeta(dispatch_token=h.token(inv), duration=took, rank=rank)))
    return runs


def test_a_warm_short_gang_runs_its_ranks_inline_and_nothing_else_does() -> None:
    h, ws = _harness()
    w = {f"n:{i}": ws[i] for i in range(4)}
    short = h.register("short", count=2)
    cold = _run_gang(h, w, short)
    assert [r.meta.inline for r in cold] == [False, False]  # not measured, no group yet
    warm = _run_gang(h, w, short)
    assert [(r.meta.warm, r.meta.inline) for r in warm] == [(True, True)] * 2
    _run_gang(h, w, short, ok=False)  # a failed rank breaks the group ...
    again = _run_gang(h, w, short)
    assert [(r.meta.warm, r.meta.inline) for r in again] == [(False, False)] * 2  # ... a join: a thread
    assert all(r.meta.inline for r in _run_gang(h, w, short))
    long = h.register("long", count=2)
    _run_gang(h, w, long, duration=1.0)
    assert [(r.meta.warm, r.meta.inline) for r in _run_gang(h, w, long, duration=1.0)] == [(True, False)] * 2


def test_a_gang_is_measured_by_its_shortest_rank_so_peer_lag_does_not_end_inline() -> None:
    """Rank 0 (dispatched first) waits in the collective for peers dispatched after it; on
    a loaded host that wait alone passes the short-call threshold. The gang's run time is
    its shortest rank's (its own work and collectives), so it stays inline; a gang whose
    every rank is long does not. The caller's meta still says rank 0's duration."""
    h, ws = _harness()
    w = {f"n:{i}": ws[i] for i in range(4)}
    fid = h.register("lagged", count=2)
    for _ in range(3):
        _run_gang(h, w, fid, duration=0.001, rank0=0.05)
    runs = _run_gang(h, w, fid, duration=0.001, rank0=0.05)
    assert [(r.meta.warm, r.meta.inline) for r in runs] == [(True, True)] * 2
    assert h.results()[runs[0].invocation_id].meta.duration == 0.05
    for _ in range(3):
        _run_gang(h, w, fid, duration=0.05)
    assert [r.meta.inline for r in _run_gang(h, w, fid)] == [False, False]


def test_a_warm_group_keeps_its_backend_and_a_new_generation_reads_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h, ws = _harness()
    w = {f"n:{i}": ws[i] for i in range(4)}
    fid = h.register("g", count=2)
    assert {r.meta.gang["backend"] for r in _run_gang(h, w, fid)} == {"gloo"}
    monkeypatch.setenv("GPUFN_DIST_BACKEND", "mpi")
    assert {r.meta.gang["backend"] for r in _run_gang(h, w, fid, ok=False)} == {"gloo"}  # warm
    assert {r.meta.gang["backend"] for r in _run_gang(h, w, fid)} == {"mpi"}  # a new group
