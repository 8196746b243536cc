"""Fresh globals without re-pickling: a function's code is pickled again only when the
fingerprint of its code and the globals it reads changed (gpufn/wire/fingerprint.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpufn
from gpufn.wire import serialization as ser
from gpufn.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)

SEEN = [1, 2]
TABLE = {"a": 1}
K = 1
WEIGHTS = torch.zeros(4)


class Opaque:
    def __init__(self) -> None:
        self.value = 1


OBJ = Opaque()


@pytest.fixture
def pickles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions whose code was pickled, in order."""
    seen: list[str] = []
    real = ser.dump_code

    def counting(fn: Any, name: str) -> tuple[str, list[Any]]:
        seen.append(name)
        return real(fn, name)

    monkeypatch.setattr(ser, "dump_code", counting)
    return seen


def test_unchanged_code_is_not_pickled_again(pickles: list[str]) -> None:
    @gpufn.gpu
    def reads() -> Any:
        return SEEN, TABLE, K

    first = reads.register_message()
    for _ in range(5):
        assert reads.register_message() is first
    assert len(pickles) == 1


def test_a_global_list_mutated_in_place_is_pickled_again(pickles: list[str]) -> None:
    @gpufn.gpu
    def reads() -> list[int]:
        return SEEN

    before = reads.register_message().code_id
    SEEN.append(3)
    try:
        after = reads.register_message()
        assert after.code_id != before and len(pickles) == 2
        fn, _, _ = ser.loads(after.frames)
        assert fn() == [1, 2, 3]  # what the worker would run sees the mutation
        SEEN[0] = 7
        assert reads.register_message().code_id != after.code_id
    finally:
        SEEN[:] = [1, 2]


def test_rebound_globals_dicts_tensors_and_helpers_are_seen(pickles: list[str]) -> None:
    global K

    def helper() -> int:
        return K + TABLE["a"]

    @gpufn.gpu
    def outer() -> tuple[int, float]:
        return helper(), float(WEIGHTS.sum())

    ids = [outer.register_message().code_id]
    old = K
    try:
        K = True  # equal to 1, but not the same value
        ids.append(outer.register_message().code_id)
        TABLE["a"] = 2  # read through a helper pickled by value
        ids.append(outer.register_message().code_id)
        WEIGHTS.add_(1)  # a tensor changed in place: its version moves
        ids.append(outer.register_message().code_id)
    finally:
        K, TABLE["a"] = old, 1
        WEIGHTS.zero_()
    assert len(set(ids)) == 4 and len(pickles) == 4
    fn, _, _ = ser.loads(outer.register_message().frames)
    assert fn() == (2, 0.0)


def test_what_cannot_be_fingerprinted_is_pickled_every_time(pickles: list[str]) -> None:
    @gpufn.gpu
    def reads_object() -> int:
        return OBJ.value

    assert fingerprint(reads_object._fn) is None
    reads_object.register_message()
    OBJ.value = 2
    try:
        fn, _, _ = ser.loads(reads_object.register_message().frames)
        assert fn() == 2 and len(pickles) == 2
    finally:
        OBJ.value = 1


def test_closures_defaults_and_options_are_part_of_the_key(pickles: list[str]) -> None:
    box = [1]

    @gpufn.gpu
    def closes(x: list[int] = [0]) -> int:  # noqa: B006 - the default is the point
        return box[0] + x[0]

    a = closes.register_message().code_id
    box[0] = 2
    b = closes.register_message().code_id
    closes._fn.__defaults__[0][0] = 5  # type: ignore[index]
    c = closes.register_message().code_id
    assert len({a, b, c}) == 3
    fast = closes.with_options(autocast="bf16")
    assert fast.register_message().code_id not in {a, b, c}
    assert len(pickles) == 4
