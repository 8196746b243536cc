"""The scheduler's cost per submit and per placement as the queue grows.

Drives `SchedulerCore` directly (sans-I/O, fake clock), so it measures the core and
nothing else: 8 simulated devices with 8 slots each are kept full, the queue holds
`depth` calls spread over `functions` functions, and in steady state each step is

    submit:    one more call arrives while every slot is busy (queued, no placement)
    placement: one running call reports its result, and the pass places a queued call

Both must stay flat as the queue grows. `--e2e` adds one end-to-end line through a real
embedded cluster (spawn -> result per call, with that many calls outstanding).

    python bench/queue_depth.py                 # the table
    python bench/queue_depth.py --e2e           # plus the end-to-end line
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque
from typing import Any

from gpufn.memory_pool.probe import simulated_devices
from gpufn.scheduler.calls.recovery import Restored
from gpufn.scheduler.core import Received, SchedulerConfig, SchedulerCore
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

DEVICES, SLOTS = 8, 8


class Driver:
    def __init__(self, functions: int) -> None:
        self.core = SchedulerCore(SchedulerConfig(slots_per_device=SLOTS))
        self.now = 1000.0
        self.core.start(Restored(), self.now)
        self.n = 0
        infos = simulated_devices("n", DEVICES, 80 * 2**30)
        self.feed(b"sup", p.Hello(p.Role.SUPERVISOR, p.PROTOCOL_VERSION, "", 1,
                                  p.HelloInfo(node="n", devices=[d.to_wire() for d in infos])))
        self.feed(b"cli", p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, "", 2))
        for i in range(DEVICES):
            self.feed(f"w{i}".encode(), p.Hello(p.Role.WORKER, p.PROTOCOL_VERSION, "", 100 + i,
                                                p.HelloInfo(device=f"n:{i}", incarnation=1)))
        spec = make_spec(concurrency=SLOTS).to_wire()
        self.fids = [f"f{i}" for i in range(functions)]
        for fid in self.fids:
            self.feed(b"cli", p.Register(fid, f"code-{fid}", fid, spec, [], (b"code",)))
        self.running: deque[tuple[bytes, str, int]] = deque()  # (worker, invocation, token)

    def feed(self, peer: bytes, msg: p.Message) -> None:
        self.now += 1e-4
        for s in self.core.handle(Received(peer, msg), self.now):
            if isinstance(s.msg, p.Run):
                self.running.append((s.peer, s.msg.invocation_id, s.msg.dispatch_token))

    def submit(self) -> None:
        self.n += 1
        self.feed(b"cli", p.Submit(f"i{self.n}", self.fids[self.n % len(self.fids)], {}, frames=(b"a",)))

    def finish_one(self) -> None:
        worker, inv, token = self.running.popleft()
        self.feed(worker, p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=token,
                                                                   duration=0.01), (b"v",)))


def measure(depth: int, functions: int, steps: int) -> tuple[float, float]:
    """(µs per submit, µs per placement) with `depth` calls queued behind full devices."""
    d = Driver(functions)
    for _ in range(DEVICES * SLOTS + depth):
        d.submit()
    assert len(d.core.queue) == depth, (len(d.core.queue), depth)
    gc.collect()
    submits, placements = [], []
    for _ in range(steps):
        t = time.perf_counter_ns()
        d.submit()
        submits.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        d.finish_one()
        placements.append(time.perf_counter_ns() - t)
    assert len(d.core.queue) == depth
    return statistics.median(submits) / 1e3, statistics.median(placements) / 1e3


def e2e(calls: int) -> float:
    """µs per call, spawn to result, `calls` outstanding at once (embedded cluster)."""
    import gpufn

    @gpufn.gpu
    def noop() -> None:
        return None

    noop.remote()  # start the cluster, load the code
    t = time.perf_counter()
    handles = [noop.spawn() for _ in range(calls)]
    for h in handles:
        h.get(timeout=600)
    return (time.perf_counter() - t) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="1,1000,10000,100000")
    ap.add_argument("--functions", default="1,10,1000")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--e2e", action="store_true")
    a = ap.parse_args(argv)
    depths = [int(x) for x in a.depths.split(",")]
    fns = [int(x) for x in a.functions.split(",")]
    rows: list[list[Any]] = []
    for f in fns:
        for q in depths:
            s, pl = measure(q, f, a.steps)
            rows.append([q, f, s, pl])
            print(f"queued {q:>7,}  functions {f:>5,}  submit {s:7.1f} µs  placement {pl:7.1f} µs",
                  flush=True)
    print("\n| calls queued | functions | µs per submit | µs per placement |")
    print("|---:|---:|---:|---:|")
    for q, f, s, pl in rows:
        print(f"| {q:,} | {f:,} | {s:.1f} | {pl:.1f} |")
    if a.e2e:
        for n in (1_000, 10_000):
            print(f"\nend to end (embedded cluster, 2 CPU devices): {n:,} calls outstanding: "
                  f"{e2e(n):.0f} µs per call")


if __name__ == "__main__":
    main()
