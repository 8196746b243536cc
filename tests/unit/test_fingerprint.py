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


# --- the pieces, each seen surviving a mutant cosmic-ray picked (scripts/mutants.py) ---

from gpufn.wire import fingerprint as fp_mod  # noqa: E402


def _leaves(n: int) -> Any:
    """A function reading one global tuple of `n` ints: 1 + n values walked."""
    glob: dict[str, Any] = {"BIG": tuple(range(n))}
    exec("def reads():\n    return BIG\n", glob)
    return glob["reads"]


def test_the_walk_stops_after_exactly_its_budget() -> None:
    assert fp_mod.BUDGET == 2000
    assert fingerprint(_leaves(fp_mod.BUDGET - 1)) is not None  # 2000 values walked
    assert fingerprint(_leaves(fp_mod.BUDGET)) is None  # 2001


def test_the_by_reference_rule_is_remembered_per_object_and_generation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []

    def by_reference(obj: Any) -> bool:
        asked.append(obj)
        return True

    monkeypatch.setattr(fp_mod, "_by_reference", by_reference)
    monkeypatch.setattr(fp_mod, "_REF_CACHE", {})

    class A:
        pass

    assert fp_mod._pickled_by_reference(A) is True
    assert fp_mod._pickled_by_reference(A) is True
    assert asked == [A]  # the second answer came from the cache
    monkeypatch.setattr(fp_mod.byvalue, "_generation", fp_mod.byvalue.generation() + 1)
    assert fp_mod._pickled_by_reference(A) is True
    assert asked == [A, A]  # the by-value set changed: asked again


def test_the_by_reference_cache_is_cleared_only_past_4096(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp_mod, "_by_reference", lambda obj: True)
    cache: dict[int, Any] = {}
    monkeypatch.setattr(fp_mod, "_REF_CACHE", cache)
    objs = [object() for _ in range(4098)]
    for o in objs[:4097]:
        fp_mod._pickled_by_reference(o)
    assert len(cache) == 4097  # not cleared at 4096
    fp_mod._pickled_by_reference(objs[4097])
    assert len(cache) == 1  # cleared once past it


def test_a_complex_zero_rebound_to_minus_zero_changes_the_key() -> None:
    glob: dict[str, Any] = {"C": complex(0.0, 0.0), "F": float("nan")}
    exec("def reads():\n    return C, F\n", glob)
    a = fingerprint(glob["reads"])
    glob["C"] = complex(-0.0, 0.0)  # equal to 0j, but not the same value
    b = fingerprint(glob["reads"])
    assert a is not None and b is not None and a.key != b.key
    glob["F"] = float("nan")  # another NaN object: the same value, the same key
    glob["C"] = complex(-0.0, 0.0)
    c = fingerprint(glob["reads"])
    assert c is not None and c.key == b.key


def test_a_global_tensor_is_fingerprinted_by_identity_and_version() -> None:
    glob: dict[str, Any] = {"W": torch.zeros(2)}
    exec("def reads():\n    return W\n", glob)
    first = fingerprint(glob["reads"])
    assert first is not None
    glob["W"] = torch.ones(2)  # a new tensor at the same version
    second = fingerprint(glob["reads"])
    assert second is not None and second.key != first.key
    glob["W"].add_(1)
    assert fingerprint(glob["reads"]).key != second.key  # type: ignore[union-attr]


def test_a_function_attribute_is_part_of_the_key() -> None:
    def tagged() -> int:
        return 1

    tagged.tag = 1  # type: ignore[attr-defined]
    a = fingerprint(tagged)
    tagged.tag = 2  # type: ignore[attr-defined]
    b = fingerprint(tagged)
    assert a is not None and b is not None and a.key != b.key


def test_an_empty_closure_cell_is_fingerprinted() -> None:
    def outer() -> Any:
        def inner() -> int:
            return later

        got = fingerprint(inner)
        later = 1
        assert inner() == later
        return got

    assert outer() is not None


def test_without_cloudpickle_helpers_nothing_is_fingerprinted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def plain() -> int:
        return 1

    assert fingerprint(plain) is not None
    monkeypatch.setattr(fp_mod, "_code_globals", None)
    assert fingerprint(plain) is None
    monkeypatch.undo()
    monkeypatch.setattr(fp_mod, "_by_reference", None)
    assert fingerprint(plain) is None


def test_modules_and_classes_by_reference_are_keys_by_value_ones_are_not() -> None:
    import math
    from collections import OrderedDict

    class Local:
        pass

    glob: dict[str, Any] = {"math": math, "OrderedDict": OrderedDict, "Local": Local}
    exec("def by_ref():\n    return math.pi, OrderedDict\n"
         "def by_value():\n    return Local\n", glob)
    assert fingerprint(glob["by_ref"]) is not None
    assert fingerprint(glob["by_value"]) is None  # a class pickled by value: every time


def test_keyword_only_defaults_are_part_of_the_key() -> None:
    def kw(*, x: list[int] = [0]) -> int:  # noqa: B006 - the default is the point
        return x[0]

    a = fingerprint(kw)
    kw.__kwdefaults__["x"][0] = 5  # type: ignore[index]
    b = fingerprint(kw)
    assert a is not None and b is not None and a.key != b.key
