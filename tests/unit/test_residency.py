"""Model residency: the transition table is exactly what the design says, and an illegal
move raises with the model's history."""

from __future__ import annotations

import itertools

import pytest

from gpufn.memory_pool.residency import (
    TRANSITIONS,
    IllegalResidency,
    ModelEntry,
    Residency,
    check_transition,
)

R = Residency

LEGAL = {
    (R.ABSENT, R.LOADING),
    (R.LOADING, R.RESIDENT),
    (R.LOADING, R.ABSENT),
    (R.RESIDENT, R.OFFLOADING),
    (R.RESIDENT, R.EVICTING),
    (R.OFFLOADING, R.OFFLOADED),
    (R.OFFLOADING, R.ABSENT),
    (R.OFFLOADED, R.LOADING),
    (R.OFFLOADED, R.ABSENT),
    (R.EVICTING, R.ABSENT),
}


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(Residency)
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL


@pytest.mark.parametrize(("old", "new"), list(itertools.product(Residency, Residency)))
def test_each_pair_is_legal_exactly_when_in_table(old: Residency, new: Residency) -> None:
    if (old, new) in LEGAL:
        check_transition("m", old, new, [])
    else:
        with pytest.raises(IllegalResidency):
            check_transition("m", old, new, [])


def test_full_lifecycle_with_history() -> None:
    e = ModelEntry("llama", 10)
    path = [R.LOADING, R.RESIDENT, R.OFFLOADING, R.OFFLOADED, R.LOADING, R.RESIDENT,
            R.EVICTING, R.ABSENT]
    for t, state in enumerate(path, start=1):
        e.to(state, float(t))
    assert e.state is R.ABSENT
    assert e.history == [(R.ABSENT, 0.0)] + [(s, float(t)) for t, s in enumerate(path, 1)]


def test_illegal_transition_carries_history() -> None:
    e = ModelEntry("bert", 10)
    e.to(R.LOADING, 1.0)
    e.to(R.RESIDENT, 2.0)
    with pytest.raises(IllegalResidency) as info:
        e.to(R.OFFLOADED, 3.0)  # must pass through OFFLOADING
    err = info.value
    assert (err.old, err.new, err.name) == (R.RESIDENT, R.OFFLOADED, "bert")
    assert err.history[:3] == [(R.ABSENT, 0.0), (R.LOADING, 1.0), (R.RESIDENT, 2.0)]
    assert "resident -> offloaded" in str(err) and "loading@1" in str(err)
    assert e.state is R.RESIDENT and len(e.history) == 3  # unchanged by the failed move


def test_forced_reset_bypasses_table() -> None:
    e = ModelEntry("m", 1)
    e.to(R.LOADING, 1.0)
    e.to(R.RESIDENT, 2.0)
    with pytest.raises(IllegalResidency):
        e.to(R.ABSENT, 3.0)
    e.to(R.ABSENT, 3.0, force=True)
    assert e.state is R.ABSENT and e.history[-1] == (R.ABSENT, 3.0)


def test_history_is_bounded() -> None:
    e = ModelEntry("m", 1)
    for i in range(200):
        e.to(R.LOADING if e.state is R.ABSENT else R.ABSENT, float(i))
    assert len(e.history) == 64 and e.history[-1][1] == 199.0


def test_on_device_states() -> None:
    assert {s for s in Residency if s.on_device} == {
        R.LOADING, R.RESIDENT, R.OFFLOADING, R.EVICTING}
