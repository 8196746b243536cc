"""Each GPU test's outcome and the rows it declared but never printed, as figure lines
(`tests/gpu/figures.py`), so `scripts/gpu_check.sh`'s summary says why a row is empty.
Printed with `-s` only, like the tests' own figure lines (elsewhere they would litter the
quiet run of the whole suite)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from . import figures


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "figures(*rows): the (name, anchor) figure rows a GPU test reports")


def declared(item: pytest.Item) -> list[tuple[str, str]]:
    """The rows a test's `@reports(...)` names."""
    return [tuple(row) for mark in item.iter_markers("figures") for row in mark.args]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    figures.begin(declared(item))


def reason(report: pytest.TestReport) -> str:
    """Why a test skipped or failed, in one line."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    return text.strip().splitlines()[0][:200] if text.strip() else ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if item.config.getoption("capture") != "no":
        return  # the tests' own figure lines show with -s only (as scripts/gpu_check.sh runs)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        why = "" if report.passed else reason(report)
        figures.emit(figures.TEST, item.nodeid, report.outcome, why, f"{report.duration:.1f}")
        for name, anchor in figures.unprinted(declared(item)):
            value = "not printed" if report.passed else f"{report.outcome}: {why}"
            figures.emit(figures.FIGURE, name, value, anchor)
    elif report.when == "teardown" and report.failed:
        figures.emit(figures.TEST, item.nodeid, "error in teardown", reason(report),
                     f"{report.duration:.1f}")
