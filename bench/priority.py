"""Priority under overload, the aging bound, and the batching gain, measured in one run.

1. Priority under overload. A function with a fixed service time runs on simulated
   devices. A high-priority stream at 30% of capacity is mixed with a low-priority
   stream; the total offered load is swept over 0.5x..3x capacity (Poisson arrivals,
   seeded, open loop). Each load level runs twice on the same arrival trace: with
   priorities (gpufn) and with priorities ignored (FIFO: both streams at priority 0).
   Per class: completions (done / offered) next to p50/p99 latency of the completed
   calls, SLO attainment (high SLO = 5x service time), the longest low-class wait, and
   the aging check below.
2. The aging bound where starvation can happen: the high class ALONE offers 1x..2x
   capacity, with a trickle of low-priority calls, on a cluster with a short
   --starve-aging-seconds and on one with aging off. The README promises a low call
   "waits at most (priority gap) x GPUFN_AGING_SECONDS behind newer higher-priority
   calls": for every low call we measure how much newer the newest high call that
   started before it was (its overtaking horizon) and compare the longest with the
   bound. Without aging the low calls starve (few complete).
3. The batching gain: the same per-item work as a @gpu(batch_size=...) function vs
   unbatched, both at the same @gpu(concurrency=...) and offered the same burst of
   calls. The work holds a per-device lock, so concurrent calls on one device share it
   as they would a real accelerator (only the call overheads overlap).

Every measurement is repeated (--repeats) and reported as min / median.

    python bench/priority.py [--devices 2] [--service-ms 50] [--seconds 8] [--repeats 3]
    python bench/priority.py --quick        # a short smoke run
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import alive, connect_ready, descendants

SLO_FACTOR = 5.0
LOADS = (0.5, 1.0, 1.5, 2.0, 3.0)
STARVE_LOADS = (1.0, 1.5, 2.0)  # offered by the high class alone
STARVE_LOW_SHARE = 0.05  # the low trickle, as a share of capacity
HIGH_SHARE = 0.3
PRIORITY_GAP = 4
NAN = float("nan")


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
        return NAN
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_level(fns: dict[str, Any], arrivals: list[tuple[float, str]], seconds: float,
              drain: float, slo: float) -> dict[str, dict[str, float]]:
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
    started: dict[int, float] = {}  # sent + queued (the scheduler's own wait)
    out: dict[str, dict[str, float]] = {}
    for cls in ("high", "low"):
        lat, waits, total, completed, in_window = [], [], 0, 0, 0
        for i, c, sent, call in calls:
            if c != cls:
                continue
            total += 1
            if i in done and call.done() and call._future.exception() is None:
                completed += 1
                in_window += done[i] <= start + seconds
                lat.append(done[i] - sent)
                wait = call.result_meta().get("queued_s", 0.0)
                waits.append(wait)
                started[i] = sent + wait
        out[cls] = {"n": total, "done": completed, "in_window": in_window, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
                    "slo": sum(1 for x in lat if x <= slo) / total if total else NAN,
                    "max_wait": max(waits) if waits else NAN}
    # overtaking horizon: for each low call that ran, how much newer than it was the
    # newest high call that started before it (0: none newer overtook it)
    highs = sorted((started[i], sent) for i, c, sent, _ in calls if c == "high" and i in started)
    horizon = NAN
    for i, c, sent, _ in calls:
        if c != "low" or i not in started:
            continue
        newer = [hs - sent for st, hs in highs if st < started[i] and hs > sent]
        h = max(newer, default=0.0)
        horizon = h if horizon != horizon else max(horizon, h)
    out["low"]["horizon"] = horizon
    return out


# ---------------------------------------------------------------------------- cluster

def start_cluster(devices: int, aging: float) -> Any:
    os.environ["GPUFN_AGING_SECONDS"] = str(aging)
    return connect_ready()


def stop_cluster(before: set[int]) -> list[int]:
    from gpufn.client import default as gclient

    mine = descendants(os.getpid()) - before
    gclient._shutdown_default()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in mine):
        time.sleep(0.05)
    return sorted(p for p in mine if alive(p))


# ---------------------------------------------------------------------------- report

def mm(vals: list[float], fmt: str = ",.0f", scale: float = 1000.0, unit: str = " ms") -> str:
    v = [x * scale for x in vals if x == x]
    if not v:
        return "-"
    if len(v) == 1:
        return f"{v[0]:{fmt}}{unit}"
    return f"{min(v):{fmt}} / {statistics.median(v):{fmt}}{unit}"


def share(vals: list[float]) -> str:
    return mm(vals, ".0%", 1.0, "")


def done_cell(rs: list[dict[str, float]], key: str = "done") -> str:
    """completed / offered (share), min / median over runs."""
    n = int(rs[0]["n"])
    done = [r[key] for r in rs]
    if len(done) == 1:
        return f"{done[0]:.0f}/{n} ({done[0] / n if n else NAN:.0%})"
    return f"{min(done):.0f} / {statistics.median(done):.0f} of {n}"


def med(vals: list[float]) -> float:
    v = [x for x in vals if x == x]
    return statistics.median(v) if v else NAN


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--service-ms", type=float, default=50.0)
    ap.add_argument("--seconds", type=float, default=8.0, help="arrival window per load level")
    ap.add_argument("--drain", type=float, default=4.0, help="extra seconds to finish")
    ap.add_argument("--aging-seconds", type=float, default=2.5,
                    help="seconds per priority level in part 1; the bound is PRIORITY_GAP times this")
    ap.add_argument("--starve-aging-seconds", type=float, default=0.5,
                    help="seconds per priority level in part 2 (short, so the bound is "
                         "reached within --seconds)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch-calls", type=int, default=1500)
    ap.add_argument("--batch-concurrency", type=int, default=8,
                    help="@gpu(concurrency=...) of both the batched and the unbatched function "
                         "(8 = gpufn's default slots per device)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    a = ap.parse_args()
    loads: tuple[float, ...] = LOADS
    starve_loads: tuple[float, ...] = STARVE_LOADS
    if a.quick:
        a.seconds, a.drain, a.repeats, a.batch_calls = 3.0, 2.0, 2, 200
        a.starve_aging_seconds = 0.25
        loads, starve_loads = (0.5, 2.0), (1.5,)
    os.environ["GPUFN_CPU_DEVICES"] = str(a.devices)
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import gpufn

    service = a.service_ms / 1000.0
    slo = SLO_FACTOR * service
    capacity = a.devices / service
    leftover: list[int] = []

    @gpufn.gpu
    def work() -> None:
        time.sleep(service)

    fns = {"gpufn": {"high": work.with_options(priority=PRIORITY_GAP), "low": work},
           "fifo": {"high": work, "low": work}}

    # ------------------------------------------------------------ 1. priority + batching
    per_batch_s, per_item_s, bsize = 0.02, 0.001, 16
    conc = a.batch_concurrency

    def device_time(seconds: float) -> None:
        # one worker process per device: calls on it take turns, as on an accelerator
        lock = sys.__dict__.setdefault("_gpufn_bench_device", threading.Lock())
        with lock:
            time.sleep(seconds)

    @gpufn.gpu(batch_size=bsize, batch_wait_ms=5, concurrency=conc)
    def batched(xs: list[int]) -> list[int]:
        device_time(per_batch_s + per_item_s * len(xs))
        return [x + 1 for x in xs]

    @gpufn.gpu(concurrency=conc)
    def single(x: int) -> int:
        device_time(per_batch_s + per_item_s)
        return x + 1

    before = descendants(os.getpid())
    start_cluster(a.devices, a.aging_seconds)
    rows: dict[tuple[float, str], list[dict[str, dict[str, float]]]] = {}
    gains: dict[str, list[float]] = {"single": [], "batched": []}
    try:
        for _ in range(3):
            work.remote()
        for rep in range(a.repeats):
            for load in loads:
                total = load * capacity
                high = HIGH_SHARE * capacity
                arrivals = trace(high, max(total - high, 1e-9), a.seconds, a.seed + int(load * 10))
                for mode in ("gpufn", "fifo"):
                    r = run_level(fns[mode], arrivals, a.seconds, a.drain, slo)
                    rows.setdefault((load, mode), []).append(r)
                    print(f"[{rep + 1}/{a.repeats}] load {load}x {mode}: done", file=sys.stderr)
            for name, fn in (("single", single), ("batched", batched)):
                fn.remote(0)
                t_start = time.perf_counter()
                calls = [fn.spawn(i) for i in range(a.batch_calls)]
                for c in calls:
                    c.get(timeout=600)
                gains[name].append(a.batch_calls / (time.perf_counter() - t_start))
    finally:
        leftover += stop_cluster(before)

    # ------------------------------------------------------------ 2. aging where it matters
    starve: dict[tuple[float, str], list[dict[str, dict[str, float]]]] = {}
    bound = PRIORITY_GAP * a.starve_aging_seconds
    for mode, aging in (("aging", a.starve_aging_seconds), ("no aging", float("inf"))):
        before = descendants(os.getpid())
        start_cluster(a.devices, aging)
        try:
            work.remote()
            for rep in range(a.repeats):
                for load in starve_loads:
                    arrivals = trace(load * capacity, STARVE_LOW_SHARE * capacity, a.seconds,
                                     a.seed + 100 + int(load * 10))
                    r = run_level(fns["gpufn"], arrivals, a.seconds, a.drain, slo)
                    starve.setdefault((load, mode), []).append(r)
                    print(f"[{rep + 1}/{a.repeats}] high alone at {load}x, {mode}: done",
                          file=sys.stderr)
        finally:
            leftover += stop_cluster(before)

    # ------------------------------------------------------------ report
    from rich.console import Console
    from rich.table import Table

    con = Console() if sys.stdout.isatty() else Console(width=200)
    aging_bound = PRIORITY_GAP * a.aging_seconds
    t1 = Table(title=(f"1. priority under overload: {a.devices} devices, service {a.service_ms:.0f} ms "
                     f"(capacity {capacity:.0f}/s), high = {HIGH_SHARE:.0%} of capacity, "
                     f"{a.seconds:.0f} s per level + {a.drain:.0f} s drain, aging "
                     f"{a.aging_seconds} s/level (bound {aging_bound:.1f} s); {a.repeats} runs, "
                     "min / median; latency of completed calls"), title_justify="left")
    for col in ("load", "mode", "high done", "high p50", "high p99", f"high SLO<{slo * 1000:.0f}ms",
                "low done", "low p50", "low p99", "low max wait", "low overtaken by (newest high)"):
        t1.add_column(col, justify="right")
    for (load, mode), rs in rows.items():
        hi = [r["high"] for r in rs]
        lo = [r["low"] for r in rs]
        t1.add_row(f"{load}x", mode, done_cell(hi), mm([h["p50"] for h in hi]),
                  mm([h["p99"] for h in hi]), share([h["slo"] for h in hi]), done_cell(lo),
                  mm([x["p50"] for x in lo]), mm([x["p99"] for x in lo]),
                  mm([x["max_wait"] for x in lo]),
                  mm([x["horizon"] for x in lo]) if mode == "gpufn" else "-")
    con.print(t1)

    t2 = Table(title=(f"2. the aging bound where starvation can happen: the high class alone offers "
                      f"the load, plus low calls at {STARVE_LOW_SHARE:.0%} of capacity; aging "
                      f"{a.starve_aging_seconds} s/level x gap {PRIORITY_GAP} = bound {bound:.1f} s; "
                      f"{a.repeats} runs, min / median"), title_justify="left")
    for col in ("high load", "mode", "low done while the high stream runs", "low done",
                "low max wait", "low overtaken by (newest high)", "bound", "high done", "high p99"):
        t2.add_column(col, justify="right")
    for (load, mode), rs in starve.items():
        hi = [r["high"] for r in rs]
        lo = [r["low"] for r in rs]
        t2.add_row(f"{load}x", mode, done_cell(lo, "in_window"), done_cell(lo), mm([x["max_wait"] for x in lo]),
                   mm([x["horizon"] for x in lo]), f"{bound * 1000:,.0f} ms" if mode == "aging" else "none",
                   done_cell(hi), mm([h["p99"] for h in hi]))
    con.print(t2)

    # ------------------------------------------------------------ verdicts
    def first(load: float, mode: str, cls: str, key: str) -> float:
        return med([r[cls][key] for r in rows.get((load, mode), [])])

    base = loads[0]
    over = 2.0 if 2.0 in loads else loads[-1]
    for mode in ("gpufn", "fifo"):
        ratio = first(over, mode, "high", "p99") / first(base, mode, "high", "p99")
        ok = "meets" if ratio <= 1.5 else "misses"
        print(f"{mode}: high p99 at {over}x / at {base}x = {ratio:.2f} ({ok} the 1.5x target; "
              f"high completed {first(over, mode, 'high', 'done'):.0f} of "
              f"{first(over, mode, 'high', 'n'):.0f} at {over}x)")
    tol = service  # a call already running when the low one rose to the top
    for label, table, b in (("part 1", rows, aging_bound), ("part 2", starve, bound)):
        worst = [max((r["low"]["horizon"] for r in rs if r["low"]["horizon"] == r["low"]["horizon"]),
                     default=NAN) for (load, mode), rs in table.items() if mode in ("gpufn", "aging")]
        w = max((x for x in worst if x == x), default=NAN)
        verdict = "-" if w != w else ("holds" if w <= b + tol else "VIOLATED")
        weak = (f" (the {a.seconds:g} s arrival window is shorter than the bound, so this "
                "cannot fail here; part 2 is the check)") if a.seconds <= b else ""
        print(f"aging bound, {label}: no low call was overtaken by a high call more than "
              f"{w * 1000:,.0f} ms newer than it, at any load (bound {b * 1000:,.0f} ms + one "
              f"service time) -> {verdict}{weak}")
    for load in starve_loads:
        lo_a, lo_n = (med([r["low"]["in_window"] / r["low"]["n"]
                           for r in starve.get((load, mode), []) if r["low"]["n"]])
                      for mode in ("aging", "no aging"))
        print(f"high alone at {load}x: low calls completed while the high stream ran: "
              f"{lo_a:.0%} with aging vs {lo_n:.0%} without (median)")
    g1, gb = med(gains["single"]), med(gains["batched"])
    print(f"batching: {mm(gains['batched'], ',.0f', 1.0, '')} calls/s batched (batch_size={bsize}) vs "
          f"{mm(gains['single'], ',.0f', 1.0, '')} unbatched (min / median), {gb / g1:.1f}x at the "
          f"median; both @gpu(concurrency={conc}), the same offered burst of {a.batch_calls}, "
          "device time serialised per device")
    if leftover:
        print(f"processes left behind: {leftover}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
