"""The result cache across processes: a re-run after a kill computes only what is missing,
and two clients mapping the same inputs at once compute each item once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import assert_all_gone

pytestmark = pytest.mark.timeout(300)
CLIENT = Path(__file__).with_name("_cache_client.py")
ROOT = Path(__file__).parents[2]


def _start(cache: Path, logs: Path, n: int, tag: str, barrier: int = 0) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GPUFN_ADDRESS", None)
    return subprocess.Popen([sys.executable, str(CLIENT), str(cache), str(logs), str(n), tag,
                             str(barrier)], stdout=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen[str], logs: Path, tag: str) -> dict:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert_all_gone(json.loads((logs / f"pids.{tag}").read_text()))
    return json.loads(out.strip().splitlines()[-1])


def _computed(logs: Path, tag: str) -> Counter[int]:
    return Counter(int(f.name.split(".")[0]) for f in logs.iterdir()
                   if f.name.count(".") == 2 and f.name.split(".")[1] == tag)


def _stored(cache: Path) -> int:
    return len(list(cache.rglob("*.result")))


def test_rerun_after_a_kill_computes_only_the_missing_items(tmp_path: Path) -> None:
    cache, logs, n = tmp_path / "cache", tmp_path / "logs", 40
    logs.mkdir()
    first = _start(cache, logs, n, "one")
    deadline = time.monotonic() + 200
    while _stored(cache) < 8:  # killed mid-run, once some results are stored
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended early"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert_all_gone(json.loads((logs / "pids.one").read_text()))
    stored = _stored(cache)
    assert 8 <= stored < n
    second = _finish(_start(cache, logs, n, "two"), logs, "two")
    assert second["sum"] == sum(i * i for i in range(n))
    again = _computed(logs, "two")
    assert sum(again.values()) == n - stored == second["computed"]
    assert second["hits"] == stored
    assert max(again.values()) == 1


def test_two_simultaneous_identical_maps_compute_each_item_once(tmp_path: Path) -> None:
    cache, logs, n = tmp_path / "cache", tmp_path / "logs", 30
    logs.mkdir()
    procs = {tag: _start(cache, logs, n, tag, barrier=2) for tag in ("a", "b")}
    outs = {tag: _finish(proc, logs, tag) for tag, proc in procs.items()}
    assert all(o["sum"] == sum(i * i for i in range(n)) for o in outs.values())
    computed = _computed(logs, "a") + _computed(logs, "b")
    assert sorted(computed) == list(range(n)) and set(computed.values()) == {1}
    assert outs["a"]["computed"] + outs["b"]["computed"] == n
    # both ran at once: each got results the other was computing
    assert outs["a"]["waited"] + outs["b"]["waited"] + outs["a"]["hits"] + outs["b"]["hits"] == n
