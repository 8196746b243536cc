"""The scheduler's TCP port under bad input (a seeded fuzzer, tests/integration/_fuzz.py):
it keeps serving a correct client, its memory stays bounded, every bad peer is refused
or dropped, and no handler crashes."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import statistics
import threading
import time
from collections import Counter
from typing import Any

import pytest

import gpufn

SEED = int(os.environ.get("GPUFN_FUZZ_SEED", "20260")) or 20260
MiB = 2**20


@gpufn.gpu(type="cpu")  # never placed on the fuzzer's own fake device (type FUZZ)
def inc(x: int) -> int:
    return x + 1


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Probe(threading.Thread):
    """A correct client calling `inc` over and over, timing each call."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                t = time.perf_counter()
                assert inc.remote(i) == i + 1
                self.latencies.append(time.perf_counter() - t)
                i += 1
        except BaseException as e:
            self.error = e


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _log_categories(text: str) -> Counter[str]:
    """Scheduler log lines by what they mean; a handler crash is what the fuzz must not cause."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if "gpufn-scheduler" not in line and "Traceback" not in line:
            continue
        if "failed to handle" in line or "scheduling pass failed" in line:
            out["handler crash"] += 1
        elif "Traceback" in line:
            out["traceback"] += 1
        elif " ERROR " in line or " CRITICAL " in line:
            out["error"] += 1
        elif "undecodable message" in line:
            out["undecodable (rate-limited)"] += 1
        else:
            m = re.search(r"gpufn-scheduler (\w+)", line)
            out[f"other {m.group(1) if m else '?'}"] += 1
    return out


def fuzz(start: Any, capfd: pytest.CaptureFixture[str], messages: int) -> dict[str, Any]:
    c = start(GPUFN_EMBEDDED_TRANSPORT="tcp")
    assert c.address.startswith("tcp://")
    pid = c.cluster.scheduler.pid
    for i in range(50):  # warm up: workers loaded the code, the client's channel is open
        assert inc.remote(i) == i + 1
    before = []
    for i in range(200):
        t = time.perf_counter()
        inc.remote(i)
        before.append(time.perf_counter() - t)
    rss_before = rss(pid)

    out: Any = multiprocessing.get_context("spawn").Queue()
    from tests.integration import _fuzz

    proc = multiprocessing.get_context("spawn").Process(
        target=_fuzz.run_to_queue, args=(c.address, c.token, messages, SEED, out))
    probe = Probe()
    probe.start()
    t0 = time.monotonic()
    proc.start()
    try:
        report = out.get(timeout=600)
    finally:
        proc.join(30)
        probe.stop.set()
        probe.join(60)
    elapsed = time.monotonic() - t0
    assert "crashed" not in report, report.get("crashed")
    assert probe.error is None, f"the correct client failed during the fuzz: {probe.error!r}"
    rss_after = rss(pid)
    assert c.cluster.scheduler.poll() is None, "the scheduler died"
    assert inc.remote(1) == 2  # still serving
    logs = _log_categories(capfd.readouterr().err)

    during = probe.latencies
    p50_before = statistics.median(before)
    figures = {
        "messages": report["messages"], "zmq frames": report["frames"], "peers": report["peers"],
        "seconds": round(elapsed, 1),
        "calls during fuzz": len(during),
        "p50 before ms": round(p50_before * 1e3, 2),
        "p50 during ms": round(statistics.median(during) * 1e3, 2) if during else None,
        "p99 during ms": round(_quantile(during, 0.99) * 1e3, 2) if during else None,
        "max during ms": round(max(during) * 1e3, 2) if during else None,
        "rss before MiB": round(rss_before / MiB, 1), "rss after MiB": round(rss_after / MiB, 1),
        "replies": report["replies"], "raw tcp": report["raw"], "log": dict(logs),
        "by kind": report["by_kind"],
    }
    print("\nfuzz figures:", json.dumps(figures, indent=1))

    assert report["messages"] >= messages
    assert not report["failures"], "\n".join(report["failures"][:10])
    assert logs["handler crash"] == 0 and logs["traceback"] == 0 and logs["error"] == 0, dict(logs)
    assert len(during) >= 20, "the correct client barely got through during the fuzz"
    bound = max(20 * p50_before, 0.5)  # generous: 2 shared cores serve fuzzer, scheduler and probe
    assert _quantile(during, 0.99) < bound, figures
    assert rss_after - rss_before < 50 * MiB, figures
    return figures


@pytest.mark.timeout(300)
def test_fuzzed_scheduler_keeps_serving(fresh_cluster: Any, capfd: pytest.CaptureFixture[str]) -> None:
    fuzz(fresh_cluster, capfd, int(os.environ.get("GPUFN_FUZZ_MESSAGES", "40000")))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fuzzed_scheduler_keeps_serving_long(fresh_cluster: Any,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    fuzz(fresh_cluster, capfd, 200_000)
