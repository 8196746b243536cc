"""Sharded models in the scheduler: group victims in the ledger (all-or-nothing), the
model book's joint gang plans, placement onto the holding gang, stale shards swept."""

from __future__ import annotations

from typing import Any

from gpufn.memory_pool.ledger import (
    DeviceLedger,
    GroupFit,
    HostLedger,
    ModelNeed,
    Request,
    fit_group,
)
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.core import RendezvousReady
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p

from .core_harness import Harness

GiB = 2**30


# --------------------------------------------------------------------------- ledger


def _ledgers(host: int = 64 * GiB) -> dict[str, DeviceLedger]:
    h = HostLedger(host)
    return {k: DeviceLedger(10 * GiB, host=h, key=k) for k in ("a", "b", "c")}


def _resident_shards(leds: dict[str, DeviceLedger], name: str, devices: tuple[str, ...],
                     nbytes: int = 6 * GiB) -> None:
    for k in devices:
        led = leds[k]
        led.load_started(ModelNeed(name, nbytes), 0.0)
        led.load_done(name, 1.0, nbytes, 1.0)
        led.models[name].shards = devices


def test_a_victim_shard_takes_its_siblings_along_outside_the_gang() -> None:
    leds = _ledgers()
    _resident_shards(leds, "x", ("a", "b"))
    req = Request((ModelNeed("y", 6 * GiB),), 0, "f")
    # planned alone, device a would give up only its own half of x
    alone = leds["a"].fit(req)
    assert alone is not None and not isinstance(alone, Exception)
    got = fit_group(leds, ("a", "c"), req)
    assert isinstance(got, GroupFit)
    assert got.plans["a"].offload == ("x",) and got.outside == (("b", "x", "offload"),)


def test_shards_go_to_host_only_all_together() -> None:
    leds = _ledgers(host=8 * GiB)  # one 6 GiB shard fits on host, not both
    _resident_shards(leds, "x", ("a", "b"))
    got = fit_group(leds, ("a", "c"), Request((ModelNeed("y", 6 * GiB),), 0, "f"))
    assert isinstance(got, GroupFit)
    assert got.plans["a"].evict == ("x",) and not got.plans["a"].offload
    assert got.outside == (("b", "x", "evict"),)


def test_a_shard_in_use_on_one_rank_blocks_all_of_them() -> None:
    leds = _ledgers()
    _resident_shards(leds, "x", ("a", "b"))
    leds["b"].acquire("call", [ModelNeed("x")], 2.0)
    assert fit_group(leds, ("a", "c"), Request((ModelNeed("y", 6 * GiB),), 0, "f")) is None
    # with a whole model beside it on a, that one goes instead (x is never picked)
    leds["a"].capacity = 14 * GiB
    leds["a"].load_started(ModelNeed("w", 4 * GiB), 0.0)
    leds["a"].load_done("w", 1.0, 4 * GiB, 1.0)
    got = fit_group(leds, ("a", "c"), Request((ModelNeed("y", 6 * GiB),), 0, "f"))
    assert isinstance(got, GroupFit) and got.plans["a"].victims == ("w",) and not got.outside
    leds["a"].capacity = 10 * GiB
    leds["a"].evict_started("w", 2.0)
    leds["a"].evict_done("w", 2.0)
    # pinned on one rank: the same
    leds["b"].release("call")
    leds["b"].models["x"].pinned = True
    assert fit_group(leds, ("a", "c"), Request((ModelNeed("y", 6 * GiB),), 0, "f")) is None


def test_victims_chosen_on_two_gang_devices_are_consistent() -> None:
    leds = _ledgers()
    _resident_shards(leds, "x", ("a", "b"), nbytes=3 * GiB)
    _resident_shards(leds, "z", ("a", "b"), nbytes=3 * GiB)
    # y needs 6 GiB on each of a and b: one of x, z leaves whole, on both devices
    got = fit_group(leds, ("a", "b"), Request((ModelNeed("y", 6 * GiB),), 0, "f"))
    assert isinstance(got, GroupFit)
    assert got.plans["a"].victims == got.plans["b"].victims and len(got.plans["a"].victims) == 1


# --------------------------------------------------------------------------- core


def _harness(devices: int = 4, memory: int = 10 * GiB) -> tuple[Harness, dict[str, bytes]]:
    h = Harness(devices=devices, memory=memory, islands=1)
    ws = {f"n:{i}": h.start_worker(i) for i in range(devices)}
    h.sent += h.core.handle(RendezvousReady(4242), h.now)
    return h, ws


def _register(h: Harness, name: str, model: str, size: int = 6 * GiB, count: int = 2) -> str:
    desc = {"name": model, "code_id": f"code-{model}-0000", "memory": size, "nframes": 1,
            "count": count}
    spec: dict[str, Any] = {"count": count, "models": [model]}
    fid = f"{name}-fid"
    h.feed(b"cli", p.Register(fid, f"code-{name}", name, spec, [desc], (b"code", b"loader")))
    return fid


def _runs(h: Harness, inv: str) -> list[p.Run]:
    return [r for r in h.runs() if r.invocation_id == inv]


def _complete(h: Harness, ws: dict[str, bytes], inv: str, load: bool = True) -> tuple[str, ...]:
    """Answer the model orders (loads, offloads, evictions) and finish the call."""
    runs = _runs(h, inv)
    devices = tuple(runs[0].meta.gang["devices"])
    _settle_models(h, ws)
    for r in runs:
        dev = devices[r.meta.gang["rank"]]
        h.feed(ws[dev], p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=h.token(inv)), (b"v",)))
    return devices


def _settle_models(h: Harness, ws: dict[str, bytes]) -> None:
    # The orders answered so far, kept on the harness: a module-level set keyed by id(h)
    # mistook a new harness (at a freed harness's address) for an old one.
    answered: set[int] = h.__dict__.setdefault("answered_orders", set())
    by_peer = {v: k for k, v in ws.items()}
    for i, s in enumerate(list(h.sent)):
        if i in answered or s.peer not in by_peer:
            continue
        msg = s.msg
        if isinstance(msg, p.LoadModel):
            answered.add(i)
            h.feed(s.peer, p.ModelEvent(msg.model, p.ModelState.RESIDENT, 6 * GiB, 2.0))
        elif isinstance(msg, p.EvictModel):
            answered.add(i)
            state = p.ModelState.OFFLOADED if msg.offload else p.ModelState.EVICTED
            h.feed(s.peer, p.ModelEvent(msg.model, state, 6 * GiB, 0.1))


def _states(h: Harness, key_prefix: str) -> dict[str, str]:
    out = {}
    for k, d in h.core.devices.items():
        for name, e in d.ledger.models.items():
            if name.startswith(key_prefix) and e.state is not Residency.ABSENT:
                out[k] = e.state.value
    return out


def test_calls_go_to_the_gang_holding_the_shards_in_rank_order() -> None:
    h, ws = _harness()
    fid = _register(h, "gen", "llama")
    first = h.submit(fid)
    held = _complete(h, ws, first)
    loads = [s for s in h.sent if isinstance(s.msg, p.LoadModel)]
    assert len(loads) == 2 and all(s.msg.spec.get("sharded") for s in loads)
    for _ in range(3):
        inv = h.submit(fid)
        runs = _runs(h, inv)
        assert tuple(runs[0].meta.gang["devices"]) == held  # same devices, same rank order
        assert runs[0].meta.warm
        _complete(h, ws, inv)
    assert len([s for s in h.sent if isinstance(s.msg, p.LoadModel)]) == 2  # loaded once
    rec = next(r for r in h.core.models.models.values() if r.name == "llama")
    assert rec.loads == 1 and rec.holder is not None and rec.holder.devices == held


def test_eviction_takes_every_shard_and_a_restore_brings_them_all_back() -> None:
    h, ws = _harness(devices=2)
    a = _register(h, "use_a", "model_a")
    b = _register(h, "use_b", "model_b")
    _complete(h, ws, h.submit(a))
    assert set(_states(h, "model_a").values()) == {"resident"}
    _complete(h, ws, h.submit(b))  # 6 + 6 GiB > 10 GiB: a leaves, on both ranks
    assert _states(h, "model_a") == {"n:0": "offloaded", "n:1": "offloaded"}
    assert set(_states(h, "model_b").values()) == {"resident"}
    inv = h.submit(a)
    _complete(h, ws, inv)
    restores = [s for s in h.sent if isinstance(s.msg, p.LoadModel) and s.msg.spec.get("restore")]
    assert len(restores) == 2  # both ranks, in parallel
    # b leaves whole: the host (16 GiB) still holds a's copies while they restore, so
    # b's two shards do not fit there together and both are evicted, never one of them
    assert _states(h, "model_b") == {}
    assert sorted(s.peer for s in h.sent if isinstance(s.msg, p.EvictModel)
                  and s.msg.model.startswith("model_b")) == sorted(ws.values())
    assert h.results()[inv].meta.cold_start == "restored"


def test_a_failed_gang_makes_its_shards_stale_and_the_next_call_reloads() -> None:
    h, ws = _harness(devices=2)
    fid = _register(h, "gen", "llama")
    _complete(h, ws, h.submit(fid))
    inv = h.submit(fid)
    runs = _runs(h, inv)
    devices = tuple(runs[0].meta.gang["devices"])
    # rank 1 fails: the group is broken, so the shards (tied to it) must not serve again
    h.feed(ws[devices[1]], p.Result(inv, False, "", "boom", p.ResultMeta(dispatch_token=h.token(inv))))
    h.feed(ws[devices[0]], p.Result(inv, False, "", "peer", p.ResultMeta(
        dispatch_token=h.token(inv), comm_error=True)))
    assert h.results()[inv].ok is False
    evicts = [s for s in h.sent if isinstance(s.msg, p.EvictModel)]
    assert {s.peer for s in evicts} == {ws[devices[0]], ws[devices[1]]}  # every rank's shard
    _settle_models(h, ws)
    again = h.submit(fid)
    runs = _runs(h, again)
    assert runs and not runs[0].meta.warm  # a new generation ...
    assert len([s for s in h.sent if isinstance(s.msg, p.LoadModel)]) == 4  # ... loads again


def test_a_dead_rank_invalidates_the_shards_on_the_whole_gang() -> None:
    h, ws = _harness(devices=2)
    fid = _register(h, "gen", "llama")
    held = _complete(h, ws, h.submit(fid))
    h.feed(b"sup", p.WorkerExited(held[1], 100, -9, "killed"))
    # the surviving rank's shard is dropped (it belongs to the lost group)
    evicts = [s for s in h.sent if isinstance(s.msg, p.EvictModel)]
    assert [s.peer for s in evicts] == [ws[held[0]]]
    rec = next(r for r in h.core.models.models.values() if r.name == "llama")
    assert rec.holder is None
    assert h.core.invocations == {} or all(i.state is not InvState.RUNNING
                                           for i in h.core.invocations.values())


def test_a_single_device_call_that_evicts_a_shard_takes_the_whole_model() -> None:
    h, ws = _harness(devices=2)
    _complete(h, ws, h.submit(_register(h, "gen", "llama")))
    single = _register(h, "one", "whole", count=1)
    inv = h.submit(single)
    _settle_models(h, ws)
    run = _runs(h, inv)[0]
    assert run.meta.models  # it was placed, with room made on its device
    # llama left both devices (to host), not only the device the call needed
    assert _states(h, "llama") == {"n:0": "offloaded", "n:1": "offloaded"}
    assert _states(h, "whole") == {h.core.invocations[inv].devices[0]: "resident"}


def test_status_shows_a_sharded_model_once_with_its_gang_and_bytes() -> None:
    from gpufn.cli.render import model_counters_table, models_table

    h, ws = _harness(devices=2)
    _complete(h, ws, h.submit(_register(h, "gen", "llama")))
    st = h.core.status(h.now)
    rec = next(m for m in st["models"] if m["name"] == "llama")
    assert rec["count"] == 2 and rec["gang"] == ["n:0", "n:1"]
    assert rec["shard_bytes"] == {"n:0": 6 * GiB, "n:1": 6 * GiB}
    table = models_table(st)
    assert table is not None and table.row_count == 1
    counters = model_counters_table(st)
    assert counters is not None and counters.row_count == 1


def test_a_loader_failing_on_one_rank_makes_the_other_shards_stale() -> None:
    """Rank 1's loader fails while rank 0's shard loaded: rank 0's is partial, so it is
    evicted, and the next call loads the model on every rank again."""
    h, ws = _harness(devices=2)
    fid = _register(h, "gen", "llama")
    inv = h.submit(fid)
    devices = tuple(_runs(h, inv)[0].meta.gang["devices"])
    key = next(r.key for r in h.core.models.models.values() if r.name == "llama")
    h.feed(ws[devices[0]], p.ModelEvent(key, p.ModelState.RESIDENT, 6 * GiB, 2.0))
    h.feed(ws[devices[1]], p.ModelEvent(key, p.ModelState.LOAD_FAILED, 0, 0.5, "RuntimeError",
                                        "no weights"))
    for r in _runs(h, inv):
        dev = devices[r.meta.gang["rank"]]
        h.feed(ws[dev], p.Result(inv, False, "", "loader failed",
                                 p.ResultMeta(dispatch_token=h.token(inv))))
    assert not h.results()[inv].ok
    h.tick(0.1)
    evicts = [s for s in h.sent if isinstance(s.msg, p.EvictModel) and s.msg.model == key]
    assert [s.peer for s in evicts] == [ws[devices[0]]], "the partial shard stayed"
    _settle_models(h, ws)
    loads = len([s for s in h.sent if isinstance(s.msg, p.LoadModel)])
    again = h.submit(fid)
    assert _runs(h, again)
    assert len([s for s in h.sent if isinstance(s.msg, p.LoadModel)]) == loads + 2


def test_the_largest_shard_plans_the_gang() -> None:
    for sizes in ((6 * GiB, 4 * GiB), (4 * GiB, 6 * GiB)):
        h, ws = _harness(devices=2)
        inv = h.submit(_register(h, "gen", "llama"))
        devices = tuple(_runs(h, inv)[0].meta.gang["devices"])
        key = next(r.key for r in h.core.models.models.values() if r.name == "llama")
        for dev, nbytes in zip(devices, sizes, strict=True):  # rank 0 first
            h.feed(ws[dev], p.ModelEvent(key, p.ModelState.RESIDENT, nbytes, 1.0))
        assert h.core.models.models[key].size == 6 * GiB, sizes
