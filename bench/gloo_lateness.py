"""What one late rank costs a gloo all_reduce: no gpufn, four processes and a warm group.

    python bench/gloo_lateness.py [--calls 1000] [--world 4] [--late-us 0 100 300 1000]
                                  [--everyone]

Each rank runs `--calls` one-element all_reduces back to back; before each, the last rank
(with `--everyone`, every rank) busy-works for `--late-us` microseconds (the Python a gpufn worker runs between a Run's
arrival and the user's collective stands for it). Printed per lateness: wall time per
call, and each rank's CPU per call split into its main thread and gloo's threads. On
torch 2.13's TCP transport the late rank's `gloo_tcp_loop` thread spins while its peers'
data waits for its receive, so on a host with fewer cores than ranks a little lateness
costs a lot (see docs/performance.md, warm gangs).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time
from typing import Any


def thread_cpu() -> dict[str, float]:
    """This process's CPU seconds by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if tid == str(os.getpid()):
            name = "main"
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def rank(r: int, world: int, port: int, late_s: float, calls: int, everyone: bool,
         out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r,
                            world_size=world)
    t = torch.ones(1)
    for _ in range(20):
        dist.all_reduce(t)
    late = late_s if everyone or r == world - 1 else 0.0
    before = thread_cpu()
    w0 = time.perf_counter()
    for _ in range(calls):
        if late:
            until = time.perf_counter() + late
            while time.perf_counter() < until:
                pass
        dist.all_reduce(t)
    wall = (time.perf_counter() - w0) / calls
    after = thread_cpu()
    cpu = {k: (v - before.get(k, 0.0)) / calls for k, v in after.items()}
    out.put((r, wall, cpu))
    dist.destroy_process_group()


def run(world: int, late_s: float, calls: int, everyone: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    procs = [spawn.Process(target=rank, args=(r, world, port, late_s, calls, everyone, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(q.get() for _ in procs)
    for p in procs:
        p.join()
    wall = max(w for _, w, _ in results)
    who = "every rank" if everyone else "last rank"
    print(f"{who} {late_s * 1e6:5.0f} us late: {wall * 1e3:.2f} ms per call "
          f"(load {os.getloadavg()[0]:.1f})")
    for r, _, cpu in results:
        main = cpu.get("main", 0.0)
        loop = cpu.get("gloo_tcp_loop", 0.0)
        rest = sum(cpu.values()) - main - loop
        print(f"  rank {r}: main thread {main * 1e6:5.0f} us, gloo_tcp_loop {loop * 1e6:5.0f} us, "
              f"other threads {rest * 1e6:5.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--late-us", type=float, nargs="+", default=[0, 100, 300, 1000])
    ap.add_argument("--everyone", action="store_true",
                    help="every rank busy-works before each call, not only the last")
    a = ap.parse_args()
    for late in a.late_us:
        run(a.world, late / 1e6, a.calls, a.everyone)


if __name__ == "__main__":
    main()
