"""Rules of the last release that need real processes: a `.map()` over more argument bytes
than its in-flight window, and a gang call's metered device time. Each test fails under a
one-line mutation listed in scripts/mutate.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import gpufn
from gpufn.api import map_run

from ._waits import running_ids, wait_for

pytestmark = pytest.mark.timeout(120)

ITEM = 1000  # bytes of each map input
WINDOW = 4 * ITEM  # the map's in-flight argument bytes, shrunk for the test


@gpufn.gpu
def first_byte(gate: str, data: bytes) -> tuple[int, int]:
    while not os.path.exists(gate):  # held until the test has looked at what is in flight
        time.sleep(0.01)
    return data[0], len(data)


@pytest.mark.parametrize("window", ["bytes", "calls"])
def test_a_map_over_more_bytes_than_its_window_returns_every_output_in_order(
        cluster: gpufn.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        window: str) -> None:
    """The in-flight window, of argument bytes (shrunk here) or of calls
    (GPUFN_MAP_WINDOW), holds a map's calls back; every output still comes, in order."""
    if window == "bytes":
        monkeypatch.setattr(map_run, "MAP_WINDOW_BYTES", WINDOW)
        limit = WINDOW // ITEM + 1  # whole calls: it may pass its limit by the one that crosses it
    else:
        monkeypatch.setenv("GPUFN_MAP_WINDOW", "3")
        limit = 3
    gate = str(tmp_path / "open")
    n = 30  # about seven windows of arguments
    inputs = [bytes([i]) * ITEM for i in range(n)]
    out: list[Any] = []

    def run() -> None:
        try:
            out.extend(first_byte.map([gate] * n, inputs))
        except BaseException as e:  # reported below
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        wait_for(lambda: out or len(running_ids(cluster)) >= 2, 30, "the map's calls to run")
        assert not out, out
        time.sleep(0.3)  # a map ignoring its window would submit everything meanwhile
        st = cluster.status()
        in_flight = st["queued"] + len(running_ids(cluster))
        assert in_flight <= limit, f"{in_flight} calls in flight for a window of {limit}"
    finally:
        Path(gate).touch()  # never leave the devices held
    t.join(60)
    assert not t.is_alive(), "the map did not finish"
    assert out == [(i, ITEM) for i in range(n)]


@gpufn.gpu(count=2, timeout=60)
def gang_sleeps(seconds: float) -> int:
    time.sleep(seconds)
    return gpufn.context().rank


def _device_seconds(c: gpufn.Client, function: str) -> float:
    rows = c.query("usage", {"by": "function"})["rows"]
    return sum(r["device_seconds"] for r in rows if r["function"].endswith(function))


def test_a_gang_call_is_metered_as_its_devices_times_its_run_time(cluster: gpufn.Client) -> None:
    assert gang_sleeps.remote(0.0) == 0  # the group forms once; the next call reuses it
    before = _device_seconds(cluster, "gang_sleeps")
    t0 = time.monotonic()
    call = gang_sleeps.spawn(1.0)
    assert call.get(timeout=60) == 0
    wall = time.monotonic() - t0
    ran = call.result_meta()["duration"]  # rank 0's own run time
    used = _device_seconds(cluster, "gang_sleeps") - before
    assert 2 * ran <= used + 0.05, f"{used:.2f} device-seconds for 2 devices x {ran:.2f}s"
    assert used <= 2 * wall + 0.05, f"{used:.2f} device-seconds within {wall:.2f}s on 2 devices"
