"""Many models sharing a small device pool: gpufn's cost-aware pool vs LRU-by-count vs
static one-model-per-device (Triton-like), on the SAME trace, in one run.

Workload: 20+ torch MLPs (CPU; sizes log-uniform over two orders of magnitude, seeded
init, so the loader does real construction work; no downloads) weighing about 3x the
pool (devices x device memory), a Zipf(1.0) popularity over them and Poisson arrivals,
submitted open loop with `.spawn()` at their scheduled times (latency = completion -
scheduled arrival). Each call runs a small forward pass on its model.

Policies (each on a fresh embedded cluster, torn down between runs):
  * cost    gpufn's default: byte-accurate admission, Greedy-Dual-Size-Frequency
            eviction, host tier (offload/restore) within --host-memory;
  * lru     LRU by model count (Ray Serve multiplexing): --lru-max-models per device
            (default: how many average-size models fit), bytes ignored, no host tier;
  * static  one model per device (lru-count with max_models=1, no host tier).

Reported per policy: cold starts per 1,000 requests (loader runs and host restores,
separately), mean/p50/p99 latency, loader vs host-restore time and their ratio, peak
and mean pool utilisation (status() sampled every --sample-ms: sum used / sum
capacity), OOMs (calls failing with gpufn.OutOfMemory) and other failures; then the
issue's targets. With --repeats N each cell is "min / median" over N runs of the trace.

    python bench/multimodel.py [--requests 480 --rate 6 --repeats 1 --seed 0]

The defaults take about 1.5 minutes per policy (4.5 minutes in all) on a 2-core CPU
machine; the request rate is the knob to raise where there are more cores.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import (
    MiB,
    ModelSpec,
    alive,
    descendants,
    make_function,
    make_model,
    model_count_for,
    percentile,
    plan_models,
    zipf_trace,
)

POLICIES = ("cost", "lru", "static")
LABEL = {"cost": "gpufn (cost)", "lru": "LRU-count", "static": "static 1/device"}


# ---------------------------------------------------------------------------- one run

@dataclass
class RunResult:
    policy: str
    metrics: dict[str, float] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    leftover: list[int] = field(default_factory=list)


class Sampler(threading.Thread):
    """Polls client.status() every `period` s: (t, used, capacity, used capped at each
    device's capacity, resident model bytes)."""

    def __init__(self, client: Any, period: float) -> None:
        super().__init__(name="pool-sampler", daemon=True)
        self.client, self.period = client, period
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        nxt = time.perf_counter()
        while not self.stop.is_set():
            try:
                st = self.client.status(timeout=5.0)
            except Exception:
                self.errors += 1
            else:
                devs = st.get("devices", [])
                resident = sum(m.get("nbytes", 0) for d in devs for m in d.get("models", [])
                               if m.get("state") == "resident")
                self.samples.append((
                    time.perf_counter(), sum(d["used"] for d in devs),
                    sum(d["capacity"] for d in devs),
                    sum(min(d["used"], d["capacity"]) for d in devs), resident))
            nxt += self.period
            self.stop.wait(max(0.0, nxt - time.perf_counter()))


def policy_env(policy: str, a: argparse.Namespace, lru_max: int) -> dict[str, str]:
    env = {
        "GPUFN_CPU_DEVICES": str(a.devices),
        "GPUFN_DEVICE_MEMORY": f"{a.device_memory_bytes}",
        "GPUFN_HOST_OFFLOAD_MEMORY": a.host_memory,
        "GPUFN_PROGRESS": "0",
    }
    if a.slots:
        env["GPUFN_SLOTS"] = str(a.slots)
    if policy == "cost":
        env["GPUFN_EVICTION_POLICY"] = "cost"
    else:
        env["GPUFN_EVICTION_POLICY"] = "lru-count"
        env["GPUFN_LRU_MAX_MODELS"] = str(lru_max if policy == "lru" else 1)
    return env


def wait_ready(client: Any, n: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        devs = client.status().get("devices", [])
        if len(devs) >= n and all(d["state"] == "ready" for d in devs):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{n} devices were not ready within {timeout:.0f}s")


def run_policy(policy: str, fns: list[Any], specs: list[ModelSpec],
               trace: list[tuple[float, int]], a: argparse.Namespace, lru_max: int) -> RunResult:
    import gpufn
    from gpufn import client as gclient

    os.environ.update(policy_env(policy, a, lru_max))
    res = RunResult(policy)
    client = gpufn.connect()
    cluster_pids: set[int] = set()
    sampler: Sampler | None = None
    try:
        wait_ready(client, a.devices)

        @gpufn.gpu
        def noop(i: int) -> int:
            return i

        list(noop.map(range(4 * a.devices)))  # workers warm (code cache, threads)
        for f in fns:  # code ships before the clock starts
            client.ensure_registered(f.register_message())
        cluster_pids = descendants(os.getpid())

        sampler = Sampler(client, a.sample_ms / 1000)
        n = len(trace)
        done_at = [math.nan] * n
        calls: list[Any] = [None] * n
        lag = 0.0
        t0 = time.perf_counter() + 0.2
        sampler.start()

        def stamp(i: int) -> Any:
            return lambda _f: done_at.__setitem__(i, time.perf_counter())

        for i, (at, m) in enumerate(trace):
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                lag = max(lag, -wait)
            calls[i] = fns[m].spawn(a.batch)
            calls[i]._future.add_done_callback(stamp(i))
        t_last = t0 + trace[-1][0]
        deadline = time.perf_counter() + a.drain_timeout
        for c in calls:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                c._future.result(left)
            except Exception:
                pass
        t_drained = time.perf_counter()
        sampler.stop.set()
        sampler.join()
        unfinished = [i for i, c in enumerate(calls) if not c.done()]
        for i in unfinished:
            calls[i].cancel()
        status = client.status()

        # -------------------------------------------------------------- outcomes
        # Requests arriving in the first --warmup of the trace fill the pool; cold starts,
        # latency and utilisation are measured on the rest (failures count everywhere).
        warm_at = a.warmup * trace[-1][0]
        open_ = set(unfinished)
        lat: list[float] = []
        cold: Counter[str] = Counter()
        measured = ok = 0
        for i, c in enumerate(calls):
            counted = trace[i][0] >= warm_at
            measured += counted
            if i in open_:
                continue
            try:
                c.get(timeout=0)
            except gpufn.OutOfMemory:
                res.errors["OutOfMemory"] += 1
            except Exception as e:
                res.errors[type(e).__name__] += 1
            else:
                ok += 1
                if counted:
                    lat.append(done_at[i] - (t0 + trace[i][0]))
            if not counted:
                continue
            try:
                cold[str(c.result_meta().get("cold_start") or "warm")] += 1
            except Exception:
                cold["unknown"] += 1
        censored = [t_drained - (t0 + trace[i][0]) for i in unfinished if trace[i][0] >= warm_at]
        allat = lat + censored

        # -------------------------------------------------------------- reloads
        loads = restores = 0
        load_s = restore_s = 0.0
        load_bytes = restore_bytes = 0
        saved = spent = 0.0  # loader seconds the restores stood in for / restore seconds
        for m in status.get("models", []):
            if m["loads"]:
                loads += m["loads"]
                load_s += m["loads"] * m["mean_load_s"]
                load_bytes += m["loads"] * m["bytes"]
            if m["restores"]:
                restores += m["restores"]
                restore_s += m["restores"] * m["mean_restore_s"]
                restore_bytes += m["restores"] * m["bytes"]
                if m["loads"]:
                    saved += m["restores"] * m["mean_load_s"]
                    spent += m["restores"] * m["mean_restore_s"]

        # -------------------------------------------------------------- utilisation
        under_load = [s for s in sampler.samples if t0 + warm_at <= s[0] <= t_last]
        util = [u / cap for _, u, cap, _, _ in under_load if cap]
        capped = [c / cap for _, _, cap, c, _ in under_load if cap]
        resident = [r / cap for _, _, cap, _, r in under_load if cap]
        peak = [u / cap for _, u, cap, _, _ in sampler.samples if cap]

        k = 1000 / max(1, measured)
        res.metrics = {
            "requests": n,
            "measured": measured,
            "ok": ok,
            "failed": sum(res.errors.values()),
            "unfinished": len(unfinished),
            "cold_loaded": cold["loaded"] * k,
            "cold_restored": cold["restored"] * k,
            "cold_total": (cold["loaded"] + cold["restored"]) * k,
            "waited": cold["waited"] * k,
            "lat_mean": statistics.fmean(allat) if allat else math.nan,
            "lat_p50": percentile(allat, 50),
            "lat_p99": percentile(allat, 99),
            "loads": loads,
            "load_mean_s": load_s / loads if loads else math.nan,
            "load_gbps": load_bytes / load_s / 1e9 if load_s else math.nan,
            "restores": restores,
            "restore_mean_s": restore_s / restores if restores else math.nan,
            "restore_gbps": restore_bytes / restore_s / 1e9 if restore_s else math.nan,
            "reload_ratio": saved / spent if spent else math.nan,
            "offloads": sum(m["offloads"] for m in status.get("models", [])),
            "evictions": sum(m["evictions"] for m in status.get("models", [])),
            "load_failures": sum(m["failures"] for m in status.get("models", [])),
            "swap_ms": (load_s + restore_s) / n * 1000,
            "util_mean": statistics.fmean(util) if util else math.nan,
            "util_capped": statistics.fmean(capped) if capped else math.nan,
            "util_resident": statistics.fmean(resident) if resident else math.nan,
            "util_peak": max(peak) if peak else math.nan,
            "samples": len(sampler.samples),
            "oom": res.errors["OutOfMemory"],
            "other_failures": sum(v for e, v in res.errors.items() if e != "OutOfMemory"),
            "submit_lag_ms": lag * 1000,
            "duration_s": t_drained - t0,
        }
    finally:
        if sampler is not None:
            sampler.stop.set()
        cluster_pids |= descendants(os.getpid())
        gclient._shutdown_default()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in cluster_pids):
            time.sleep(0.1)
        res.leftover = sorted(p for p in cluster_pids if alive(p))
    return res


# ---------------------------------------------------------------------------- report

def cell(vals: list[float], fmt: str, censored: bool = False) -> str:
    vals = [v for v in vals if not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "—"
    pre = ">=" if censored else ""
    if len(vals) == 1:
        return pre + format(vals[0], fmt)
    return f"{pre}{format(min(vals), fmt)} / {format(statistics.median(vals), fmt)}"


def med(results: list[RunResult], key: str) -> float:
    vals = [r.metrics[key] for r in results if not math.isnan(r.metrics.get(key, math.nan))]
    return statistics.median(vals) if vals else math.nan


def report(by_policy: dict[str, list[RunResult]], specs: list[ModelSpec],
           a: argparse.Namespace, lru_max: int) -> bool:
    from rich.console import Console
    from rich.table import Table

    con = Console() if sys.stdout.isatty() else Console(width=120)
    total = sum(s.nbytes for s in specs)
    pool = a.devices * a.device_memory_bytes
    sizes = sorted(s.nbytes for s in specs)
    reps = a.repeats
    title = (f"gpufn multi-model pool: {len(specs)} models {sizes[0] / MiB:.1f}-{sizes[-1] / MiB:.0f} "
             f"MiB ({total / MiB:,.0f} MiB = {total / pool:.1f}x the pool of {a.devices} x "
             f"{a.device_memory_bytes / MiB:.0f} MiB), Zipf({a.zipf:g}), Poisson {a.rate:g}/s, "
             f"{a.requests:,} requests, seed {a.seed}; rates and utilisation measured after "
             f"the first {a.warmup:.0%} of the trace; "
             + (f"{reps} runs, min / median" if reps > 1 else "1 run (--repeats for min / median)"))
    t = Table(title=title, title_justify="left")
    t.add_column("per policy")
    for pol in by_policy:
        name = LABEL[pol] + (f" (max {lru_max})" if pol == "lru" else "")
        t.add_column(name, justify="right")

    def row(label: str, key: str, fmt: str, censor: bool = False) -> None:
        cells = []
        for rs in by_policy.values():
            cen = censor and any(r.metrics.get("unfinished") for r in rs)
            cells.append(cell([r.metrics.get(key, math.nan) for r in rs], fmt, cen))
        t.add_row(label, *cells)

    row("completed ok", "ok", ",.0f")
    row("unfinished at drain timeout (cancelled)", "unfinished", ",.0f")
    row(f"requests measured (arrived after the first {a.warmup:.0%})", "measured", ",.0f")
    row("cold starts / 1k: loader ran", "cold_loaded", ".1f")
    row("cold starts / 1k: restored from host", "cold_restored", ".1f")
    row("cold starts / 1k: total", "cold_total", ".1f")
    row("  waited on another call's load / 1k", "waited", ".1f")
    row("latency mean, ok + unfinished calls (s)", "lat_mean", ".3f", censor=True)
    row("latency p50 (s)", "lat_p50", ".3f", censor=True)
    row("latency p99 (s)", "lat_p99", ".3f", censor=True)
    row("loader runs (whole run)", "loads", ",.0f")
    row("loader mean (s)", "load_mean_s", ".3f")
    row("loader throughput (GB/s)", "load_gbps", ".2f")
    row("host restores (whole run)", "restores", ",.0f")
    row("host restore mean (s)", "restore_mean_s", ".4f")
    row("host restore throughput (GB/s)", "restore_gbps", ".2f")
    row("reload speed-up: host vs loader, same models", "reload_ratio", ".1f")
    row("loader + restore time per request (ms)", "swap_ms", ".1f")
    row("offloads to host", "offloads", ",.0f")
    row("evictions (dropped)", "evictions", ",.0f")
    row("pool utilisation mean, under load (raw)", "util_mean", ".1%")
    row("  same, each device capped at 100%", "util_capped", ".1%")
    row("  resident model bytes only", "util_resident", ".1%")
    row("pool utilisation peak (raw)", "util_peak", ".1%")
    row("OOM (calls failing with OutOfMemory)", "oom", ",.0f")
    row("other failed calls", "other_failures", ",.0f")
    row("model load failures (status)", "load_failures", ",.0f")
    row("max submit lag behind schedule (ms)", "submit_lag_ms", ",.0f")
    row("run time incl. drain (s)", "duration_s", ".1f")
    con.print(t)

    for pol, rs in by_policy.items():
        errs = Counter[str]()
        for r in rs:
            errs.update(r.errors)
        if errs:
            con.print(f"  {LABEL[pol]} failures by type: {dict(errs)}")
        left = sorted({p for r in rs for p in r.leftover})
        if left:
            con.print(f"  [red]{LABEL[pol]}: processes left behind: {left}[/red]")

    # ------------------------------------------------------------------ targets
    ok = True
    lines = []

    def target(name: str, value: str, met: bool | None) -> None:
        nonlocal ok
        mark = "n/a" if met is None else ("[green]met[/green]" if met else "[red]NOT met[/red]")
        ok = ok and met is not False
        lines.append(f"  {name}: {value} -> {mark}")

    cost = by_policy.get("cost")
    lru = by_policy.get("lru")
    if cost:
        ooms = [r.metrics.get("oom", math.nan) for r in cost]
        target("zero OOMs for gpufn", f"{max(ooms):.0f} OOM(s) (max over runs)",
               all(o == 0 for o in ooms))
    if cost and lru:
        c, b = med(cost, "cold_total"), med(lru, "cold_total")
        fewer = 1 - c / b if b else math.nan
        target(">= 30% fewer cold starts than LRU-count (loader runs + host restores)",
               f"{c:.1f} vs {b:.1f} per 1k = {fewer:.0%} fewer", fewer >= 0.30)
        cl = med(cost, "cold_loaded")
        fewer_l = 1 - cl / b if b else math.nan
        target(">= 30% fewer cold starts than LRU-count (loader runs only)",
               f"{cl:.1f} vs {b:.1f} per 1k = {fewer_l:.0%} fewer", fewer_l >= 0.30)
    if cost:
        ratio = med(cost, "reload_ratio")
        target(">= 5x faster reload from host than from the loader",
               f"{ratio:.1f}x (loader time of the same models / host restore time)",
               None if math.isnan(ratio) else ratio >= 5)
        util, raw = med(cost, "util_capped"), med(cost, "util_mean")
        target(">= 80% mean pool utilisation under load",
               f"{util:.1%} (devices capped at 100%; raw ledger sum {raw:.1%})", util >= 0.80)
    con.print("[bold]Issue targets (gpufn default policy, medians):[/bold]")
    for line in lines:
        con.print(line)
    return ok


# ---------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from gpufn.spec import parse_memory

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--devices", type=int, default=2, help="simulated devices")
    ap.add_argument("--device-memory", default="256MiB", help="memory of each device")
    ap.add_argument("--models", type=int, default=0,
                    help="number of models (0: enough to weigh --total-ratio x the pool)")
    ap.add_argument("--total-ratio", type=float, default=3.0,
                    help="total model weights / pool, when --models is 0")
    ap.add_argument("--min-mib", type=float, default=2.0, help="smallest model (MiB)")
    ap.add_argument("--max-mib", type=float, default=200.0, help="largest model (MiB)")
    ap.add_argument("--requests", type=int, default=480, help="requests in the trace")
    ap.add_argument("--rate", type=float, default=6.0,
                    help="Poisson arrivals per second (the default keeps gpufn's policy out of "
                         "backlog on 2 CPU cores; raise it on bigger machines)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of popularity")
    ap.add_argument("--batch", type=int, default=8, help="rows per forward pass")
    ap.add_argument("--workspace", default="4MiB", help="@gpu(memory=...) of each call")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="@gpu(concurrency=...): calls of one function at once per device")
    ap.add_argument("--host-memory", default="2GiB",
                    help="GPUFN_HOST_OFFLOAD_MEMORY: host budget for offloaded models")
    ap.add_argument("--lru-max-models", type=int, default=0,
                    help="LRU-count models per device (0: how many average-size models fit)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated subset of {', '.join(POLICIES)}")
    ap.add_argument("--repeats", type=int, default=1, help="runs of the trace per policy")
    ap.add_argument("--seed", type=int, default=0, help="seeds model sizes, ranks and trace")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds to wait after the last arrival before cancelling the rest")
    ap.add_argument("--warmup", type=float, default=0.1,
                    help="fraction of the trace (by arrival time) left out of cold starts, "
                         "latency and mean utilisation while the pool fills")
    ap.add_argument("--sample-ms", type=float, default=100.0, help="status() sampling period")
    ap.add_argument("--slots", type=int, default=0,
                    help="GPUFN_SLOTS: calls running at once per device (0: gpufn's default)")
    ap.add_argument("--log-level", default=os.environ.get("GPUFN_LOG_LEVEL", "ERROR"),
                    help="GPUFN_LOG_LEVEL of the cluster (LRU-count OOMs log a warning each)")
    a = ap.parse_args(argv)
    a.device_memory_bytes = parse_memory(a.device_memory, "--device-memory")
    workspace = parse_memory(a.workspace, "--workspace")
    pols = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in pols if p not in POLICIES]
    if bad or not pols:
        ap.error(f"--policies: unknown {bad}; choose from {', '.join(POLICIES)}")
    a.policy_list = pols
    if not 0 < a.min_mib < a.max_mib:
        ap.error("--min-mib must be positive and below --max-mib")
    if a.max_mib * MiB + workspace > a.device_memory_bytes:
        ap.error(f"--max-mib {a.max_mib:g} plus the {a.workspace} workspace does not fit a "
                 f"{a.device_memory} device; lower it or raise --device-memory")
    if a.requests < 1 or a.rate <= 0 or a.repeats < 1 or a.devices < 1:
        ap.error("--requests, --rate, --repeats and --devices must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ["GPUFN_LOG_LEVEL"] = a.log_level
    pool = a.devices * a.device_memory_bytes
    n_models = a.models or model_count_for(pool, a.total_ratio, a.min_mib * MiB, a.max_mib * MiB)
    specs = plan_models(n_models, a.min_mib * MiB, a.max_mib * MiB, a.seed)
    mean_size = sum(s.nbytes for s in specs) / len(specs)
    lru_max = a.lru_max_models or max(1, int(a.device_memory_bytes // mean_size))
    trace = zipf_trace(a.requests, len(specs), a.rate, a.zipf, a.seed)
    models = [make_model(s) for s in specs]
    fns = [make_function(m, a.workspace, a.concurrency) for m in models]
    print(f"{len(specs)} models, {sum(s.nbytes for s in specs) / MiB:,.0f} MiB in all "
          f"(mean {mean_size / MiB:.1f} MiB); LRU-count max_models={lru_max}; trace of "
          f"{len(trace)} requests over {trace[-1][0]:.0f}s", file=sys.stderr)

    by_policy: dict[str, list[RunResult]] = {p: [] for p in a.policy_list}
    for rep in range(a.repeats):
        for pol in a.policy_list:
            t = time.perf_counter()
            try:
                r = run_policy(pol, fns, specs, trace, a, lru_max)
            except Exception as e:  # report the others; this run shows as failed
                traceback.print_exc()
                r = RunResult(pol, errors=Counter({f"bench run failed: {type(e).__name__}": 1}))
            by_policy[pol].append(r)
            m = r.metrics
            print(f"[{rep + 1}/{a.repeats}] {LABEL[pol]}: {m.get('ok', 0):,.0f} ok, "
                  f"{m.get('failed', 0):,.0f} failed, {m.get('unfinished', 0):,.0f} unfinished "
                  f"in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    report(by_policy, specs, a, lru_max)
    left = sorted({p for rs in by_policy.values() for r in rs for p in r.leftover})
    broken = any(not r.metrics for rs in by_policy.values() for r in rs)
    return 1 if left or broken else 0


if __name__ == "__main__":
    sys.exit(main())
