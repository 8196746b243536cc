"""Gang selection: which N devices run one multi-GPU call, chosen close together.

Pure functions over `DeviceInfo` (no torch, no I/O, no clock): `choose_gang` picks the
devices, `gang_distance` scores a set, and `reservation_for`/`can_backfill` are the
anti-starvation rules the scheduler core applies to a gang at the head of its queue.

Closeness, most important first (smaller is better in every field of `GangDistance`):

1. nodes spanned (a gang crosses nodes only when no single node has `count` free);
2. whether every pair is NVLink-connected (`nvlink_peers`, either direction counts);
3. the worst pair's PCIe common-ancestor level (`pcie_levels`, NVML TOPO_* values;
   a missing entry means TOPO_SYSTEM, a pair on different nodes is `TOPO_NETWORK`);
4. the number of NUMA nodes touched;
5. then, finer: pairs without NVLink, and the sum of pair levels.

Ties are broken by the lowest (node, index) list, so the choice is deterministic.

Search: within one node, every `count`-subset of its free devices is scored when there
are at most `EXHAUSTIVE_LIMIT` subsets (C(8, 4) = 70, so any 8-GPU host is searched
exhaustively). Beyond that (16+ devices per node) a greedy search runs instead: from
each device as a seed, repeatedly add the device that keeps the set's distance smallest;
the best of those seeds wins. Greedy finds whole NVLink islands and PCIe switches,
which is what matters, in O(n^2 * count^2) pair checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, NamedTuple

from gpufn.memory_pool.probe import TOPO_SYSTEM, DeviceInfo

# A pair of devices on different nodes: farther than anything inside one host.
TOPO_NETWORK = 60

# Above this many `count`-subsets of one node's free devices, search greedily.
EXHAUSTIVE_LIMIT = 1000


class GangDistance(NamedTuple):
    """How far apart a set of devices is; compare as a tuple, smaller is closer."""

    nodes: int  # distinct nodes spanned
    not_all_nvlink: int  # 0 if every pair is NVLink-connected, else 1
    worst_level: int  # worst pair's common-ancestor level (TOPO_*, TOPO_NETWORK)
    numa_nodes: int  # distinct (node, NUMA node) pairs touched
    non_nvlink_pairs: int  # pairs without NVLink
    level_sum: int  # sum of pair levels

    def describe(self) -> str:
        link = "all NVLink" if not self.not_all_nvlink else f"{self.non_nvlink_pairs} non-NVLink pairs"
        return (
            f"{self.nodes} node(s), {link}, worst level {self.worst_level}, "
            f"{self.numa_nodes} NUMA node(s)"
        )


def _nvlinked(a: DeviceInfo, b: DeviceInfo) -> bool:
    return a.node == b.node and (b.index in a.nvlink_peers or a.index in b.nvlink_peers)


def _level(a: DeviceInfo, b: DeviceInfo) -> int:
    if a.node != b.node:
        return TOPO_NETWORK
    return min(a.pcie_levels.get(b.index, TOPO_SYSTEM), b.pcie_levels.get(a.index, TOPO_SYSTEM))


def gang_distance(devs: Sequence[DeviceInfo]) -> GangDistance:
    """The closeness score of a set of devices (see the module docstring)."""
    non_nv = 0
    worst = 0
    total = 0
    for a, b in combinations(devs, 2):
        if not _nvlinked(a, b):
            non_nv += 1
        lvl = _level(a, b)
        worst = max(worst, lvl)
        total += lvl
    return GangDistance(
        nodes=len({d.node for d in devs}),
        not_all_nvlink=1 if non_nv else 0,
        worst_level=worst,
        numa_nodes=len({(d.node, d.numa_node) for d in devs}),
        non_nvlink_pairs=non_nv,
        level_sum=total,
    )


def _order(d: DeviceInfo) -> tuple[str, int]:
    return (d.node, d.index)


def _key(devs: Sequence[DeviceInfo]) -> tuple[GangDistance, list[tuple[str, int]]]:
    return (gang_distance(devs), [_order(d) for d in devs])


# Results of `_best_on_node` by the identities of its inputs: a node's free devices change
# only when a call starts or ends there, so with many hosts most nodes answer from here
# (a gang's choice costs O(hosts) lookups, not O(hosts) searches). The inputs are kept
# with their answer, so an id is never reused while its entry lives.
_NODE_MEMO: dict[tuple[int, ...], tuple[tuple[DeviceInfo, ...], list[DeviceInfo] | None, Any]] = {}
_NODE_MEMO_MAX = 8192


def _best_on_node(devs: Sequence[DeviceInfo], count: int) -> list[DeviceInfo] | None:
    """The closest `count` devices among one node's (sorted, distinct) devices."""
    return _best_with_key(devs, count)[0]


def _best_with_key(devs: Sequence[DeviceInfo], count: int) -> tuple[list[DeviceInfo] | None, Any]:
    """`_best_on_node` and the `_key` of its answer, remembered (see `_NODE_MEMO`)."""
    memo = (count, *map(id, devs))
    hit = _NODE_MEMO.get(memo)
    if hit is None or not all(a is b for a, b in zip(hit[0], devs, strict=True)):
        best = _search_node(devs, count)
        if len(_NODE_MEMO) >= _NODE_MEMO_MAX:
            _NODE_MEMO.clear()
        hit = _NODE_MEMO[memo] = (tuple(devs), best, _key(best) if best is not None else None)
    return (list(hit[1]) if hit[1] is not None else None), hit[2]


def _search_node(devs: Sequence[DeviceInfo], count: int) -> list[DeviceInfo] | None:
    n = len(devs)
    if count > n:
        return None
    if count == n:
        return list(devs)
    if math.comb(n, count) <= EXHAUSTIVE_LIMIT:
        best = min(combinations(devs, count), key=_key)
        return list(best)
    return _greedy(devs, count)


def _greedy(devs: Sequence[DeviceInfo], count: int) -> list[DeviceInfo]:
    best: list[DeviceInfo] | None = None
    best_key = None
    for seed in devs:
        chosen = [seed]
        rest = [d for d in devs if d is not seed]
        while len(chosen) < count:
            nxt = min(rest, key=lambda d: _key(sorted([*chosen, d], key=_order)))
            chosen.append(nxt)
            rest.remove(nxt)
        chosen.sort(key=_order)
        k = _key(chosen)
        if best_key is None or k < best_key:
            best, best_key = chosen, k
    assert best is not None
    return best


def _distinct(candidates: Iterable[DeviceInfo]) -> list[DeviceInfo]:
    seen: dict[str, DeviceInfo] = {}
    for d in candidates:
        seen.setdefault(d.key, d)
    return sorted(seen.values(), key=_order)


def choose_gang(
    candidates: Sequence[DeviceInfo], count: int, *, prefer: Sequence[str] = ()
) -> list[DeviceInfo] | None:
    """Pick `count` distinct devices among `candidates` (all free now), closest first.

    Returns them in rank order, sorted by (node, index); or exactly the warm gang `prefer`
    (device keys, in its rank order) when all of its devices are among the candidates.
    None when fewer than `count` distinct devices are free.
    """
    if count < 1:
        raise ValueError(f"a gang needs count >= 1, got {count}")
    devs = _distinct(candidates)
    if len(devs) < count:
        return None
    by_key = {d.key: d for d in devs}
    warm = len(prefer) == count and len(set(prefer)) == count
    if warm and all(k in by_key for k in prefer):
        return [by_key[k] for k in prefer]

    nodes: dict[str, list[DeviceInfo]] = {}
    for d in devs:
        nodes.setdefault(d.node, []).append(d)

    # One node can hold the whole gang: the closest set over all such nodes.
    options = [(k, g) for ds in nodes.values() for g, k in (_best_with_key(ds, count),)
               if g is not None]
    if options:
        return min(options, key=lambda o: o[0])[1]

    # Span nodes: as few as possible (largest free counts first), closest set on each.
    order = sorted(nodes, key=lambda n: (-len(nodes[n]), n))
    gang: list[DeviceInfo] = []
    for n in order:
        take = min(count - len(gang), len(nodes[n]))
        part = _best_on_node(nodes[n], take)
        assert part is not None
        gang.extend(part)
        if len(gang) == count:
            break
    return sorted(gang, key=_order)


# --------------------------------------------------------------------------- reservation


@dataclass(frozen=True, slots=True)
class Reservation:
    """Devices held back for the gang at the head of a queue, and when it can start.

    `start_eta` is seconds from now until the last of `devices` drains (0: all free now).
    The scheduler keeps other work off these devices except backfill that fits before
    `start_eta` (see `can_backfill`).
    """

    devices: tuple[str, ...]  # device keys, rank order
    start_eta: float
    distance: GangDistance


def reservation_for(
    head_count: int,
    devices: Sequence[DeviceInfo],
    drain_s: Mapping[str, float],
    *,
    prefer: Sequence[str] = (),
) -> Reservation | None:
    """Which devices to reserve for a head-of-queue gang of `head_count` ranks.

    `devices` are those that could run one rank of it (type, capacity, healthy), busy or
    not; `drain_s` maps a device key to the estimated seconds until its running work
    finishes (missing or <= 0: free now; math.inf: unknown, e.g. no runtime estimate yet).
    The reservation is the set that can start soonest, and among the sets starting at
    that time the closest one (warm gang `prefer` first, as in `choose_gang`). Sets that
    include a device of unknown drain time are chosen only when nothing else can form.
    None when fewer than `head_count` devices exist.
    """
    devs = _distinct(devices)
    if len(devs) < head_count:
        return None
    eta = {d.key: max(0.0, float(drain_s.get(d.key, 0.0))) for d in devs}
    for t in sorted(set(eta.values())):
        ready = [d for d in devs if eta[d.key] <= t]
        if len(ready) < head_count:
            continue
        gang = choose_gang(ready, head_count, prefer=prefer)
        if gang is not None:
            return Reservation(
                devices=tuple(d.key for d in gang),
                start_eta=max(eta[d.key] for d in gang),
                distance=gang_distance(gang),
            )
    return None  # unreachable: the last threshold admits every device


def can_backfill(
    expected_runtime: float | None, reserved_start_eta: float, *, margin_s: float = 0.0
) -> bool:
    """May a single-device call run on a reserved device without delaying the gang?

    True only when its expected runtime is known and it would finish (with `margin_s` to
    spare) before the gang could start anyway. An unknown runtime never backfills, and
    nothing backfills when the gang's start is unknown (math.inf): the reservation exists
    to stop the gang from starving, so doubt goes to the gang.
    """
    if expected_runtime is None or not math.isfinite(expected_runtime) or expected_runtime < 0:
        return False
    if not (0 < reserved_start_eta < math.inf):
        return False
    return expected_runtime + margin_s < reserved_start_eta
