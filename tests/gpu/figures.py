"""The figures the GPU checks measure, one machine-readable line each:

    GPUFN-FIGURE <name> | <value> | <anchor>

`scripts/gpu_check.sh` collects these lines from its log into the summary table, so a new
GPU test adds rows with no change to the script. A test names the rows it reports and
their anchors (what the figure should be, and why) with `@reports(...)`, and prints each
with `figure(name, value)`, measurement first, assertions after, so a failed check still
shows what it measured. A named row the test never printed (it skipped or failed first) is
printed by `tests/gpu/conftest.py` with the outcome and its reason, so the table keeps
every row. The same conftest prints one `GPUFN-TEST <node id> | <outcome> | <reason> |
<seconds>` line per test.
"""

from __future__ import annotations

import sys

import pytest

FIGURE = "GPUFN-FIGURE"
TEST = "GPUFN-TEST"

_anchors: dict[str, str] = {}
_printed: set[str] = set()


def reports(*rows: tuple[str, str]) -> pytest.MarkDecorator:
    """Mark a test with the rows it reports, each `(name, anchor)`."""
    return pytest.mark.figures(*rows)


def figure(name: str, value: object, anchor: str | None = None) -> None:
    """Print one figure; its anchor defaults to the one the test's `@reports` gives."""
    _printed.add(name)
    emit(FIGURE, name, value, _anchors.get(name, "") if anchor is None else anchor)


def emit(kind: str, *fields: object) -> None:
    """One line of `kind` with its fields, on a line of its own (pytest -v may be mid-line)."""
    text = " | ".join(_clean(f) for f in fields)
    sys.stdout.write(f"\n{kind} {text}\n")
    sys.stdout.flush()


def _clean(field: object) -> str:
    text = " ".join(str(field).split()).replace("|", "/")
    return text or "-"


def begin(rows: list[tuple[str, str]]) -> None:
    """A test starts: these are its declared rows and anchors."""
    _anchors.clear()
    _anchors.update(rows)
    _printed.clear()


def unprinted(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Declared rows the test has not printed."""
    return [(name, anchor) for name, anchor in rows if name not in _printed]
