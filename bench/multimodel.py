"""Many models sharing a small device pool: gpufn's cost-aware pool vs fair LRU
baselines, ablations and static placement (and Ray Serve's own multiplexing when it is
installed), on the SAME trace, in one run.

Workload: 20+ torch MLPs (CPU; sizes log-uniform over two orders of magnitude) weighing
about 3x the pool (devices x device memory), a Zipf(1.0) popularity over them and
Poisson arrivals, submitted open loop at their scheduled times (latency = completion -
scheduled arrival). Each model's seeded weights are written once to a safetensors file
in a temp dir; its loader reads that file (no random init, no downloads). Each call runs
a small forward pass on its model.

Policies (each on a fresh embedded cluster, torn down between runs):
  * cost            gpufn's default: byte-accurate admission, Greedy-Dual-Size-Frequency
                    eviction, host tier (offload/restore) within the host budget;
  * cost-nohost     ablation: the same policy without the host tier (cost:no-host);
  * lru-bytes       the fair LRU baseline: least recently used first, byte-accurate
                    admission (never over-commits), no host tier;
  * lru-bytes-host  ablation: LRU-bytes with the same host tier as cost (lru-bytes:host);
  * lru             LRU by model count (Ray Serve's rule re-implemented in gpufn):
                    --lru-max-models per device, bytes ignored (over-commits), no host tier;
  * static          one model per device (lru-count with max_models=1, no host tier);
  * ray             Ray Serve's own @serve.multiplexed (the real anchor for `lru`): one
                    replica per device, max_num_models_per_replica = the LRU-count limit,
                    the same loaders; a load that takes a replica's cached model bytes
                    plus the call's workspace over --device-memory fails as an (emulated)
                    OOM (models Ray evicted while calls still used them are not counted,
                    which errs in Ray's favour). Runs only when `ray[serve]` is importable.

The host budget defaults to half the total weights (--host-fraction), so the host tier
cannot hold everything and the eviction policy matters there too.

Reported per policy: cold starts per 1,000 requests (loader runs and host restores,
separately), mean/p50/p99 latency, loader vs host-restore time and their ratio, peak
and mean pool utilisation (status() sampled every --sample-ms: sum used / sum
capacity), OOMs (calls failing with gpufn.OutOfMemory) and other failures; then each
policy's effect on its own (the eviction rule with and without the host tier, the host
tier under each rule, byte-accurate admission) and the issue's targets. With --repeats
N each cell is "min / median" over N runs of the trace.

    python bench/multimodel.py [--requests 480 --rate 6 --repeats 3 --seed 0]
    python bench/multimodel.py --quick        # a short smoke run, 1 run (about 5 minutes)

The defaults take about 1.5 minutes per policy and run on a 2-core CPU machine (7
policies x 3 runs: about 30 minutes; Ray Serve's start adds a minute per run); the
request rate is the knob to raise where there are more cores.
"""

from __future__ import annotations

import argparse
import logging
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
    make_loader,
    make_model,
    model_count_for,
    percentile,
    plan_models,
    write_weights,
    zipf_trace,
)

POLICIES = ("cost", "cost-nohost", "lru-bytes", "lru-bytes-host", "lru", "static", "ray")
GPUFN_POLICY = {"cost": "cost", "cost-nohost": "cost:no-host", "lru-bytes": "lru-bytes",
                "lru-bytes-host": "lru-bytes:host", "lru": "lru-count", "static": "lru-count"}
LABEL = {"cost": "gpufn cost+host", "cost-nohost": "cost, no host", "lru-bytes": "LRU-bytes",
         "lru-bytes-host": "LRU-bytes+host", "lru": "LRU-count", "static": "static 1/dev",
         "ray": "Ray Serve mux"}


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
        "GPUFN_HOST_OFFLOAD_MEMORY": str(a.host_memory_bytes),
        "GPUFN_PROGRESS": "0",
        "GPUFN_EVICTION_POLICY": GPUFN_POLICY[policy],
    }
    if a.slots:
        env["GPUFN_SLOTS"] = str(a.slots)
    if policy in ("lru", "static"):
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
    from gpufn.client import default as gclient

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


# ---------------------------------------------------------------------------- Ray Serve

def ray_available() -> str | None:
    """None if Ray Serve can run here, else why not."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"{type(e).__name__}: {e}"
    return None


def run_ray(specs: list[ModelSpec], loaders: list[Any], trace: list[tuple[float, int]],
            a: argparse.Namespace, lru_max: int) -> RunResult:
    """The same trace through Ray Serve's @serve.multiplexed: one replica per device,
    at most `lru_max` models each (its LRU), the same loaders and forward pass."""
    import asyncio
    import contextvars

    import ray
    import torch
    from ray import serve

    res = RunResult("ray")
    sizes = [s.nbytes for s in specs]
    device_memory, workspace = a.device_memory_bytes, a.workspace_bytes
    threads = torch.get_num_threads()  # what a gpufn worker gets by default
    before = descendants(os.getpid())
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    ray.init(num_cpus=max(2, a.devices), include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, object_store_memory=256 * MiB)
    try:
        serve.start(http_options={"location": "NoServer"}, logging_config={"log_level": "ERROR"})

        class Held:
            """A cached model; Ray calls __del__ when its LRU evicts it (and Python may
            call it again at collection: only the entry it owns is removed)."""

            def __init__(self, model: Any, mid: str, nbytes: int,
                         resident: dict[str, Any]) -> None:
                self.model, self.mid, self.nbytes, self.resident = model, mid, nbytes, resident
                resident[mid] = self

            def __del__(self) -> None:
                if self.resident.get(self.mid) is self:
                    del self.resident[self.mid]

        @serve.deployment(num_replicas=a.devices, max_ongoing_requests=a.slots or 8,
                          ray_actor_options={"num_cpus": 0})
        class Pool:
            def __init__(self) -> None:
                torch.set_num_threads(threads)
                self.resident: dict[str, Any] = {}  # model id -> Held, while Ray caches it
                # the loader's seconds, seen by the call whose get_model ran it
                self.loaded: contextvars.ContextVar[float] = contextvars.ContextVar(
                    "loaded", default=0.0)

            @serve.multiplexed(max_num_models_per_replica=lru_max)
            async def get_model(self, mid: str) -> Held:
                i = int(mid)
                # Ray has already evicted its LRU model if the count was full; bytes are
                # not looked at, so a device of this size would run out of memory here
                if self.resident_bytes() + sizes[i] + workspace > device_memory:
                    raise RuntimeError(
                        f"OutOfMemory (emulated): model {mid} of {sizes[i]} bytes beside "
                        f"{self.resident_bytes()} resident on a {device_memory}-byte device")
                t = time.perf_counter()
                model = await asyncio.to_thread(loaders[i])
                self.loaded.set(time.perf_counter() - t)
                return Held(model, mid, sizes[i], self.resident)

            def resident_bytes(self) -> int:
                return sum(h.nbytes for h in self.resident.values())

            async def __call__(self, batch: int) -> tuple[float, float, int, int]:
                self.loaded.set(0.0)
                held = await self.get_model(serve.get_multiplexed_model_id())
                load_s = self.loaded.get()

                def forward() -> float:
                    m = held.model
                    with torch.inference_mode():
                        return float(m(torch.ones(batch, m[0].in_features))[0, 0])

                y = await asyncio.to_thread(forward)
                return y, load_s, os.getpid(), self.resident_bytes()

        handle = serve.run(Pool.bind(), name="multimodel",  # type: ignore[attr-defined]
                           route_prefix=None)

        n = len(trace)
        done_at = [math.nan] * n
        outcome: list[Any] = [None] * n  # (value, load_s, pid, resident) or an exception
        latest: dict[int, int] = {}
        samples: list[tuple[float, int]] = []

        async def drive() -> tuple[float, float, float]:
            t0 = time.perf_counter() + 0.5
            t_end = t0 + trace[-1][0] + a.drain_timeout
            lag = 0.0

            async def one(i: int, at: float, m: int) -> None:
                nonlocal lag
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                else:
                    lag = max(lag, -wait)
                try:
                    r = await asyncio.wait_for(
                        handle.options(multiplexed_model_id=str(m)).remote(a.batch),
                        max(0.1, t_end - time.perf_counter()))
                except asyncio.TimeoutError:
                    return
                except Exception as e:
                    outcome[i] = e
                else:
                    outcome[i] = r
                    latest[r[2]] = r[3]
                done_at[i] = time.perf_counter()

            async def sample() -> None:
                while True:
                    samples.append((time.perf_counter(), sum(latest.values())))
                    await asyncio.sleep(a.sample_ms / 1000)

            sampler = asyncio.ensure_future(sample())
            await asyncio.gather(*(one(i, at, m) for i, (at, m) in enumerate(trace)))
            sampler.cancel()
            return t0, time.perf_counter(), lag

        t0, t_drained, lag = asyncio.run(drive())
        warm_at = a.warmup * trace[-1][0]
        t_last = t0 + trace[-1][0]
        lat: list[float] = []
        cold = measured = ok = unfinished = 0
        load_times: list[float] = []
        for i, out in enumerate(outcome):
            counted = trace[i][0] >= warm_at
            measured += counted
            if out is None:
                unfinished += 1
                if counted:
                    lat.append(t_drained - (t0 + trace[i][0]))
                continue
            if isinstance(out, BaseException):
                res.errors["OutOfMemory" if "OutOfMemory" in str(out) else type(out).__name__] += 1
                continue
            ok += 1
            if out[1] > 0:
                load_times.append(out[1])
            if counted:
                lat.append(done_at[i] - (t0 + trace[i][0]))
                cold += out[1] > 0
        pool = a.devices * device_memory
        resident = [r / pool for t, r in samples if t0 + warm_at <= t <= t_last]
        k = 1000 / max(1, measured)
        nan = math.nan
        res.metrics = {
            "requests": n, "measured": measured, "ok": ok,
            "failed": sum(res.errors.values()), "unfinished": unfinished,
            "cold_loaded": cold * k, "cold_restored": 0.0, "cold_total": cold * k,
            "waited": nan,
            "lat_mean": statistics.fmean(lat) if lat else nan,
            "lat_p50": percentile(lat, 50), "lat_p99": percentile(lat, 99),
            "loads": len(load_times),
            "load_mean_s": statistics.fmean(load_times) if load_times else nan,
            "load_gbps": nan, "restores": 0, "restore_mean_s": nan, "restore_gbps": nan,
            "reload_ratio": nan, "offloads": 0, "evictions": nan, "load_failures": nan,
            "swap_ms": sum(load_times) / n * 1000,
            "util_mean": nan, "util_capped": nan,
            "util_resident": statistics.fmean(resident) if resident else nan,
            "util_peak": nan, "samples": len(samples),
            "oom": res.errors["OutOfMemory"],
            "other_failures": sum(v for e, v in res.errors.items() if e != "OutOfMemory"),
            "submit_lag_ms": lag * 1000, "duration_s": t_drained - t0,
        }
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        mine = descendants(os.getpid()) - before
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in mine):
            time.sleep(0.1)
        res.leftover = sorted(p for p in mine if alive(p))
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

    con = Console() if sys.stdout.isatty() else Console(width=50 + 16 * len(by_policy))
    total = sum(s.nbytes for s in specs)
    pool = a.devices * a.device_memory_bytes
    sizes = sorted(s.nbytes for s in specs)
    reps = a.repeats
    title = (f"gpufn multi-model pool: {len(specs)} models {sizes[0] / MiB:.1f}-{sizes[-1] / MiB:.0f} "
             f"MiB ({total / MiB:,.0f} MiB = {total / pool:.1f}x the pool of {a.devices} x "
             f"{a.device_memory_bytes / MiB:.0f} MiB), Zipf({a.zipf:g}), Poisson {a.rate:g}/s, "
             f"{a.requests:,} requests, seed {a.seed}; host budget "
             f"{a.host_memory_bytes / MiB:,.0f} MiB = {a.host_memory_bytes / total:.0%} of the "
             f"weights; loaders read safetensors files"
             f"{' (page cache dropped first)' if a.drop_file_cache else ''}; "
             f"rates and utilisation measured after "
             f"the first {a.warmup:.0%} of the trace; "
             + (f"{reps} runs, min / median" if reps > 1 else "1 run (--repeats for min / median)"))
    t = Table(title=title, title_justify="left")
    t.add_column("per policy")
    for pol in by_policy:
        name = LABEL[pol] + (f" (max {lru_max})" if pol in ("lru", "ray") else "")
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

    # ------------------------------------------------------------------ effects
    def effect(title: str, new: str, old: str) -> None:
        """One change at a time: `new` vs `old`, medians."""
        if new not in by_policy or old not in by_policy:
            return
        n, o = by_policy[new], by_policy[old]
        parts = []
        for key, what, fmt in (("cold_loaded", "loader runs/1k", ".1f"),
                               ("cold_restored", "host restores/1k", ".1f"),
                               ("cold_total", "cold starts/1k", ".1f"),
                               ("oom", "OOMs", ".0f"),
                               ("lat_mean", "latency mean s", ".3f"),
                               ("lat_p99", "p99 s", ".3f"),
                               ("util_resident", "resident util", ".1%")):
            x, y = med(n, key), med(o, key)
            if math.isnan(x) and math.isnan(y):
                continue
            change = f" ({x / y - 1:+.0%})" if y and not math.isnan(x) and not math.isnan(y) \
                and "util" not in key and key != "oom" else ""
            parts.append(f"{what} {format(x, fmt)} vs {format(y, fmt)}{change}")
        con.print(f"  [bold]{title}[/bold] ({LABEL[new]} vs {LABEL[old]}): " + "; ".join(parts))

    con.print("[bold]Each change on its own (medians):[/bold]")
    effect("eviction rule, no host tier", "cost-nohost", "lru-bytes")
    effect("eviction rule, with the host tier", "cost", "lru-bytes-host")
    effect("host tier, under the cost rule", "cost", "cost-nohost")
    effect("host tier, under LRU", "lru-bytes-host", "lru-bytes")
    effect("byte-accurate admission (LRU)", "lru-bytes", "lru")
    effect("gpufn's LRU-count vs Ray Serve's own (same rule)", "lru", "ray")
    effect("the whole of gpufn vs Ray Serve multiplexing", "cost", "ray")
    effect("the whole of gpufn vs the fair LRU baseline", "cost", "lru-bytes")

    # ------------------------------------------------------------------ targets
    ok = True
    lines = []

    def target(name: str, value: str, met: bool | None) -> None:
        nonlocal ok
        mark = "n/a" if met is None else ("[green]met[/green]" if met else "[red]NOT met[/red]")
        ok = ok and met is not False
        lines.append(f"  {name}: {value} -> {mark}")

    def fewer(base: str, key: str, what: str) -> None:
        if "cost" not in by_policy or base not in by_policy:
            return
        c, b = med(by_policy["cost"], key), med(by_policy[base], "cold_total")
        f = 1 - c / b if b else math.nan
        target(f">= 30% fewer cold starts than {LABEL[base]} ({what})",
               f"{c:.1f} vs {b:.1f} per 1k = {f:.0%} fewer", f >= 0.30)

    cost = by_policy.get("cost")
    if cost:
        ooms = [r.metrics.get("oom", math.nan) for r in cost]
        target("zero OOMs for gpufn", f"{max(ooms):.0f} OOM(s) (max over runs)",
               all(o == 0 for o in ooms))
    # the fair comparisons first: the same tiers, then gpufn whole vs plain LRU-bytes
    fewer("lru-bytes-host", "cold_total", "loader runs + host restores, both with the host tier")
    fewer("lru-bytes", "cold_total", "loader runs + host restores vs LRU-bytes' loader runs")
    fewer("lru-bytes", "cold_loaded", "loader runs only")
    fewer("ray", "cold_total", "loader runs + host restores vs Ray Serve's loads")
    fewer("lru", "cold_total", "loader runs + host restores; LRU-count over-commits")
    if cost:
        ratio = med(cost, "reload_ratio")
        target(">= 5x faster reload from host than from the loader (safetensors file)",
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
    from gpufn.wire.units import parse_memory

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
    ap.add_argument("--host-memory", default="",
                    help="GPUFN_HOST_OFFLOAD_MEMORY: host budget for offloaded models "
                         "(default: --host-fraction of the total weights)")
    ap.add_argument("--host-fraction", type=float, default=0.5,
                    help="host budget / total model weights, when --host-memory is not given")
    ap.add_argument("--drop-file-cache", action="store_true",
                    help="loaders drop their file's page cache first (read from disk)")
    ap.add_argument("--quick", action="store_true",
                    help="a short smoke run: 128 MiB devices, 8-48 MiB models weighing 2x the pool, "
                         "100 requests at 5/s, short drain")
    ap.add_argument("--lru-max-models", type=int, default=0,
                    help="LRU-count models per device (0: how many average-size models fit)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated subset of {', '.join(POLICIES)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the trace per policy")
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
    if a.quick:
        a.device_memory, a.min_mib, a.max_mib = "128MiB", 8.0, 48.0
        a.requests, a.rate, a.drain_timeout, a.sample_ms = 100, 5.0, 15.0, 200.0
        a.total_ratio, a.repeats = 2.0, 1
    a.device_memory_bytes = parse_memory(a.device_memory, "--device-memory")
    a.workspace_bytes = workspace = parse_memory(a.workspace, "--workspace")
    if a.host_fraction <= 0:
        ap.error("--host-fraction must be positive")
    pols = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in pols if p not in POLICIES]
    if bad or not pols:
        ap.error(f"--policies: unknown {bad}; choose from {', '.join(POLICIES)}")
    if "ray" in pols:
        why = ray_available()
        if why is not None:
            print(f"note: skipping Ray Serve's @serve.multiplexed (pip install 'ray[serve]' to "
                  f"run it): {why}", file=sys.stderr)
            pols.remove("ray")
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
    import tempfile

    from gpufn.wire.units import parse_memory

    a = parse_args(argv)
    os.environ["GPUFN_LOG_LEVEL"] = a.log_level
    pool = a.devices * a.device_memory_bytes
    n_models = a.models or model_count_for(pool, a.total_ratio, a.min_mib * MiB, a.max_mib * MiB)
    specs = plan_models(n_models, a.min_mib * MiB, a.max_mib * MiB, a.seed)
    total = sum(s.nbytes for s in specs)
    a.host_memory_bytes = (parse_memory(a.host_memory, "--host-memory") if a.host_memory
                           else int(a.host_fraction * total))
    mean_size = total / len(specs)
    lru_max = a.lru_max_models or max(1, int(a.device_memory_bytes // mean_size))
    trace = zipf_trace(a.requests, len(specs), a.rate, a.zipf, a.seed)
    with tempfile.TemporaryDirectory(prefix="gpufn-bench-weights-") as weights:
        t = time.perf_counter()
        written = write_weights(specs, weights)
        loaders = [make_loader(s, weights, a.drop_file_cache) for s in specs]
        fns = [make_function(make_model(s, ld), a.workspace, a.concurrency)
               for s, ld in zip(specs, loaders, strict=True)]
        print(f"{len(specs)} models, {total / MiB:,.0f} MiB in all (mean {mean_size / MiB:.1f} "
              f"MiB; {written / MiB:,.0f} MiB of safetensors written in "
              f"{time.perf_counter() - t:.1f}s); host budget {a.host_memory_bytes / MiB:,.0f} "
              f"MiB; LRU-count max_models={lru_max}; trace of {len(trace)} requests over "
              f"{trace[-1][0]:.0f}s", file=sys.stderr)

        by_policy: dict[str, list[RunResult]] = {p: [] for p in a.policy_list}
        for rep in range(a.repeats):
            for pol in a.policy_list:
                t = time.perf_counter()
                try:
                    if pol == "ray":
                        r = run_ray(specs, loaders, trace, a, lru_max)
                    else:
                        r = run_policy(pol, fns, specs, trace, a, lru_max)
                except Exception as e:  # report the others; this run shows as failed
                    traceback.print_exc()
                    r = RunResult(pol, errors=Counter({f"bench run failed: {type(e).__name__}": 1}))
                by_policy[pol].append(r)
                m = r.metrics
                print(f"[{rep + 1}/{a.repeats}] {LABEL[pol]}: {m.get('ok', 0):,.0f} ok, "
                      f"{m.get('failed', 0):,.0f} failed, {m.get('unfinished', 0):,.0f} "
                      f"unfinished in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    report(by_policy, specs, a, lru_max)
    left = sorted({p for rs in by_policy.values() for r in rs for p in r.leftover})
    broken = any(not r.metrics for rs in by_policy.values() for r in rs)
    return 1 if left or broken else 0


if __name__ == "__main__":
    sys.exit(main())
