"""The mutation tool's rooms stay runnable (scripts/mutants.py): every module, test file
and named function they list exists, and the span helpers find what they say."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import mutants  # noqa: E402

pytestmark = pytest.mark.timeout(30)

SOURCE = '''\
from __future__ import annotations


def top(x: int) -> int:
    return x


class Outer:
    @staticmethod
    def method(y: str | None) -> None:
        def inner() -> None:
            pass

    async def later(self) -> None:
        pass
'''


def test_function_spans_name_methods_nested_functions_and_decorators() -> None:
    names = ("top", "Outer.method", "Outer.method.inner", "Outer.later")
    assert mutants.function_spans(SOURCE, names) == [(4, 5), (9, 12), (11, 12), (14, 15)]


def test_a_function_the_module_does_not_define_stops_the_run() -> None:
    with pytest.raises(SystemExit, match=re.escape("no function Outer.gone, nothing")):
        mutants.function_spans(SOURCE, ("top", "Outer.gone", "nothing"))
    with pytest.raises(SystemExit):
        mutants.function_spans(SOURCE, ("Outer",))  # a class is not a function


def test_annotation_spans_cover_arguments_returns_and_annotated_names() -> None:
    spans = mutants.annotation_spans(SOURCE + "z: dict[str, int] = {}\n")
    assert mutants.in_annotation((4, 11), spans)  # x: [int]
    assert mutants.in_annotation((4, 19), spans)  # -> [int]
    assert mutants.in_annotation((10, 18), spans)  # y: [str | None]
    assert mutants.in_annotation((16, 3), spans)  # z: [dict[str, int]]
    assert not mutants.in_annotation((5, 11), spans)  # return [x]


@pytest.mark.parametrize("name", sorted(mutants.ROOMS))
def test_every_room_names_what_exists(name: str) -> None:
    room = mutants.ROOMS[name]
    for path in (*room.modules, *room.tests):
        assert (ROOT / path).is_file(), f"room {name}: {path} does not exist"
    if room.only:
        spans = mutants.room_spans(room)
        assert all(spans.values()), f"room {name}: a module with none of its functions"


def test_the_tool_tests_this_checkouts_files() -> None:
    """Here the project is installed editable from this checkout (the README's command)."""
    assert mutants.install_problem() is None


def test_an_interpreter_that_imports_gpufn_from_elsewhere_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mutants, "ROOT", tmp_path)  # as if this checkout were elsewhere
    problem = mutants.install_problem()
    assert problem is not None and "imports gpufn from" in problem
    assert "pip install -e" in problem
