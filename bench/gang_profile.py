"""Where a warm gang call's CPU goes: per process and per thread, gpufn against the
hand-driven group of `bench/gang.py`, with the gang's body varied.

    python bench/gang_profile.py [--calls 1000] [--world 4] [--body all_reduce|none|sleep]

Each process's threads are read from /proc/<pid>/task/*/stat before and after `--calls`
back-to-back calls (Linux; microseconds of CPU per call, all of a process's Python threads
under "python", its main thread marked "*"). `--body none` runs the same warm gang with no
collective (gpufn's own machinery: client, scheduler, four ranks joining the warm group);
`--body sleep` sleeps `--sleep-ms` instead (how the others' CPU per call grows with the
call's length alone on a shared machine). The hand-driven group always runs an all_reduce.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import connect_ready
from gang import WarmGroup

TICK = os.sysconf("SC_CLK_TCK")


def thread_ticks(pids: dict[int, str]) -> dict[tuple[str, str], int]:
    """(process label, thread label) -> CPU ticks so far."""
    out: dict[tuple[str, str], int] = {}
    for pid, label in pids.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            name = comm + ("*" if tid == str(pid) else "")
            key = (label, name)
            out[key] = out.get(key, 0) + int(fields[11]) + int(fields[12])
    return out


def measure(label: str, call: Callable[[], None], pids: dict[int, str], calls: int) -> None:
    for _ in range(20):
        call()
    before = thread_ticks(pids)
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    after = thread_ticks(pids)
    print(f"\n{label}: p50 {statistics.median(samples) * 1e3:.2f} ms, min "
          f"{min(samples) * 1e3:.2f} ms, load {os.getloadavg()[0]:.1f}")
    per: dict[str, dict[str, float]] = {}
    for (proc, thread), ticks in after.items():
        us = (ticks - before.get((proc, thread), 0)) / TICK / calls * 1e6
        if us > 0:
            per.setdefault(proc, {})[thread] = us
    total = 0.0
    for proc in sorted(per):
        threads = per[proc]
        sub = sum(threads.values())
        total += sub
        parts = ", ".join(f"{t} {v:.0f}" for t, v in sorted(threads.items(), key=lambda x: -x[1]))
        print(f"  {proc:10s} {sub:6.0f} us/call  ({parts})")
    print(f"  {'all':10s} {total:6.0f} us/call")


def labels(root: int) -> dict[int, str]:
    import psutil

    out = {root: "caller"}
    hand = 0
    for child in psutil.Process(root).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "--device" in cmd:
            out[child.pid] = "rank " + cmd[cmd.index("--device") + 1]
        elif any("scheduler" in c for c in cmd):
            out[child.pid] = "scheduler"
        elif any("supervisor" in c for c in cmd):
            out[child.pid] = "supervisor"
        elif any("multiprocessing" in c for c in cmd):  # the hand-driven group's
            out[child.pid] = f"hand proc {hand}"
            hand += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--body", choices=("all_reduce", "none", "sleep"), default="all_reduce")
    ap.add_argument("--sleep-ms", type=float, default=3.0)
    a = ap.parse_args()
    os.environ.setdefault("GPUFN_CPU_DEVICES", str(a.world))
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import torch
    import torch.distributed as dist

    import gpufn

    body, pause = a.body, a.sleep_ms / 1e3

    @gpufn.gpu(count=a.world, timeout=120)
    def gang() -> None:
        if body == "all_reduce":
            dist.all_reduce(torch.ones(1))
        elif body == "sleep":
            time.sleep(pause)

    connect_ready()
    measure(f"gpufn warm gang, body {body}", gang.remote, labels(os.getpid()), a.calls)
    gpufn_pids = set(labels(os.getpid()))
    group = WarmGroup(a.world)
    try:
        hand = {pid: label for pid, label in labels(os.getpid()).items()
                if pid not in gpufn_pids or label == "caller"}
        measure("hand-driven group, all_reduce", group.call, hand, a.calls)
    finally:
        group.close()


if __name__ == "__main__":
    main()
