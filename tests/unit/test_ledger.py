"""The device ledger: byte accounting, residency operations, the admission planner,
host budgets and device ranking."""

from __future__ import annotations

import pytest

from gpufn.memory_pool.eviction import CostAwarePolicy, LRUBytesPolicy, LRUCountPolicy
from gpufn.memory_pool.ledger import (
    DeviceLedger,
    Fit,
    HostLedger,
    ModelNeed,
    NeverFits,
    Request,
    SizeCorrection,
    StaleFit,
    choose_device,
)
from gpufn.memory_pool.residency import IllegalResidency, Residency

R = Residency


def put(ledger: DeviceLedger, name: str, nbytes: int, *, seconds: float = 1.0,
        now: float = 0.0, **flags: bool) -> None:
    """Make `name` resident and idle on `ledger` (loaded in `seconds`)."""
    ledger.load_started(ModelNeed(name, nbytes, **flags), now)
    ledger.load_done(name, now, nbytes, seconds)


def offloaded(ledger: DeviceLedger, name: str, nbytes: int, *, seconds: float = 1.0,
              reload: float | None = None) -> None:
    put(ledger, name, nbytes, seconds=seconds)
    ledger.offload_started(name, 0.0)
    ledger.offload_done(name, 0.0)
    ledger.models[name].reload_seconds = reload


def plan(ledger: DeviceLedger, *models: ModelNeed, workspace: int = 0, **kw: object) -> Fit:
    p = ledger.fit(Request(tuple(models), workspace), **kw)  # type: ignore[arg-type]
    assert isinstance(p, Fit), p
    return p


def test_workspace_api_keeps_its_meaning() -> None:
    led = DeviceLedger(100)
    led.reserve("i1", 30)
    led.reserve("i2", 20)
    with pytest.raises(KeyError):
        led.reserve("i1", 5)
    assert (led.workspace_bytes, led.used, led.free) == (50, 50, 50)
    assert led.release("i1") == 30 and led.release("i1") == 0
    led.reset()
    assert led.used == 0 and led.workspace == {}


def test_admit_without_eviction_then_share() -> None:
    led = DeviceLedger(100)
    a = ModelNeed("a", 40)
    p1 = plan(led, a, workspace=10)
    assert (p1.load, p1.victims, p1.load_bytes, p1.free_after) == (("a",), (), 40, 50)
    led.admit("i1", p1, 1.0)
    assert led.state("a") is R.LOADING and led.used == 50
    p2 = plan(led, a, workspace=10)  # a second call shares the load in flight
    assert (p2.load, p2.waiting) == ((), ("a",))
    led.admit("i2", p2, 2.0)
    e = led.models["a"]
    assert (e.in_use, e.uses, led.used) == (2, 2, 60)
    assert led.load_done("a", 3.0, 45, 2.5) is None  # within 25% of the estimate
    assert (e.state, e.nbytes, e.measured, e.load_seconds, led.used) == (
        R.RESIDENT, 45, True, 2.5, 65)
    assert led.release("i1", now=4.0) == 10 and led.release("i2", now=5.0) == 10
    assert (e.in_use, e.last_used, led.used) == (0, 5.0, 45)
    p3 = plan(led, a, workspace=10)
    assert (p3.resident, p3.load, p3.load_bytes) == (("a",), (), 0)


def test_measured_size_corrects_the_estimate() -> None:
    led = DeviceLedger(1000)
    led.admit("i", plan(led, ModelNeed("a", 40)), 0.0)
    fix = led.load_done("a", 1.0, 60, 1.0)
    assert isinstance(fix, SizeCorrection) and (fix.estimate, fix.measured) == (40, 60)
    assert "50% over" in str(fix)
    assert led.used == 60
    led.release("i")
    led.evict_started("a", 2.0)
    led.evict_done("a", 2.0)
    # the next load here plans with the measured size, not the stale estimate
    assert plan(led, ModelNeed("a", 40)).load_bytes == 60
    led.load_started(ModelNeed("b", 0), 3.0)
    assert "no estimate" in str(led.load_done("b", 3.0, 10, 0.1))


def test_load_failed_frees_and_names_holders() -> None:
    led = DeviceLedger(100)
    p = plan(led, ModelNeed("a", 40), workspace=5)
    led.admit("i1", p, 0.0)
    led.admit("i2", plan(led, ModelNeed("a", 40), workspace=5), 0.0)
    assert sorted(led.load_failed("a", 1.0)) == ["i1", "i2"]
    assert led.state("a") is R.ABSENT and led.used == 10
    led.release("i1")
    led.release("i2")
    assert led.used == 0 and led.models["a"].in_use == 0
    with pytest.raises(IllegalResidency):
        led.load_done("a", 2.0, 40, 1.0)


def test_eviction_picks_lowest_value_and_spares_unneeded_victims() -> None:
    led = DeviceLedger(100)
    put(led, "s", 10, seconds=0.5, offload=False)  # lowest value: cheap to reload
    put(led, "b", 50, seconds=4.0, offload=False)
    put(led, "m", 30, seconds=6.0, offload=False)
    pol = CostAwarePolicy()
    assert [e.name for e in pol.order(led.models.values())] == ["s", "b", "m"]
    p = plan(led, ModelNeed("d", 40, offload=False))
    # greedy takes s then b; s alone would not do and b alone does, so s is spared
    assert (p.evict, p.offload, p.freed_bytes, p.free_after) == (("b",), (), 50, 20)
    led.admit("i", p, 1.0)
    assert led.state("b") is R.EVICTING and led.used == 130  # held until the worker is done
    led.evict_done("b", 2.0)
    assert led.used == 80 and led.state("d") is R.LOADING
    assert led.clock == pytest.approx(pol.value(led.models["b"]))


def test_pinned_in_use_and_loading_models_are_never_victims() -> None:
    led = DeviceLedger(100)
    put(led, "pinned", 40, pinned=True)
    put(led, "busy", 30)
    led.acquire("x", [ModelNeed("busy", 30)], 1.0)
    led.load_started(ModelNeed("loading", 10), 1.0)
    assert led.fit(Request((ModelNeed("c", 30),))) is None  # fits later, not now
    led.release("x")
    p = plan(led, ModelNeed("c", 30))
    assert p.victims == ("busy",)
    with pytest.raises(ValueError, match="pinned"):
        led.evict_started("pinned", 2.0)
    led.acquire("y", [ModelNeed("busy", 30)], 2.0)
    with pytest.raises(ValueError, match="in use"):
        led.offload_started("busy", 2.0)


def test_never_fits_reports_the_shortfall() -> None:
    led = DeviceLedger(100)
    v = led.fit(Request((ModelNeed("a", 60), ModelNeed("b", 30)), workspace=20))
    assert isinstance(v, NeverFits) and (v.shortfall, v.required, v.capacity) == (10, 110, 100)
    assert "short by 10 B" in str(v)
    put(led, "p", 15, pinned=True)
    v = led.fit(Request((ModelNeed("a", 60), ModelNeed("b", 30)), workspace=0))
    assert isinstance(v, NeverFits) and (v.shortfall, v.pinned) == (5, 15)
    assert "pinned" in str(v)


def test_model_on_its_way_out_makes_the_call_wait() -> None:
    led = DeviceLedger(100)
    put(led, "a", 40)
    led.offload_started("a", 1.0)
    assert led.fit(Request((ModelNeed("a", 40),))) is None
    led.offload_done("a", 2.0)
    assert plan(led, ModelNeed("a", 40)).restore == ("a",)


def test_offload_restore_cycle_with_host_budget() -> None:
    host = HostLedger(100)
    led = DeviceLedger(100, host=host, key="n:0")
    put(led, "a", 40)
    p = plan(led, ModelNeed("b", 80))
    assert (p.offload, p.evict) == (("a",), ())
    led.admit("i", p, 1.0)
    assert host.used == 40 and led.used == 120
    led.offload_done("a", 2.0)
    led.load_done("b", 3.0, 80, 1.0)
    led.release("i")
    assert led.used == 80
    # a comes back; b (80) no longer fits in host memory (60 free) and a's own copy
    # is the one being restored, so b is evicted rather than offloaded
    p = plan(led, ModelNeed("a", 40))
    assert (p.restore, p.offload, p.evict, p.drop_host) == (("a",), (), ("b",), ())
    assert p.restore_bytes == 40
    led.admit("j", p, 4.0)
    assert led.state("a") is R.LOADING and host.used == 40
    led.restore_done("a", 5.0, 0.25)
    e = led.models["a"]
    assert (e.state, e.reload_seconds, host.used) == (R.RESIDENT, 0.25, 0)
    led.load_started(ModelNeed("c", 1), 6.0)
    with pytest.raises(ValueError, match="not restored"):
        led.restore_done("c", 6.0, 0.1)


def test_host_budget_drops_the_cheapest_offloaded_copy_node_wide() -> None:
    host = HostLedger(100)
    d0 = DeviceLedger(100, host=host, key="n:0")
    d1 = DeviceLedger(100, host=host, key="n:1")
    offloaded(d1, "x", 50, seconds=100.0, reload=5.0)  # dear to lose
    offloaded(d1, "y", 40, seconds=1.0, reload=0.1)  # cheap to lose
    assert host.free == 10
    put(d0, "v", 30)
    p = plan(d0, ModelNeed("w", 90))
    assert (p.offload, p.drop_host) == (("v",), (("n:1", "y"),))
    d0.admit("i", p, 1.0)
    assert d1.state("y") is R.ABSENT and d1.state("x") is R.OFFLOADED
    assert sorted(host.copies) == [("n:0", "v"), ("n:1", "x")] and host.used == 80


def test_victim_larger_than_host_budget_is_evicted() -> None:
    host = HostLedger(20)
    led = DeviceLedger(100, host=host, key="n:0")
    put(led, "big", 60)
    put(led, "nooff", 10, offload=False)
    p = plan(led, ModelNeed("n", 95))
    assert set(p.evict) == {"big", "nooff"} and p.offload == () and p.drop_host == ()


def test_lru_count_evicts_by_count_and_ignores_bytes() -> None:
    led = DeviceLedger(100, policy=LRUCountPolicy(max_models=2))
    put(led, "a", 60, now=1.0)
    put(led, "b", 60, now=2.0)  # already over capacity: the baseline does not look
    led.acquire("x", [ModelNeed("a", 60)], 3.0)
    led.release("x", now=3.0)  # a is now more recent than b
    p = plan(led, ModelNeed("c", 60), workspace=50)
    assert (p.evict, p.offload, p.load) == (("b",), (), ("c",))
    assert p.free_after < 0  # over-committed, on purpose
    led.acquire("y", [ModelNeed("a", 60)], 4.0)
    led.acquire("z", [ModelNeed("b", 60)], 4.0)
    assert led.fit(Request((ModelNeed("c", 60),))) is None
    v = led.fit(Request((ModelNeed("c", 1), ModelNeed("d", 1), ModelNeed("e", 1))))
    assert isinstance(v, NeverFits) and "allows 2" in str(v)


def test_lru_bytes_never_over_commits_and_offloads_only_when_asked() -> None:
    for policy, host_tier in ((LRUBytesPolicy(), False), (LRUBytesPolicy(offload=True), True)):
        host = HostLedger(1000)
        led = DeviceLedger(100, host=host, key="n:0", policy=policy)
        put(led, "old", 30, seconds=60.0)
        put(led, "mid", 30)
        put(led, "new", 30)
        # old is used often and dear to reload, but least recently
        for i, name in enumerate(["old"] * 5 + ["mid", "new"]):
            led.acquire(f"u{i}", [ModelNeed(name, 30)], float(i))
            led.release(f"u{i}", now=float(i))
        # 10 free; a 45-byte model with 5 of workspace needs 40 more: the two least
        # recently used go, by recency alone
        p = plan(led, ModelNeed("x", 45), workspace=5)
        assert set(p.victims) == {"old", "mid"} and p.free_after == 20
        assert (set(p.offload), set(p.evict)) == (
            ({"old", "mid"}, set()) if host_tier else (set(), {"old", "mid"}))
        led.acquire("busy", [ModelNeed("new", 30)], 4.0)
        assert led.fit(Request((ModelNeed("y", 71),))) is None  # would over-commit: waits
        assert isinstance(led.fit(Request((ModelNeed("z", 101),))), NeverFits)


def test_gdsf_in_the_ledger_keeps_hot_expensive_models() -> None:
    led = DeviceLedger(100)
    put(led, "hot", 40, seconds=30.0)
    put(led, "cold", 40, seconds=30.0)
    for i in range(5):
        led.acquire(f"h{i}", [ModelNeed("hot", 40)], float(i))
        led.release(f"h{i}")
    assert plan(led, ModelNeed("new", 50)).victims == ("cold",)
    led.acquire("c", [ModelNeed("cold", 40, priority=5)], 9.0)  # 2**5 outweighs 5 uses
    led.release("c")
    assert plan(led, ModelNeed("new", 50)).victims == ("hot",)


def test_reset_forgets_the_worker_and_its_host_copies() -> None:
    host = HostLedger(1000)
    d0 = DeviceLedger(100, host=host, key="n:0")
    d1 = DeviceLedger(100, host=host, key="n:1")
    offloaded(d0, "a", 30)
    offloaded(d1, "a", 30)
    put(d0, "b", 20)
    d0.admit("i", plan(d0, ModelNeed("b", 20), ModelNeed("c", 10), workspace=5), 1.0)
    d0.reset(2.0)
    assert {n: e.state for n, e in d0.models.items()} == {"a": R.ABSENT, "b": R.ABSENT,
                                                          "c": R.ABSENT}
    assert d0.used == 0 and d0.holds == {} and d0.models["b"].in_use == 0
    assert list(host.copies) == [("n:1", "a")]
    assert plan(d0, ModelNeed("b", 20)).load == ("b",)  # loadable again


def test_host_copy_dropped_or_offload_failed() -> None:
    host = HostLedger(100)
    led = DeviceLedger(100, host=host, key="n:0")
    offloaded(led, "a", 30)
    assert led.drop_host_copy("a", 1.0) == 30 and host.used == 0
    assert led.state("a") is R.ABSENT
    put(led, "b", 40)
    led.offload_started("b", 2.0)
    assert host.used == 40 and led.used == 40
    led.offload_failed("b", 3.0)
    assert (led.state("b"), host.used, led.used) == (R.ABSENT, 0, 0)


def test_stale_plan_is_refused() -> None:
    led = DeviceLedger(100)
    p = plan(led, ModelNeed("a", 10))
    led.reserve("other", 5)
    with pytest.raises(StaleFit):
        led.admit("i", p, 0.0)


def test_misuse_is_rejected() -> None:
    led = DeviceLedger(100)
    with pytest.raises(KeyError):
        led.acquire("i", [ModelNeed("ghost")], 0.0)
    led.load_started(ModelNeed("a", 10, offload=False), 0.0)
    led.load_done("a", 0.0, 10, 1.0)
    with pytest.raises(ValueError, match="offload=False"):
        led.offload_started("a", 1.0)
    led.evict_started("a", 1.0)
    led.evict_done("a", 1.0)
    with pytest.raises(ValueError, match="absent"):
        led.acquire("i", [ModelNeed("a")], 2.0)
    with pytest.raises(ValueError, match="device key"):
        DeviceLedger(100, host=HostLedger(10))


def test_device_ranking_prefers_resident_then_host_then_least_eviction() -> None:
    host = HostLedger(1000)
    need = Request((ModelNeed("m", 40),), workspace=20)
    resident = DeviceLedger(100, host=host, key="n:r")
    put(resident, "m", 40)
    put(resident, "other", 50)  # needs an eviction, still best
    host_copy = DeviceLedger(100, host=host, key="n:h")
    offloaded(host_copy, "m", 40)
    empty = DeviceLedger(100)
    crowded = DeviceLedger(100)
    put(crowded, "x", 60)
    costs = []
    for key, led in {"c": crowded, "e": empty, "h": host_copy, "r": resident}.items():
        cost = led.cost_to_place(need)
        assert cost is not None
        costs.append((cost, key))
    assert [k for _, k in sorted(costs)] == ["r", "h", "e", "c"]
    assert resident.cost_to_place(need)[3] > 0  # type: ignore[index]  # it does evict
    best = choose_device({"c": crowded, "e": empty, "h": host_copy}, need)
    assert isinstance(best, tuple) and best[0] == "h"
    small = Request((ModelNeed("m", 10),))
    both_free = choose_device({"b": DeviceLedger(50), "a": DeviceLedger(60)}, small)
    assert isinstance(both_free, tuple) and both_free[0] == "a"  # ties: most free after


def test_choose_device_never_and_not_now() -> None:
    need = Request((ModelNeed("m", 150),))
    never = choose_device({"a": DeviceLedger(100), "b": DeviceLedger(120)}, need)
    assert isinstance(never, NeverFits) and never.shortfall == 30
    busy = DeviceLedger(200)
    busy.reserve("i", 100)
    assert choose_device({"a": DeviceLedger(100), "b": busy}, need) is None


def test_describe_snapshot() -> None:
    led = DeviceLedger(100)
    put(led, "a", 40, pinned=True)
    d = led.describe()
    assert d["used"] == 40
    assert d["models"] == {"a": {"state": "resident", "nbytes": 40, "measured": True,
                                 "in_use": 0, "uses": 0, "pinned": True}}
