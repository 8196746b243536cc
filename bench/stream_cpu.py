"""CPU per streamed value, per process: the client (this process), the scheduler and the
worker of the embedded cluster, each one's threads read from /proc/<pid>/task/*/stat
before and after bursts of `--burst` values with no step (what `bench/stream.py` times).

    python bench/stream_cpu.py [--burst 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator

os.environ.setdefault("GPUFN_CPU_DEVICES", "1")
os.environ.setdefault("GPUFN_PROGRESS", "0")

import psutil

import gpufn

TICKS = os.sysconf("SC_CLK_TCK")


@gpufn.gpu
def tokens(n: int) -> Iterator[int]:
    yield from range(n)


def cpu_seconds(pid: int) -> dict[str, float]:
    """user + system seconds of each thread of `pid`, by '<name>#<tid>'."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}#{tid}"] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    gpufn.connect()
    list(tokens.remote_gen(100))  # warm: code on the worker
    me = psutil.Process()
    procs = {"client": me.pid}
    for child in me.children(recursive=True):
        cmd = " ".join(child.cmdline())
        if "gpufn.scheduler" in cmd:
            procs["scheduler"] = child.pid
        elif "--device" in cmd:
            procs["worker"] = child.pid
    spent: dict[str, dict[str, float]] = {name: {} for name in procs}
    values, took = 0, 0.0
    for _ in range(a.repeats):
        before = {name: cpu_seconds(pid) for name, pid in procs.items()}
        t0 = time.perf_counter()
        values += sum(1 for _ in tokens.remote_gen(a.burst))
        took += time.perf_counter() - t0
        for name, pid in procs.items():
            for thread, s in cpu_seconds(pid).items():
                kind = thread.split("#")[0]
                spent[name][kind] = spent[name].get(kind, 0.0) + s - before[name].get(thread, 0.0)
    print(f"{values / took:,.0f} values/s over {a.repeats} bursts of {a.burst:,}; "
          "CPU µs per value (threads by OS name):")
    for name, threads in spent.items():
        total = sum(threads.values())
        parts = ", ".join(f"{k} {v / values * 1e6:.1f}" for k, v in
                          sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0)
        print(f"  {name:9s} {total / values * 1e6:5.1f}  ({parts})")


if __name__ == "__main__":
    main()
