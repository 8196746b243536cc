"""Eviction policies: pure rules that say which idle model on a device to give up first.

The ledger asks a policy for each candidate's keep-value and takes victims lowest first;
policies hold no state of their own (the GDSF clock lives in the ledger).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from gpufn.exceptions import InvalidSpec
from gpufn.memory_pool.residency import ModelEntry

GiB = 2**30


class EvictionPolicy(ABC):
    """What a ledger needs from a policy.

    `bytes_aware=False` policies admit by model count only (`model_limit()`), ignoring
    bytes, as a baseline; `offload` says whether victims may be kept in host memory.
    """

    name: ClassVar[str] = ""
    bytes_aware: ClassVar[bool] = True
    offload: bool = True

    @abstractmethod
    def value(self, entry: ModelEntry) -> float:
        """How much keeping this model on the device is worth; the lowest goes first."""

    def model_limit(self) -> int | None:
        """At most this many models per device (None: no count limit)."""
        return None

    def inflate(self, clock: float, victim: ModelEntry) -> float:
        """The device's clock after `victim` is evicted or offloaded."""
        return clock

    def order(self, entries: Iterable[ModelEntry]) -> list[ModelEntry]:
        """Candidates in eviction order (ties: least recently used, then by name)."""
        return sorted(entries, key=lambda e: (self.value(e), e.last_used, e.name))


@dataclass(frozen=True)
class CostAwarePolicy(EvictionPolicy):
    """Greedy-Dual-Size-Frequency (Cherkasova 1998) weighted by priority.

        value(m) = L_m + F_m * C_m * base**P_m / S_m

    - `S_m`: the model's device bytes (measured once loaded), in GiB;
    - `C_m`: seconds a miss costs if evicted now: a fixed `miss_overhead` (the extra
      round trip, allocation and queueing every cold start pays, whatever the size)
      plus the measured host->device reload time if it may be offloaded (estimated as
      S/host_bandwidth until measured), else the measured loader time (estimated as
      load_overhead + S/load_bandwidth). The fixed part keeps the size term alive when
      reloads are copies (time proportional to size): small, popular models stay;
    - `F_m`: how many invocations have used it on this device (at least 1);
    - `P_m`: the highest priority of the functions using it (`base**P`, so +1 doubles);
    - `L_m`: the device clock when the model was last used. The clock starts at 0 and
      rises to the value of each model evicted or offloaded, so a model that has not
      been used for a while is eventually worth less than a fresh one (recency).

    The lowest value goes first: big, cheap to reload, rarely used, low priority, idle.
    """

    load_bandwidth: float = 1.0 * GiB
    load_overhead: float = 1.0
    miss_overhead: float = 0.25
    host_bandwidth: float = 8.0 * GiB
    priority_base: float = 2.0
    offload: bool = True

    name: ClassVar[str] = "cost"

    def reload_cost(self, entry: ModelEntry) -> float:
        """Seconds to bring `entry` back after losing it from the device."""
        size = max(entry.nbytes, 1)
        if self.offload and entry.offload_allowed:
            if entry.reload_seconds is not None:
                return self.miss_overhead + entry.reload_seconds
            return self.miss_overhead + size / self.host_bandwidth
        if entry.load_seconds is not None:
            return self.miss_overhead + entry.load_seconds
        return self.miss_overhead + self.load_overhead + size / self.load_bandwidth

    def value(self, entry: ModelEntry) -> float:
        size_gib = max(entry.nbytes, 1) / GiB
        weight = self.priority_base ** entry.priority
        return entry.clock + max(entry.uses, 1) * self.reload_cost(entry) * weight / size_gib

    def inflate(self, clock: float, victim: ModelEntry) -> float:
        return max(clock, self.value(victim))


@dataclass(frozen=True)
class LRUCountPolicy(EvictionPolicy):
    """Ray Serve model multiplexing as a baseline: at most `max_models` per device,
    least recently used evicted first, bytes ignored (so admission can over-commit
    device memory and the worker may then hit out-of-memory)."""

    max_models: int = 3
    offload: bool = False

    name: ClassVar[str] = "lru-count"
    bytes_aware: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.max_models < 1:
            raise InvalidSpec(f"lru-count max_models={self.max_models} must be at least 1")

    def value(self, entry: ModelEntry) -> float:
        return entry.last_used

    def model_limit(self) -> int | None:
        return self.max_models


@dataclass(frozen=True)
class LRUBytesPolicy(EvictionPolicy):
    """Plain LRU with byte-accurate admission: the least recently used idle models go
    first until the request fits, and a request is only admitted when it fits (never
    over-commits). The fair LRU baseline next to `cost`; no host tier unless asked."""

    offload: bool = False

    name: ClassVar[str] = "lru-bytes"

    def value(self, entry: ModelEntry) -> float:
        return entry.last_used


POLICIES: dict[str, type[EvictionPolicy]] = {
    CostAwarePolicy.name: CostAwarePolicy,
    LRUCountPolicy.name: LRUCountPolicy,
    LRUBytesPolicy.name: LRUBytesPolicy,
}
# `NAME:host` / `NAME:no-host` turn the host tier (offload to host memory) on or off
# whatever the policy's default, e.g. `cost:no-host` or `lru-bytes:host` (ablations).
HOST_SUFFIXES = {"host": True, "no-host": False}


def policy_by_name(name: str, **options: Any) -> EvictionPolicy:
    """A policy from config: `policy_by_name("lru-count", max_models=2)`,
    `policy_by_name("cost:no-host")`."""
    base, sep, suffix = name.partition(":")
    if sep:
        if suffix not in HOST_SUFFIXES:
            raise InvalidSpec(f"eviction policy {name!r}: the suffix must be one of "
                              f"{', '.join(':' + k for k in HOST_SUFFIXES)}")
        options = {**options, "offload": HOST_SUFFIXES[suffix]}
    cls = POLICIES.get(base)
    if cls is None:
        raise InvalidSpec(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)} "
                          f"(each optionally with {' or '.join(':' + k for k in HOST_SUFFIXES)})")
    try:
        return cls(**options)
    except TypeError as exc:
        raise InvalidSpec(f"eviction policy {name!r}: {exc}")
