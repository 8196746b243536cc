"""Waiting helpers for integration tests: poll for an event with a deadline, never sleep blind."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import gpufn

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 20.0, what: str = "condition",
             interval: float = 0.02) -> T:
    """Poll `check` until it returns a truthy value; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_file(path: str, timeout: float = 20.0) -> None:
    wait_for(lambda: os.path.exists(path), timeout, f"file {path}")


def running_ids(c: gpufn.Client) -> set[str]:
    return {r["id"] for d in c.status()["devices"] for r in d["running"]}


def running_functions(c: gpufn.Client) -> list[str]:
    return [r["function"] for d in c.status()["devices"] for r in d["running"]]


def wait_idle(c: gpufn.Client, function: str | None = None, timeout: float = 20.0) -> None:
    """Until no device runs (a call of `function`, or any call) and nothing is queued."""
    def idle() -> bool:
        st = c.status()
        busy = [r for d in st["devices"] for r in d["running"]
                if function is None or r["function"] == function]
        return not busy and (function is not None or st["queued"] == 0)
    wait_for(idle, timeout, f"no running call of {function or 'any function'}")


def settled_counters(c: gpufn.Client, timeout: float = 15.0) -> dict[str, int]:
    """The scheduler's counters once they stop moving: calls under a lease are counted
    from its worker's reports (every 0.2 s) and its end (leases last up to a second)."""
    deadline = time.monotonic() + timeout
    last = c.status()["counters"]
    while True:
        time.sleep(0.7)
        now = c.status()["counters"]
        if now == last or time.monotonic() > deadline:
            return dict(now)
        last = now
