"""The scheduler at scale, by simulation: the sans-I/O core driven directly (no processes,
no sockets, a fake clock) with simulated workers that answer every order at once.

For each size (8, 64, 256 and 1,024 devices on 1, 8, 32 and 128 hosts) it registers 100
functions (most single-device, some 4-rank gangs, some using one of a few shared
models), queues 100,000 calls over them, then lets the simulated workers finish what
they are given until every call has ended: submit -> place -> run -> finish, all
through `SchedulerCore.handle_many` in batches as the process shell feeds it. It prints
the core's cost per call (submit, and result + the placement pass it triggers) and calls/s
through the whole cycle, on one core.

    python bench/scale.py [--calls 100000] [--functions 100] [--repeats 3] [--quick]
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
from gpufn.scheduler.core import Received, RendezvousReady, SchedulerConfig, SchedulerCore, Send
from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

SIZES = ((8, 1), (64, 8), (256, 32), (1024, 128))
GiB = 2**30
BATCH = 512  # messages per handle_many, as the shell's receive loop batches them


class Sim:
    """A scheduler core with `devices` simulated devices on `hosts` hosts."""

    def __init__(self, devices: int, hosts: int, functions: int) -> None:
        self.core = SchedulerCore(SchedulerConfig(slots_per_device=4))
        self.now = 1000.0
        self.core.start(Restored(), self.now)
        self.replies: deque[tuple[bytes, p.Message]] = deque()
        self.results = 0
        per_host = devices // hosts
        for h in range(hosts):
            infos = simulated_devices(f"n{h}", per_host, 80 * GiB)
            self.handle([(f"s{h}".encode(), p.Hello(
                p.Role.SUPERVISOR, p.PROTOCOL_VERSION, "", 10 + h,
                p.HelloInfo(node=f"n{h}", devices=[d.to_wire() for d in infos])))])
            self.handle([(f"w{h}:{i}".encode(), p.Hello(
                p.Role.WORKER, p.PROTOCOL_VERSION, "", 1000 + i,
                p.HelloInfo(device=f"n{h}:{i}", incarnation=1))) for i in range(per_host)])
        self.handle([(b"cli", p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, "", 2))])
        # The gang rendezvous store the shell would host (nothing connects to it here).
        self.react(self.core.handle_many([RendezvousReady(29500)], self.now))
        self.fids: list[str] = []
        gang = min(4, per_host)
        regs: list[tuple[bytes, p.Message]] = []
        for i in range(functions):
            models: list[dict[str, Any]] = []
            frames: tuple[bytes, ...] = (b"code",)
            if i % 10 == 9 and gang > 1:  # a gang
                spec = make_spec(count=gang, memory="1GiB")
            elif i % 10 == 8:  # a shared model (one of four)
                spec = make_spec(memory="1GiB", models=(f"m{i % 4}",))
                models = [{"name": f"m{i % 4}", "memory": 4 * GiB, "pin": False, "offload": True,
                           "code_id": f"loader{i % 4}", "nframes": 1, "count": 1}]
                frames = (b"code", b"loader")
            else:
                spec = make_spec(memory="1GiB", concurrency=2)
            fid = f"f{i}"
            regs.append((b"cli", p.Register(fid, f"code{i}", fid, spec.to_wire(), models, frames)))
            self.fids.append(fid)
        self.handle(regs)

    def handle(self, msgs: list[tuple[bytes, p.Message]]) -> None:
        self.now += 1e-4
        out = self.core.handle_many([Received(peer, m) for peer, m in msgs], self.now)
        self.react(out)

    def react(self, out: list[Send]) -> None:
        """What each simulated worker answers: a Run at once, a model load at once."""
        for s in out:
            m = s.msg
            if isinstance(m, p.Run):
                self.replies.append((s.peer, p.Result(
                    m.invocation_id, True, "", "",
                    p.ResultMeta(dispatch_token=m.dispatch_token, duration=0.001), (b"v",))))
            elif isinstance(m, p.LoadModel):
                self.replies.append((s.peer, p.ModelEvent(m.model, p.ModelState.RESIDENT,
                                                          4 * GiB, 0.01)))
            elif isinstance(m, p.Result) and s.peer == b"cli":
                self.results += 1

    def run(self, calls: int) -> tuple[float, float, float]:
        """(µs per submit, µs per result incl. placement, calls/s through the cycle)."""
        subs = [(b"cli", p.Submit(f"i{n}", self.fids[n % len(self.fids)], {}, frames=(b"a",)))
                for n in range(calls)]
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            for i in range(0, calls, BATCH):
                self.handle(subs[i:i + BATCH])
            t_sub = time.perf_counter() - t0
            t1 = time.perf_counter()
            while self.replies:
                batch = [self.replies.popleft() for _ in range(min(BATCH, len(self.replies)))]
                self.handle(batch)
            t_run = time.perf_counter() - t1
        finally:
            gc.enable()
        if self.results != calls:
            raise SystemExit(f"only {self.results} of {calls} calls finished: "
                             f"{len(self.core.queue)} still queued")
        return t_sub / calls * 1e6, t_run / calls * 1e6, calls / (t_sub + t_run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--functions", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="10,000 calls, 2 repeats")
    a = ap.parse_args()
    if a.quick:
        a.calls, a.repeats = 10_000, 2
    rows = []
    for devices, hosts in SIZES:
        sub, res, rate = [], [], []
        for _ in range(a.repeats):
            s, r, c = Sim(devices, hosts, a.functions).run(a.calls)
            sub.append(s)
            res.append(r)
            rate.append(c)
        rows.append((devices, hosts, sub, res, rate))
        print(f"{devices:>5} devices on {hosts:>3} hosts: submit {min(sub):6.1f} µs, result + "
              f"placement {min(res):6.1f} µs, {max(rate):8,.0f} calls/s", flush=True)

    def mm(v: list[float], f: str = "{:.1f}") -> str:
        return f"{f.format(min(v))} / {f.format(statistics.median(v))}"

    print(f"\n{a.calls:,} calls over {a.functions} functions (1 in 10 a 4-rank gang, 1 in 10 "
          f"with a shared model), {a.repeats} repeats, min / median:\n")
    print("| devices | hosts | µs per submit | µs per result + placement | calls/s through the core "
          "| per-call cost vs 8 devices |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    base = statistics.median([s + r for s, r in zip(rows[0][2], rows[0][3], strict=True)])
    for devices, hosts, sub, res, rate in rows:
        per = statistics.median([s + r for s, r in zip(sub, res, strict=True)])
        print(f"| {devices:,} | {hosts} | {mm(sub)} | {mm(res)} | "
              f"{max(rate):,.0f} / {statistics.median(rate):,.0f} | {per / base:.2f}x |")


if __name__ == "__main__":
    main()
