"""Gang selection and reservation rules (pure: no processes, no torch)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest

from gpufn.memory_pool.probe import (
    TOPO_HOSTBRIDGE,
    TOPO_MULTIPLE,
    TOPO_NODE,
    TOPO_SINGLE,
    TOPO_SYSTEM,
    DeviceInfo,
    simulated_devices,
)
from gpufn.scheduler.placement.gang_choice import (
    TOPO_NETWORK,
    GangDistance,
    Reservation,
    can_backfill,
    choose_gang,
    gang_distance,
    reservation_for,
)

pytestmark = pytest.mark.timeout(30)

GiB = 1 << 30


def keys(devs: list[DeviceInfo] | None) -> list[str] | None:
    return None if devs is None else [d.key for d in devs]


def dev(
    index: int,
    *,
    node: str = "n0",
    nvlink: tuple[int, ...] = (),
    levels: dict[int, int] | None = None,
    numa: int = 0,
) -> DeviceInfo:
    return DeviceInfo(
        node=node, index=index, name="sim", uuid=f"U-{node}-{index}", memory_total=GiB,
        memory_free=GiB, numa_node=numa, nvlink_peers=nvlink, pcie_levels=levels or {},
    )


def mesh(levels: dict[tuple[int, int], int], n: int, **kw: object) -> list[DeviceInfo]:
    """n devices with symmetric pair levels (default TOPO_SYSTEM) and no NVLink."""
    out = []
    for i in range(n):
        lv = {j: levels.get((min(i, j), max(i, j)), TOPO_SYSTEM) for j in range(n) if j != i}
        out.append(dev(i, levels=lv, **kw))  # type: ignore[arg-type]
    return out


# --------------------------------------------------------------------------- choose_gang


def test_islands_pick_one_island() -> None:
    devs = simulated_devices("n0", 8, GiB, islands=2)  # {0..3}, {4..7}
    assert keys(choose_gang(devs, 4)) == ["n0:0", "n0:1", "n0:2", "n0:3"]
    # with 0 busy, the only whole island left is {4..7}
    assert keys(choose_gang(devs[1:], 4)) == ["n0:4", "n0:5", "n0:6", "n0:7"]
    # pairs stay inside an island even when that means skipping lower indices
    free = [devs[i] for i in (0, 4, 5, 7)]
    assert keys(choose_gang(free, 2)) == ["n0:4", "n0:5"]


def test_nvlink_set_preferred_over_mixed() -> None:
    devs = simulated_devices("n0", 8, GiB, islands=2)
    free = [devs[i] for i in (0, 1, 4, 5, 6)]
    # {0,1,4} would have the lowest indices, but {4,5,6} is all NVLink
    got = choose_gang(free, 3)
    assert keys(got) == ["n0:4", "n0:5", "n0:6"]
    assert got is not None and gang_distance(got).not_all_nvlink == 0
    mixed = gang_distance([devs[0], devs[1], devs[4]])
    assert mixed.not_all_nvlink == 1 and mixed > gang_distance(got)


def test_nvlink_beats_a_closer_pcie_level() -> None:
    # 0-1: same PCIe switch, no NVLink; 2-3: NVLink across the host bridge
    devs = [
        dev(0, levels={1: TOPO_SINGLE}),
        dev(1, levels={0: TOPO_SINGLE}),
        dev(2, nvlink=(3,), levels={3: TOPO_HOSTBRIDGE}),
        dev(3, nvlink=(2,), levels={2: TOPO_HOSTBRIDGE}),
    ]
    assert keys(choose_gang(devs, 2)) == ["n0:2", "n0:3"]


def test_nvlink_counts_in_either_direction() -> None:
    devs = [dev(0, nvlink=(1,)), dev(1), dev(2), dev(3)]
    assert keys(choose_gang(devs, 2)) == ["n0:0", "n0:1"]


def test_pcie_level_tiebreak() -> None:
    # no NVLink anywhere: {1,2} share a switch, {0,3} only the host bridge
    devs = mesh({(0, 3): TOPO_HOSTBRIDGE, (1, 2): TOPO_SINGLE, (0, 1): TOPO_NODE}, 4)
    assert keys(choose_gang(devs, 2)) == ["n0:1", "n0:2"]
    # worst pair decides for larger gangs: {0,1,2} has worst NODE, anything with 3 SYSTEM
    got = choose_gang(devs, 3)
    assert keys(got) == ["n0:0", "n0:1", "n0:2"]
    assert got is not None and gang_distance(got).worst_level == TOPO_SYSTEM  # (0,2) missing


def test_pcie_level_uses_the_closer_of_both_views() -> None:
    a = dev(0, levels={1: TOPO_MULTIPLE})
    b = dev(1, levels={})  # one side has no entry
    assert gang_distance([a, b]).worst_level == TOPO_MULTIPLE


def test_numa_tiebreak() -> None:
    # all pairs at the same PCIe level, no NVLink; 2 and 3 share NUMA node 1
    lv = {(i, j): TOPO_NODE for i in range(4) for j in range(i + 1, 4)}
    devs = mesh(lv, 4)
    devs = [replace(d, numa_node=numa) for d, numa in zip(devs, (0, 1, 2, 2), strict=True)]
    assert keys(choose_gang(devs, 2)) == ["n0:2", "n0:3"]
    assert gang_distance([devs[2], devs[3]]).numa_nodes == 1
    assert gang_distance([devs[0], devs[1]]).numa_nodes == 2


def test_ties_break_to_lowest_indices() -> None:
    devs = simulated_devices("n0", 4, GiB)  # one island: all equal
    assert keys(choose_gang(devs, 2)) == ["n0:0", "n0:1"]
    assert keys(choose_gang(list(reversed(devs)), 3)) == ["n0:0", "n0:1", "n0:2"]


def test_same_node_first_across_nodes() -> None:
    a = simulated_devices("a", 4, GiB)
    b = simulated_devices("b", 4, GiB)
    # node a has 2 free, node b has 3: a 3-gang lives on b alone
    free = [a[0], a[1], b[1], b[2], b[3]]
    assert keys(choose_gang(free, 3)) == ["b:1", "b:2", "b:3"]
    # two nodes tie: the closer set wins, then the lower node name
    assert keys(choose_gang(a + b, 2)) == ["a:0", "a:1"]


def test_spanning_nodes_only_when_needed() -> None:
    a = simulated_devices("a", 4, GiB)
    b = simulated_devices("b", 4, GiB)
    c = simulated_devices("c", 4, GiB)
    free = [a[0], a[1], b[0], b[1], b[2], c[3]]
    got = choose_gang(free, 4)
    # fewest nodes: all of b's three plus one of a's
    assert keys(got) == ["a:0", "b:0", "b:1", "b:2"]
    assert got is not None
    d = gang_distance(got)
    assert d.nodes == 2 and d.worst_level == TOPO_NETWORK and d.not_all_nvlink == 1


def test_warm_gang_preferred_in_its_order() -> None:
    devs = simulated_devices("n0", 8, GiB, islands=2)
    warm = ["n0:6", "n0:4", "n0:5", "n0:7"]
    assert keys(choose_gang(devs, 4, prefer=warm)) == warm
    # even a worse set is kept warm (no group setup beats a better topology)
    odd = ["n0:3", "n0:4"]
    assert keys(choose_gang(devs, 2, prefer=odd)) == odd
    # one of them busy: normal choice
    free = [d for d in devs if d.key != "n0:5"]
    assert keys(choose_gang(free, 4, prefer=warm)) == ["n0:0", "n0:1", "n0:2", "n0:3"]
    # a stale preference of another size, or with duplicates, is ignored
    assert keys(choose_gang(devs, 2, prefer=warm)) == ["n0:0", "n0:1"]
    assert keys(choose_gang(devs, 2, prefer=["n0:6", "n0:6"])) == ["n0:0", "n0:1"]


def test_not_enough_devices() -> None:
    devs = simulated_devices("n0", 3, GiB)
    assert choose_gang(devs, 4) is None
    assert choose_gang([], 1) is None
    # duplicates do not count twice
    assert choose_gang([devs[0], devs[0], devs[1]], 3) is None
    with pytest.raises(ValueError):
        choose_gang(devs, 0)


def test_never_duplicates() -> None:
    devs = simulated_devices("n0", 4, GiB, islands=2)
    got = choose_gang(devs + devs + [devs[1]], 4)
    assert keys(got) == ["n0:0", "n0:1", "n0:2", "n0:3"]
    for count in range(1, 5):
        g = choose_gang(devs * 3, count)
        assert g is not None and len({d.key for d in g}) == count


def test_single_device_gang() -> None:
    devs = simulated_devices("n0", 4, GiB)
    assert keys(choose_gang(devs[2:], 1)) == ["n0:2"]
    assert gang_distance(devs[:1]) == GangDistance(1, 0, 0, 1, 0, 0)


def test_big_nodes_search_greedily_and_fast() -> None:
    # 16 devices in four NVLink islands of four: the greedy path must find an island
    devs = simulated_devices("n0", 16, GiB, islands=4)
    free = [d for d in devs if d.index not in (0, 5, 10)]  # only island {12..15} is whole
    t0 = time.perf_counter()
    got = choose_gang(free, 4)
    eight = choose_gang(devs, 8)
    took = time.perf_counter() - t0
    assert keys(got) == ["n0:12", "n0:13", "n0:14", "n0:15"]
    assert eight is not None and gang_distance(eight).numa_nodes == 2  # two whole islands
    assert took < 1.0


def test_eight_gpu_nodes_are_fast() -> None:
    nodes = [simulated_devices(f"n{i}", 8, GiB, islands=2) for i in range(4)]
    devs = [d for n in nodes for d in n]
    t0 = time.perf_counter()
    for count in range(1, 9):
        assert choose_gang(devs, count) is not None
    assert choose_gang(devs, 20) is not None  # spans three nodes
    assert time.perf_counter() - t0 < 1.0


# --------------------------------------------------------------------------- reservation


def test_reservation_picks_soonest_draining() -> None:
    devs = simulated_devices("n0", 4, GiB)
    drain = {"n0:0": 30.0, "n0:1": 5.0, "n0:2": 0.0, "n0:3": 60.0}
    r = reservation_for(2, devs, drain)
    assert r == Reservation(("n0:1", "n0:2"), 5.0, gang_distance([devs[1], devs[2]]))
    r3 = reservation_for(3, devs, drain)
    assert r3 is not None and r3.devices == ("n0:0", "n0:1", "n0:2") and r3.start_eta == 30.0


def test_reservation_prefers_close_sets_at_the_same_time() -> None:
    devs = simulated_devices("n0", 8, GiB, islands=2)
    # 0 and 4 free now; 1 and 5 drain at 10 s, the rest much later
    drain = {k: 100.0 for k in (d.key for d in devs)}
    drain.update({"n0:0": 0.0, "n0:4": 0.0, "n0:1": 10.0, "n0:5": 10.0})
    r = reservation_for(2, devs, drain)
    # {0,4} could start now but crosses islands; it still wins (soonest first) ...
    assert r is not None and r.devices == ("n0:0", "n0:4") and r.start_eta == 0.0
    # ... while at 10 s the closest pair among the ready ones is an island pair
    drain["n0:4"] = 10.0
    r = reservation_for(2, devs, drain)
    assert r is not None and r.devices == ("n0:0", "n0:1") and r.start_eta == 10.0
    assert r.distance.not_all_nvlink == 0


def test_reservation_warm_gang_and_unknown_drains() -> None:
    devs = simulated_devices("n0", 4, GiB)
    drain = {"n0:0": 0.0, "n0:1": 0.0, "n0:2": 0.0, "n0:3": 0.0}
    r = reservation_for(2, devs, drain, prefer=["n0:3", "n0:2"])
    assert r is not None and r.devices == ("n0:3", "n0:2")
    unknown = {"n0:0": math.inf, "n0:1": math.inf, "n0:2": 3.0}  # n0:3 missing: free now
    r = reservation_for(2, devs, unknown)
    assert r is not None and r.devices == ("n0:2", "n0:3") and r.start_eta == 3.0
    r = reservation_for(3, devs, unknown)
    assert r is not None and math.isinf(r.start_eta)
    assert reservation_for(5, devs, drain) is None


def test_can_backfill() -> None:
    assert can_backfill(2.0, 10.0)
    assert not can_backfill(10.0, 10.0)  # would finish exactly when the gang could start
    assert not can_backfill(12.0, 10.0)
    assert not can_backfill(None, 10.0)  # unknown runtime never backfills
    assert not can_backfill(math.inf, 10.0)
    assert not can_backfill(-1.0, 10.0)
    assert not can_backfill(0.5, 0.0)  # the gang can start now
    assert can_backfill(8.0, 10.0, margin_s=1.0)
    assert not can_backfill(9.5, 10.0, margin_s=1.0)
    assert not can_backfill(1.0, math.inf)  # gang start unknown: keep the devices for it
