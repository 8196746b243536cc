"""This pass's open devices in the order single-device choice reads them, so choosing a
device costs the few devices that could beat the best one, not a ranking of all of them.

`rank_devices` orders devices by (type rank, expected finish, calls running, -free
memory, key), where expected finish = drain (what runs there, at this `now`) + this
function's run time measured on that device. Only the run time depends on the function,
so the index keeps, per device name (type), the open devices sorted by (drain, running,
-free, key) and `best` walks them: it stops at the first device whose drain plus the
function's smallest run time estimate is already later than the best finish found, and
when the function's estimate is the same everywhere it skips each run of equal drains
after its first usable device. The answer is the exact first device of `rank_devices`
(a unit test compares them after random load changes). A device that a dispatch changed
is moved (`update`): O(log n) to find, a memmove to shift.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection, Iterator

from gpufn.scheduler.nouns.records import Device, FunctionRecord, drain_seconds
from gpufn.scheduler.placement.device_fit import type_rank

# (drain, calls running, -free bytes, device key): the function-independent order
Entry = tuple[float, int, int, str]
_INF = float("inf")


def estimate_bounds(fn: FunctionRecord, cache: dict[str, tuple[object, float, bool]]) -> tuple[float, bool]:
    """(the smallest run time `fn.estimate` gives any device, whether it is the same for
    every device): a lower bound for the walk. Cached until the function's run times change."""
    rbd = fn.runtime_by_device
    ewma = fn.runtime_ewma
    stamp = (fn.calls, ewma, len(rbd))
    got = cache.get(fn.function_id)
    if got is not None and got[0] == stamp:
        return got[1], got[2]
    if ewma is None:  # nothing measured: every device's estimate is unknown (0)
        lo, uniform = min(0.0, min(rbd.values(), default=0.0)), not rbd
    else:
        lo = min(ewma, min(rbd.values(), default=ewma))
        uniform = lo == max(ewma, max(rbd.values(), default=ewma))
    cache[fn.function_id] = (stamp, lo, uniform)
    return lo, uniform


class OpenIndex:
    """The open devices of one placement pass at one `now`, per device name."""

    def __init__(self, devices: Collection[Device], now: float, drains: dict[str, float]) -> None:
        self.now = now
        self._drains = drains  # the pass's drain_seconds cache (shared with rank_devices)
        self._lists: dict[str, list[Entry]] = {}
        self._entry: dict[str, Entry] = {}
        self._dev: dict[str, Device] = {}
        for d in devices:
            e = self._make(d)
            self._lists.setdefault(d.info.name, []).append(e)
            self._entry[e[3]] = e
            self._dev[e[3]] = d
        for lst in self._lists.values():
            lst.sort()

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def _make(self, d: Device) -> Entry:
        drain = 0.0
        if d.running:
            got = self._drains.get(d.info.key)
            drain = self._drains[d.info.key] = drain_seconds(d, self.now) if got is None else got
        return (drain, len(d.running), -d.ledger.free, d.info.key)

    def update(self, d: Device, still_open: bool) -> None:
        """Move a device whose load changed (the caller dropped its cached drain); drop it
        when it can start nothing more in this pass."""
        key = d.info.key
        old = self._entry.pop(key, None)
        lst = self._lists.setdefault(d.info.name, [])
        if old is not None:
            del lst[bisect.bisect_left(lst, old)]
        if still_open:
            e = self._make(d)
            bisect.insort(lst, e)
            self._entry[key] = e
            self._dev[key] = d
        else:
            self._dev.pop(key, None)

    def _levels(self, types: tuple[str, ...]) -> list[list[list[Entry]]]:
        """The per-name lists grouped by type rank, best rank first."""
        if not types:
            return [list(self._lists.values())]
        by_rank: dict[int, list[list[Entry]]] = {}
        for name, lst in self._lists.items():
            rank = type_rank(types, name)
            if rank is not None and lst:
                by_rank.setdefault(rank, []).append(lst)
        return [by_rank[r] for r in sorted(by_rank)]

    def best(self, fn: FunctionRecord, types: tuple[str, ...], limit: int, memory: int,
             lo: float, uniform: bool, usable: Callable[[Device], bool] | None = None) -> Device | None:
        """The first device `rank_devices` would rank (with `memory` 0: no memory check)
        among those `usable` accepts, or None. `lo`, `uniform`: `estimate_bounds(fn)`."""
        code = fn.code_id
        for level in self._levels(types):
            found: tuple[float, int, int, str] | None = None
            for lst in level:
                got = self._best_in(lst, fn, code, limit, memory, lo, uniform, usable)
                if got is not None and (found is None or got < found):
                    found = got
            if found is not None:
                return self._dev[found[3]]
        return None

    def _best_in(self, lst: list[Entry], fn: FunctionRecord, code: str, limit: int,
                 memory: int, lo: float, uniform: bool,
                 usable: Callable[[Device], bool] | None) -> tuple[float, int, int, str] | None:
        best: tuple[float, int, int, str] | None = None
        best_drain = 0.0
        i, n = 0, len(lst)
        while i < n:
            drain, running, negfree, key = lst[i]
            if best is not None:
                if drain + lo > best[0]:
                    break  # nothing later can finish sooner
                if uniform and drain == best_drain:
                    # same drain and run time: the same finish, and the rest of the key is
                    # larger for every later entry of this drain
                    i = bisect.bisect_left(lst, (drain, _INF), i)
                    continue
            i += 1
            if memory and -negfree < memory:
                continue
            d = self._dev[key]
            if running and d.running_by_fn.get(code, 0) >= limit:
                continue
            if usable is not None and not usable(d):
                continue
            cand = (drain + (fn.estimate(key) or 0.0), running, negfree, key)
            if best is None or cand < best:
                best, best_drain = cand, drain
        return best

    def ranks(self, d: Device, types: tuple[str, ...], code: str, limit: int) -> bool:
        """Whether `rank_devices` (without a memory check) would rank this open device."""
        return (d.info.key in self._entry and (not types or type_rank(types, d.info.name) is not None)
                and not (d.running and d.running_by_fn.get(code, 0) >= limit))

    def by_drain(self, types: tuple[str, ...], code: str, limit: int,
                 usable: Callable[[Device], bool] | None = None) -> Iterator[tuple[float, Device]]:
        """Every device `rank_devices` would rank without a memory check, that `usable`
        accepts, as (drain, device) in ascending drain (whatever its type rank)."""
        lists = [lst for level in self._levels(types) for lst in level if lst]
        merged: Iterator[Entry] = iter(lists[0]) if len(lists) == 1 else heapq.merge(*lists)
        for drain, running, _, key in merged:
            d = self._dev[key]
            if running and d.running_by_fn.get(code, 0) >= limit:
                continue
            if usable is not None and not usable(d):
                continue
            yield drain, d

