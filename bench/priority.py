"""Priority under overload, and the batching gain, measured in one run.

A function with a fixed service time runs on simulated devices. A high-priority stream
at 30% of capacity is mixed with a low-priority stream; the total offered load is swept
over 0.5x..3x capacity (Poisson arrivals, seeded, open loop). Each load level runs twice
on the same arrival trace: with priorities (gpufn) and with priorities ignored (FIFO:
both streams submitted at priority 0). Per class: p50/p99 latency, SLO attainment (high
SLO = 5x service time), completion rate within the window (+ a drain period), and the
longest wait of the low class, next to the aging bound.

Then the batching gain: the same per-item work as a @gpu(batch_size=...) function vs
unbatched, offered the same burst of calls: throughput ratio.

    python bench/priority.py [--devices 2] [--service-ms 50] [--seconds 8] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from typing import Any

SLO_FACTOR = 5.0
LOADS = (0.5, 1.0, 1.5, 2.0, 3.0)
HIGH_SHARE = 0.3
PRIORITY_GAP = 4


def trace(rate_high: float, rate_low: float, seconds: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    for cls, rate in (("high", rate_high), ("low", rate_low)):
        t = rng.expovariate(rate)
        while t < seconds:
            out.append((t, cls))
            t += rng.expovariate(rate)
    return sorted(out)


def pct(v: list[float], q: float) -> float:
    if not v:
        return float("nan")
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_level(fns: dict[str, Any], arrivals: list[tuple[float, str]], seconds: float,
              drain: float) -> dict[str, dict[str, float]]:
    """Submit on schedule; record completion times from future callbacks."""
    done: dict[int, float] = {}
    lock = threading.Lock()
    calls: list[tuple[int, str, float, Any]] = []
    start = time.monotonic()
    for i, (t, cls) in enumerate(arrivals):
        delay = start + t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent = time.monotonic()
        call = fns[cls].spawn()

        def mark(_f: Any, i: int = i) -> None:
            with lock:
                done[i] = time.monotonic()

        call._future.add_done_callback(mark)
        calls.append((i, cls, sent, call))
    end = start + seconds + drain
    while time.monotonic() < end and len(done) < len(calls):
        time.sleep(0.05)
    for _, _, _, call in calls:
        if not call.done():
            call.cancel()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(c.done() for *_, c in calls):
        time.sleep(0.05)
    out: dict[str, dict[str, float]] = {}
    for cls in ("high", "low"):
        lat, waits, total, completed = [], [], 0, 0
        for i, c, sent, call in calls:
            if c != cls:
                continue
            total += 1
            if i in done and call.done() and call._future.exception() is None:
                completed += 1
                lat.append(done[i] - sent)
                waits.append(call.result_meta().get("queued_s", 0.0))
        out[cls] = {"n": total, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
                    "completed": completed / total if total else float("nan"),
                    "lat": lat, "max_wait": max(waits) if waits else float("nan")}  # type: ignore[dict-item]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--service-ms", type=float, default=50.0)
    ap.add_argument("--seconds", type=float, default=8.0, help="arrival window per load level")
    ap.add_argument("--drain", type=float, default=4.0, help="extra seconds to finish")
    ap.add_argument("--aging-seconds", type=float, default=2.5,
                    help="seconds per priority level; the bound is PRIORITY_GAP times this")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch-calls", type=int, default=1500)
    a = ap.parse_args()
    os.environ["GPUFN_CPU_DEVICES"] = str(a.devices)
    os.environ["GPUFN_AGING_SECONDS"] = str(a.aging_seconds)
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import gpufn

    service = a.service_ms / 1000.0

    @gpufn.gpu
    def work() -> None:
        time.sleep(service)

    fns = {"gpufn": {"high": work.with_options(priority=PRIORITY_GAP), "low": work},
           "fifo": {"high": work, "low": work}}
    client = gpufn.connect()
    while any(d["state"] != "ready" for d in client.status()["devices"]):
        time.sleep(0.1)
    for _ in range(3):
        work.remote()
    capacity = a.devices / service
    aging_bound = PRIORITY_GAP * a.aging_seconds
    rows = []
    for load in LOADS:
        total = load * capacity
        high = HIGH_SHARE * capacity
        arrivals = trace(high, max(total - high, 1e-9), a.seconds, a.seed + int(load * 10))
        for mode in ("gpufn", "fifo"):
            r = run_level(fns[mode], arrivals, a.seconds, a.drain)
            rows.append((load, mode, r))
            print(f"load {load}x {mode}: done", file=sys.stderr)

    # ---------------------------------------------------------------- batching gain
    per_batch_s, per_item_s, bsize = 0.02, 0.001, 16

    @gpufn.gpu(batch_size=bsize, batch_wait_ms=5)
    def batched(xs: list[int]) -> list[int]:
        time.sleep(per_batch_s + per_item_s * len(xs))
        return [x + 1 for x in xs]

    @gpufn.gpu
    def single(x: int) -> int:
        time.sleep(per_batch_s + per_item_s)
        return x + 1

    gains = []
    for fn in (single, batched):
        fn.remote(0)
        t = time.perf_counter()
        calls = [fn.spawn(i) for i in range(a.batch_calls)]
        for c in calls:
            c.get(timeout=600)
        gains.append(a.batch_calls / (time.perf_counter() - t))

    from rich.console import Console
    from rich.table import Table

    slo = SLO_FACTOR * service
    t = Table(title=(f"priority under overload: {a.devices} devices, service {a.service_ms:.0f} ms "
                     f"(capacity {capacity:.0f}/s), high = {HIGH_SHARE:.0%} of capacity, "
                     f"{a.seconds:.0f} s per level, aging {a.aging_seconds} s/level "
                     f"(bound {aging_bound:.1f} s)"))
    for col in ("load", "mode", "high p50", "high p99", f"high SLO<{slo * 1000:.0f}ms",
                "high done", "low p50", "low p99", "low done", "low max wait"):
        t.add_column(col, justify="right")

    def ms(x: float) -> str:
        return "-" if x != x else f"{x * 1000:,.0f} ms"

    base_p99: dict[str, float] = {}
    for load, mode, r in rows:
        hi, lo = r["high"], r["low"]
        att = sum(1 for x in hi["lat"] if x <= slo) / hi["n"] if hi["n"] else float("nan")  # type: ignore[attr-defined]
        if load == LOADS[0]:
            base_p99[mode] = hi["p99"]
        t.add_row(f"{load}x", mode, ms(hi["p50"]), ms(hi["p99"]), f"{att:.0%}",
                  f"{hi['completed']:.0%}", ms(lo["p50"]), ms(lo["p99"]), f"{lo['completed']:.0%}",
                  ms(lo["max_wait"]))
    Console().print(t)
    for mode in ("gpufn", "fifo"):
        p99_2x = next(r["high"]["p99"] for load, m, r in rows if m == mode and load == 2.0)
        ratio = p99_2x / base_p99[mode]
        ok = "meets" if ratio <= 1.5 else "misses"
        print(f"{mode}: high p99 at 2x / at 0.5x = {ratio:.2f} ({ok} the 1.5x target)")
    under = [r["low"]["max_wait"] for load, m, r in rows if m == "gpufn" and load < 1.0]
    worst = max(under) if under else float("nan")
    print(f"gpufn: longest low-priority wait below 100% load = {worst * 1000:.0f} ms "
          f"(bound: aging {aging_bound * 1000:.0f} ms + one service {a.service_ms:.0f} ms)")
    print(f"batching: {gains[1]:,.0f} calls/s batched (batch_size={bsize}) vs {gains[0]:,.0f} "
          f"unbatched = {gains[1] / gains[0]:.1f}x at the same offered burst of {a.batch_calls}")


if __name__ == "__main__":
    main()
