"""Where a leased no-op `.map` spends its CPU: each process's CPU time per call, in one run.

An embedded cluster (--devices simulated devices); each round maps --n no-ops and reads
every process's CPU time from /proc before and after: the client (its map thread and I/O
thread together), the workers (summed), the scheduler. It prints calls/s, the share of
calls that went under a lease and the CPU per call of each, min / median over --rounds.
The CPU per call says what the rate cannot on a noisy 2-core machine: whether a change
made the path cheaper. With --ray it also maps --n no-op Ray tasks per round (Ray started
and stopped around them, gpufn's cluster stopped meanwhile) and prints the ratio.

    python bench/map_cpu.py [--devices 2] [--n 20000] [--rounds 5] [--ray]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import descendants


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def role(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        cmd = f.read()
    if "gpufn.scheduler" in cmd:
        return "scheduler"
    if "supervisor" in cmd:
        return "supervisor"
    return "workers" if "gpufn.worker" in cmd else "other"


def gpufn_rounds(a: argparse.Namespace) -> dict[str, list[float]]:
    import gpufn
    from gpufn.client import default as gclient

    @gpufn.gpu
    def noop(x: int) -> None:
        return None

    client = gpufn.connect()
    list(noop.map(range(2000)))  # warm: the workers up, leases granted
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("calls/s", "leased", "client", "workers", "scheduler")}
    me = os.getpid()
    try:
        for r in range(a.rounds):
            pids = [me, *sorted(descendants(me))]
            before = {p: cpu_seconds(p) for p in pids}
            direct = client.leases.direct_calls
            t = time.perf_counter()
            list(noop.map(range(a.n)))
            dt = time.perf_counter() - t
            per = dict.fromkeys(("client", "workers", "scheduler", "supervisor", "other"), 0.0)
            for p in pids:
                per["client" if p == me else role(p)] += (cpu_seconds(p) - before[p]) / a.n * 1e6
            rows["calls/s"].append(a.n / dt)
            rows["leased"].append((client.leases.direct_calls - direct) / a.n)
            for k in ("client", "workers", "scheduler"):
                rows[k].append(per[k])
            print(f"round {r + 1}/{a.rounds}: {a.n / dt:,.0f} calls/s, "
                  f"{rows['leased'][-1]:.0%} leased; CPU per call: client {per['client']:.0f}, "
                  f"workers {per['workers']:.0f}, scheduler {per['scheduler']:.0f} us",
                  flush=True)
    finally:
        gclient._shutdown_default()
    return rows


def ray_rounds(a: argparse.Namespace) -> list[float]:
    import ray

    ray.init(num_cpus=a.devices, include_dashboard=False, logging_level="ERROR")
    try:
        @ray.remote
        def noop(x: int) -> None:
            return None

        ray.get([noop.remote(i) for i in range(2000)])
        out = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            ray.get([noop.remote(i) for i in range(a.n)])
            out.append(a.n / (time.perf_counter() - t))
        return out
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--n", type=int, default=20_000, help="no-op calls per map")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ray", action="store_true", help="also Ray tasks, for the ratio")
    a = ap.parse_args()
    os.environ["GPUFN_CPU_DEVICES"] = str(a.devices)
    os.environ.setdefault("GPUFN_PROGRESS", "0")
    rows = gpufn_rounds(a)

    def mm(v: list[float], fmt: str = ",.0f") -> str:
        return f"{min(v):{fmt}} / {statistics.median(v):{fmt}}"

    print(f"\nleased no-op .map of {a.n:,} calls, {a.devices} devices (min / median of "
          f"{a.rounds} rounds)")
    print(f"  calls/s              {mm(rows['calls/s'])}")
    print(f"  calls under a lease  {mm([x * 100 for x in rows['leased']], '.0f')} %")
    for k in ("client", "workers", "scheduler"):
        print(f"  CPU per call, {k:<9} {mm(rows[k])} us")
    total = [sum(x) for x in zip(rows["client"], rows["workers"], rows["scheduler"], strict=True)]
    print(f"  CPU per call, in all  {mm(total)} us")
    if a.ray:
        ray_rates = ray_rounds(a)
        print(f"  Ray tasks/s          {mm(ray_rates)}  (gpufn {statistics.median(rows['calls/s']) / statistics.median(ray_rates):.2f}x at the medians)")


if __name__ == "__main__":
    main()
