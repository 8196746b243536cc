"""Model residency on one device: the states a shared model passes through, the explicit
table of legal transitions (an illegal move raises with the model's history), and
`ModelEntry`, the record of one model on one device that ledgers keep and policies rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

HISTORY_LIMIT = 64  # residency changes kept per model (for error messages)


class Residency(Enum):
    """Where one model's weights are, as the scheduler's ledger sees it."""

    ABSENT = "absent"          # not on the device, no host copy
    LOADING = "loading"        # the loader (or a reload from host) is running
    RESIDENT = "resident"      # on the device, usable
    OFFLOADING = "offloading"  # being copied to host memory; device bytes held until done
    OFFLOADED = "offloaded"    # only a host copy exists
    EVICTING = "evicting"      # being dropped; device bytes held until done

    @property
    def on_device(self) -> bool:
        """Whether the model occupies device memory in this state."""
        return self in _ON_DEVICE


_ON_DEVICE = frozenset(
    {Residency.LOADING, Residency.RESIDENT, Residency.OFFLOADING, Residency.EVICTING}
)

# state -> states it may move to. Worker restarts bypass this (see ModelEntry.to(force=True)).
TRANSITIONS: dict[Residency, frozenset[Residency]] = {
    Residency.ABSENT: frozenset({Residency.LOADING}),
    Residency.LOADING: frozenset({Residency.RESIDENT, Residency.ABSENT}),  # done / failed
    Residency.RESIDENT: frozenset({Residency.OFFLOADING, Residency.EVICTING}),
    # An offload that fails on the worker loses the model (the worker drops it).
    Residency.OFFLOADING: frozenset({Residency.OFFLOADED, Residency.ABSENT}),
    # Back to the device from host, or the host copy is dropped (host budget).
    Residency.OFFLOADED: frozenset({Residency.LOADING, Residency.ABSENT}),
    Residency.EVICTING: frozenset({Residency.ABSENT}),
}


class IllegalResidency(RuntimeError):
    """A model was asked to move between two states the table does not connect."""

    def __init__(self, name: str, old: Residency, new: Residency,
                 history: list[tuple[Residency, float]]) -> None:
        trail = " -> ".join(f"{s.value}@{t:g}" for s, t in history)
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old])) or "nothing"
        super().__init__(
            f"model {name!r}: illegal residency transition {old.value} -> {new.value} "
            f"(from {old.value} it may go to: {allowed}); history: {trail}"
        )
        self.name = name
        self.old = old
        self.new = new
        self.history = list(history)


def check_transition(name: str, old: Residency, new: Residency,
                     history: list[tuple[Residency, float]]) -> None:
    """Raise IllegalResidency unless old -> new is in the table."""
    if new not in TRANSITIONS[old]:
        raise IllegalResidency(name, old, new, history)


@dataclass(eq=False)
class ModelEntry:
    """One model on one device: where it is, how big, how costly, how used."""

    name: str
    nbytes: int  # measured once loaded, else the estimate
    state: Residency = Residency.ABSENT
    measured: bool = False
    load_seconds: float | None = None  # the loader's measured time
    reload_seconds: float | None = None  # the last host -> device restore time
    pinned: bool = False
    offload_allowed: bool = True
    in_use: int = 0  # running (or placed) invocations holding it
    last_used: float = 0.0
    uses: int = 0  # invocations that have used it here (frequency)
    priority: int = 0  # highest priority of any function that used it here
    users: set[str] = field(default_factory=set)
    clock: float = 0.0  # the ledger's eviction clock when last used (GDSF "L")
    from_host: bool = False  # while LOADING: a restore from host, not the loader
    # A sharded model's shard: every device of its gang in rank order (this one included).
    # The shards are one unit: they leave together (see `fit_group`).
    shards: tuple[str, ...] = ()
    history: list[tuple[Residency, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.history:
            self.history.append((self.state, 0.0))

    def to(self, state: Residency, now: float, *, force: bool = False) -> None:
        """Move to `state`; raise IllegalResidency (with the history) unless legal.

        `force` skips the table: only for a worker restart, where everything is gone.
        """
        if not force:
            check_transition(self.name, self.state, state, [*self.history, (state, now)])
        self.state = state
        self.history.append((state, now))
        del self.history[:-HISTORY_LIMIT]

    @property
    def idle(self) -> bool:
        """Resident and held by no invocation."""
        return self.state is Residency.RESIDENT and self.in_use == 0
