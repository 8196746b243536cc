"""Model residency on one device: the states a shared model passes through and the
explicit table of legal transitions; an illegal move raises with the model's history."""

from __future__ import annotations

from enum import Enum


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


class IllegalTransition(RuntimeError):
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
    """Raise IllegalTransition unless old -> new is in the table."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(name, old, new, history)
