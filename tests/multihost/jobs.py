"""Functions the multi-host tests run, and the client-side jobs that call them (run by
`_driver` inside a client namespace)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import gpufn
from gpufn.wire import config


def _here() -> dict[str, Any]:
    """Where this runs: the host (node id) and the network namespace it really is in."""
    return {"node": config.node_id(), "netns": os.stat("/proc/self/ns/net").st_ino,
            "pid": os.getpid()}


@gpufn.gpu(timeout=60)
def where(i: int) -> dict[str, Any]:
    return {"i": i, **_here()}


@gpufn.gpu(timeout=120, retries=2)
def slow_where(i: int, seconds: float, marks: str) -> dict[str, Any]:
    here = _here()
    attempt = gpufn.context().attempt
    tag = f"{i}-{here['node']}-{attempt}"
    Path(marks, f"start-{tag}").touch()
    time.sleep(seconds)
    Path(marks, f"done-{tag}").touch()
    return {"i": i, "attempt": attempt, **here}


@gpufn.gpu(count=2, gather=True, timeout=120)
def gang2() -> dict[str, Any]:
    return {"rank": gpufn.context().rank, **_here()}


@gpufn.gpu(count=4, gather=True, timeout=120)
def gang4(seconds: float = 0.0, marks: str = "") -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ctx = gpufn.context()
    if marks:
        Path(marks, f"gang-{ctx.rank}").touch()
    time.sleep(seconds)
    t = torch.arange(4, dtype=torch.float64) * (ctx.rank + 1)
    dist.all_reduce(t)
    return {"rank": ctx.rank, "sum": t.tolist(), **_here()}


@gpufn.gpu(timeout=120)
def double(t: Any) -> Any:
    return t * 2


@gpufn.gpu(timeout=60, retries=3)
def square(x: int) -> int:
    return x * x


# ---------------------------------------------------------------- client-side jobs


def job_spread(n: int) -> list[dict[str, Any]]:
    return list(where.map(range(n)))


def job_gang2() -> dict[str, Any]:
    call = gang2.spawn()
    return {"ranks": call.get(timeout=120), "devices": call.result_meta()["devices"]}


def job_gang4(seconds: float = 0.0, marks: str = "") -> dict[str, Any]:
    call = gang4.spawn(seconds, marks)
    return {"ranks": call.get(timeout=180), "devices": call.result_meta()["devices"]}


def job_big(mib: int, rounds: int) -> dict[str, Any]:
    import torch

    t = torch.arange(mib * 2**20 // 4, dtype=torch.float32)
    double.remote(t[:16])  # warm: code shipped, worker ready
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = double.remote(t)
        times.append(time.perf_counter() - t0)
        assert torch.equal(out, t * 2)
    best = min(times)
    # Each call moves the tensor to a worker host and the result back: 2x the bytes.
    return {"seconds": times, "mib_per_s": 2 * mib / best}


def job_slow(n: int, seconds: float, marks: str) -> list[dict[str, Any]]:
    calls = [slow_where.spawn(i, seconds, marks) for i in range(n)]
    return [c.get(timeout=180) for c in calls]


def job_map(n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = list(square.map(range(n)))
    return {"ok": out == [x * x for x in range(n)], "n": len(out),
            "seconds": time.perf_counter() - t0}


def job_status() -> dict[str, Any]:
    return gpufn.connect().status(10)


def job_call() -> dict[str, Any]:
    return where.remote(-1)


# ---------------------------------------------------------------- partitions


def _count_run(marks: str, i: int) -> dict[str, Any]:
    """One line per run in a side file named by the call's id: what ran, where, which attempt."""
    ctx = gpufn.context()
    here = _here()
    with open(Path(marks, f"{ctx.invocation_id}.runs"), "a") as f:
        f.write(f"{i} {ctx.attempt} {here['node']}\n")
    return {"i": i, "attempt": ctx.attempt, "id": ctx.invocation_id, **here}


@gpufn.gpu(timeout=120, retries=0)
def counted(i: int, seconds: float, marks: str) -> dict[str, Any]:
    out = _count_run(marks, i)
    time.sleep(seconds)
    return out


@gpufn.gpu(timeout=120, retries=2)
def counted_retried(i: int, seconds: float, marks: str) -> dict[str, Any]:
    out = _count_run(marks, i)
    time.sleep(seconds)
    return out


def job_counted_map(n: int, seconds: float, marks: str, retries: bool = False,
                    leased: bool = True) -> list[Any]:
    """A map of counted calls; each item its result or `{"error": type, "message"}`.
    `leased=False`: a map ordered by cost (all equal here), which takes no lease: every
    call through the head."""
    fn = counted_retried if retries else counted
    order: dict[str, Any] = {} if leased else {"cost": lambda *_: 1.0}
    out: list[Any] = []
    for r in fn.map(range(n), [seconds] * n, [marks] * n, return_exceptions=True, **order):
        out.append({"error": type(r).__name__, "message": str(r)} if isinstance(r, BaseException)
                   else r)
    return out
