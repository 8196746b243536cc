"""Eviction policies: the GDSF value and its preferences, the LRU-count and LRU-bytes
baselines, and the name registry (with its host-tier suffixes)."""

from __future__ import annotations

import pytest

from gpufn.exceptions import InvalidSpec
from gpufn.memory_pool.eviction import (
    CostAwarePolicy,
    GiB,
    LRUBytesPolicy,
    LRUCountPolicy,
    policy_by_name,
)
from gpufn.memory_pool.residency import ModelEntry


def entry(name: str, gib: float = 1.0, *, uses: int = 1, load: float | None = 10.0,
          reload: float | None = None, offload: bool = False, priority: int = 0,
          clock: float = 0.0, last_used: float = 0.0) -> ModelEntry:
    return ModelEntry(name, int(gib * GiB), measured=True, load_seconds=load,
                      reload_seconds=reload, offload_allowed=offload, uses=uses,
                      priority=priority, clock=clock, last_used=last_used)


def names(entries: list[ModelEntry]) -> list[str]:
    return [e.name for e in entries]


def test_gdsf_value_formula() -> None:
    p = CostAwarePolicy(miss_overhead=0.0)
    # L + F * C * 2**P / S(GiB) = 1.5 + 3 * 8.0 * 2 / 2
    assert p.value(entry("m", 2.0, uses=3, load=8.0, priority=1, clock=1.5)) == 25.5
    # offloadable: C is the measured host reload time
    assert p.value(entry("m", 2.0, uses=1, reload=0.5, offload=True)) == 0.25
    # a never-used model counts as used once
    assert p.value(entry("m", 1.0, uses=0, load=4.0)) == 4.0


def test_reload_cost_estimates_until_measured() -> None:
    p = CostAwarePolicy(load_bandwidth=2 * GiB, load_overhead=1.0, host_bandwidth=4 * GiB,
                        miss_overhead=0.0)
    assert p.reload_cost(entry("a", 8.0, load=None)) == 1.0 + 4.0
    assert p.reload_cost(entry("b", 8.0, offload=True)) == 2.0
    assert p.reload_cost(entry("c", 8.0, load=3.0, offload=True, reload=0.7)) == 0.7
    # a policy that never offloads prices every model by its loader
    assert CostAwarePolicy(offload=False, miss_overhead=0.0).reload_cost(
        entry("d", load=3.0, offload=True)) == 3.0
    # every miss also pays the fixed overhead
    assert CostAwarePolicy(miss_overhead=0.05).reload_cost(entry("e", 8.0, load=3.0)) == 3.05


def test_gdsf_evicts_cheap_to_reload_first() -> None:
    p = CostAwarePolicy()
    assert names(p.order([entry("slow", load=60.0), entry("fast", load=2.0)])) == ["fast", "slow"]


def test_gdsf_evicts_rarely_used_first() -> None:
    p = CostAwarePolicy()
    assert names(p.order([entry("hot", uses=50), entry("cold", uses=1)])) == ["cold", "hot"]


def test_gdsf_evicts_big_first() -> None:
    p = CostAwarePolicy()
    assert names(p.order([entry("small", 1.0), entry("big", 16.0)])) == ["big", "small"]


def test_gdsf_keeps_high_priority() -> None:
    p = CostAwarePolicy()
    assert names(p.order([entry("vip", priority=3), entry("batch", priority=-1)])) == [
        "batch", "vip"]


def test_gdsf_offloadable_models_are_cheaper_to_lose() -> None:
    p = CostAwarePolicy()
    keep = entry("no-offload", load=20.0)
    lose = entry("offloadable", load=20.0, offload=True, reload=0.3)
    assert names(p.order([keep, lose])) == ["offloadable", "no-offload"]


def test_gdsf_clock_gives_recency() -> None:
    p = CostAwarePolicy(miss_overhead=0.0)
    old = entry("old", uses=5, load=10.0, clock=0.0)
    victim = entry("victim", uses=1, load=10.0, clock=0.0)
    clock = p.inflate(0.0, victim)
    assert clock == p.value(victim) == 10.0
    # Used after that eviction, a once-used model outranks one used 5x long ago.
    fresh = entry("fresh", uses=1, load=10.0, clock=clock * 5)
    assert names(p.order([fresh, old])) == ["old", "fresh"]
    assert p.inflate(100.0, victim) == 100.0  # the clock never goes back


def test_fixed_miss_cost_keeps_small_models_when_reloads_are_copies() -> None:
    # Reload time proportional to size (a host copy): without a fixed cost per miss the
    # size term cancels; with it the big model goes first (more hits per byte kept).
    small = entry("small", 0.1, uses=2, reload=0.01, offload=True)
    big = entry("big", 2.0, uses=2, reload=0.2, offload=True)
    assert names(CostAwarePolicy().order([small, big])) == ["big", "small"]
    assert CostAwarePolicy(miss_overhead=0.0).value(small) == pytest.approx(
        CostAwarePolicy(miss_overhead=0.0).value(big))


def test_lru_count_orders_by_recency_only() -> None:
    p = LRUCountPolicy(max_models=2)
    es = [entry("a", 100.0, uses=9, last_used=5.0), entry("b", 0.1, last_used=1.0),
          entry("c", 1.0, last_used=3.0)]
    assert names(p.order(es)) == ["b", "c", "a"]
    assert p.model_limit() == 2 and not p.bytes_aware and not p.offload
    assert p.inflate(7.0, es[0]) == 7.0


def test_registry() -> None:
    assert isinstance(policy_by_name("cost"), CostAwarePolicy)
    assert policy_by_name("cost", priority_base=3.0).priority_base == 3.0
    lru = policy_by_name("lru-count", max_models=4)
    assert isinstance(lru, LRUCountPolicy) and lru.max_models == 4
    with pytest.raises(InvalidSpec, match="known: cost, lru-count, lru-bytes"):
        policy_by_name("fifo")
    with pytest.raises(InvalidSpec, match="lru-count"):
        policy_by_name("lru-count", size=3)
    with pytest.raises(InvalidSpec, match="at least 1"):
        policy_by_name("lru-count", max_models=0)


def test_lru_bytes_orders_by_recency_only_and_is_bytes_aware() -> None:
    p = LRUBytesPolicy()
    es = [entry("a", 100.0, uses=9, load=60.0, last_used=5.0),
          entry("b", 0.1, load=60.0, priority=5, last_used=1.0), entry("c", 1.0, last_used=3.0)]
    assert names(p.order(es)) == ["b", "c", "a"]
    assert p.bytes_aware and p.model_limit() is None and not p.offload
    assert p.inflate(7.0, es[0]) == 7.0


def test_host_tier_suffixes() -> None:
    assert policy_by_name("cost").offload and not policy_by_name("cost:no-host").offload
    nohost = policy_by_name("cost:no-host", priority_base=3.0)
    assert isinstance(nohost, CostAwarePolicy) and nohost.priority_base == 3.0
    assert not policy_by_name("lru-bytes").offload
    host = policy_by_name("lru-bytes:host")
    assert isinstance(host, LRUBytesPolicy) and host.offload
    assert policy_by_name("lru-count:host", max_models=2).offload
    with pytest.raises(InvalidSpec, match="suffix"):
        policy_by_name("cost:nohost")
    with pytest.raises(InvalidSpec, match="unknown eviction policy"):
        policy_by_name("lru:host")


def test_host_tier_suffix_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufn.scheduler.core import SchedulerConfig

    monkeypatch.setenv("GPUFN_EVICTION_POLICY", "cost:no-host")
    p = SchedulerConfig.from_env(None).policy()
    assert isinstance(p, CostAwarePolicy) and not p.offload
    monkeypatch.setenv("GPUFN_EVICTION_POLICY", "lru-bytes:host")
    p = SchedulerConfig.from_env(None).policy()
    assert isinstance(p, LRUBytesPolicy) and p.offload
