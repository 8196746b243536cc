"""Gang call overhead: a no-op `@gpu(count=4)` call on a warm gang vs the first (cold)
call of a new gang vs launching the same SPMD script with `torchrun --nproc-per-node 4`.

    python bench/gang.py [--repeats 5] [--world 4]

Cold = the first call after the gang's group was torn down (a failing rank breaks it),
on workers that are already running: a process-group init, no process start.
torchrun = starting 4 Python processes that import torch, init a gloo group, run the
same no-op and exit: what each call costs without a warm pool.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

SPMD_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
""")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--warm-calls", type=int, default=50)
    a = ap.parse_args()
    os.environ.setdefault("GPUFN_CPU_DEVICES", str(a.world))
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import torch
    import torch.distributed as dist

    import gpufn

    @gpufn.gpu(count=a.world, timeout=120)
    def noop() -> None:
        dist.all_reduce(torch.ones(1))

    client = gpufn.connect()
    deadline = time.monotonic() + 120
    while any(d["state"] != "ready" for d in client.status()["devices"]):
        if time.monotonic() > deadline:
            raise SystemExit("workers did not start")
        time.sleep(0.1)

    cold, warm, launch = [], [], []
    for r in range(a.repeats):
        # cold: abort the warm group by running a gang whose rank fails, then time the next call
        @gpufn.gpu(count=a.world, timeout=120)
        def breaker() -> None:
            if gpufn.context().rank == 0:
                raise RuntimeError("break the group")
            dist.all_reduce(torch.ones(1))

        try:
            breaker.remote()
        except RuntimeError:
            pass
        t = time.perf_counter()
        noop.remote()
        cold.append(time.perf_counter() - t)
        samples = []
        for _ in range(a.warm_calls):
            t = time.perf_counter()
            noop.remote()
            samples.append(time.perf_counter() - t)
        warm.append(statistics.median(samples))
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(SPMD_SCRIPT)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={a.world}", f.name], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        launch.append(time.perf_counter() - t)
        os.unlink(f.name)
        print(f"round {r + 1}/{a.repeats} done", file=sys.stderr)

    from rich.console import Console
    from rich.table import Table

    def ms(v: list[float]) -> str:
        return f"{min(v) * 1e3:,.1f} / {statistics.median(v) * 1e3:,.1f}"

    t = Table(title=f"no-op gang call, world size {a.world} ({a.repeats} runs, min / median ms; "
                    f"{os.cpu_count()} cores, gloo on simulated devices)")
    t.add_column("path")
    t.add_column("ms", justify="right")
    t.add_column("vs warm (median)", justify="right")
    mw = statistics.median(warm)
    t.add_row("gpufn warm gang (no init)", ms(warm), "1x")
    t.add_row("gpufn cold gang (group init)", ms(cold), f"{statistics.median(cold) / mw:,.0f}x")
    t.add_row(f"torchrun --nproc-per-node {a.world}", ms(launch), f"{statistics.median(launch) / mw:,.0f}x")
    Console().print(t)


if __name__ == "__main__":
    main()
