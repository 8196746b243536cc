"""Hop-by-hop CPU budget of one no-op `.remote()`: each step of the call path timed on its
own, in this process, with `time.perf_counter_ns` (a hand-made timeline, not a sampler).

Every hop runs the real code on real objects: the client's argument pickling, code
fingerprint and Submit encoding; the scheduler's decode, its core (handler chain,
placement, the Run) and encode; the worker's decode, core and inline executor; and the
Result's way back through the scheduler to the caller. What the table cannot show is
the transport (sockets, wake-ups, the kernel): that is the raw four-hop round trip,
printed below it from `bench/_raw.py`, so the two add up to about one call.

    python bench/hops.py [--repeats 5] [--n 5000] [--quick] [--no-raw]

Numbers are min / median over repeats of the mean cost per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("GPUFN_PROGRESS", "0")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw transport's line")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.n = 3, 1000

    import gpufn
    from gpufn.api.calls import decode_result
    from gpufn.memory_pool.probe import simulated_devices
    from gpufn.runtime import context as ctxmod
    from gpufn.scheduler.calls.recovery import Restored
    from gpufn.scheduler.core import Received, SchedulerConfig, SchedulerCore
    from gpufn.wire import protocol as p
    from gpufn.wire import serialization as ser
    from gpufn.worker.core import Execute, WorkerCore
    from gpufn.worker.executor import Call, Executor
    from gpufn.worker.output import OutputRouter

    @gpufn.gpu
    def noop() -> None:
        return None

    core = SchedulerCore(SchedulerConfig())

    core.start(Restored(), 1000.0)
    now = [1000.0]
    infos = simulated_devices("n", 1, 8 * 2**30)

    def feed(peer: bytes, msg: p.Message) -> list[Any]:
        now[0] += 1e-5
        return core.handle(Received(peer, msg), now[0])

    feed(b"sup", p.Hello(p.Role.SUPERVISOR, p.PROTOCOL_VERSION, "", 1,
                         p.HelloInfo(node="n", devices=[d.to_wire() for d in infos])))
    feed(b"cli", p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, "", 2))
    feed(b"w0", p.Hello(p.Role.WORKER, p.PROTOCOL_VERSION, "", 3,
                        p.HelloInfo(device="n:0", incarnation=1)))
    reg = noop.register_message()
    feed(b"cli", reg)
    wcore = WorkerCore("n:0")
    done: list[p.Message] = []
    executor = Executor(OutputRouter(), done.append)
    counter = [0]

    # The state each hop hands to the next, for one call.
    st: dict[str, Any] = {}

    def client_args() -> None:
        st["args"] = ser.dump_args("noop", (), {})

    def client_code() -> None:
        st["reg"] = noop._prepare(None)  # type: ignore[arg-type]

    def client_encode() -> None:
        counter[0] += 1
        st["sub"] = p.Submit(f"i{counter[0]:08x}", reg.function_id, {}, frames=tuple(st["args"]))
        st["sub_frames"] = p.encode(st["sub"])

    def sched_decode() -> None:
        st["sub_msgs"] = p.decode_all(st["sub_frames"])

    def sched_submit() -> None:
        out = []
        for m in st["sub_msgs"]:
            out += feed(b"cli", m)
        st["to_worker"] = [s.msg for s in out if s.peer == b"w0"]

    def sched_encode_run() -> None:
        st["run_frames"] = p.encode_batch(st["to_worker"])

    def worker_decode() -> None:
        st["run_msgs"] = p.decode_all(st["run_frames"])

    def worker_run() -> None:
        for m in st["run_msgs"]:
            for act in wcore.handle(m):
                if isinstance(act, Execute):
                    executor.run_inline(Call(act.invocation_id, act.name, act.fn, act.frames,
                                             act.context("cpu"), dispatch_token=act.dispatch_token))
        res = done.pop()
        wcore.done(res)  # type: ignore[arg-type]
        st["res_frames"] = p.encode_batch([res])

    sent: deque[tuple[float, str]] = deque(maxlen=10_000)

    def worker_recovery() -> None:
        # What head-restart recovery costs per call on the worker: remembering that the
        # call ran (worker/process.py `_sent`), so a new head can be told after a restart.
        sent.append((time.monotonic(), "i"))

    def sched_result() -> None:
        out = []
        for m in p.decode_all(st["res_frames"]):
            out += feed(b"w0", m)
        st["to_client"] = p.encode_batch([s.msg for s in out if s.peer == b"cli"])

    def client_result() -> None:
        for m in p.decode_all(st["to_client"]):
            if isinstance(m, p.Result):
                decode_result(m, "noop")

    hops: list[tuple[str, Callable[[], None]]] = [
        ("client: pickle the arguments", client_args),
        ("client: code fingerprint / re-pickle check", client_code),
        ("client: Submit built and encoded", client_encode),
        ("scheduler: decode Submit (with field checks)", sched_decode),
        ("scheduler: core: Submit handler, placement, Run", sched_submit),
        ("scheduler: encode Run", sched_encode_run),
        ("worker: decode Run (with field checks)", worker_decode),
        ("worker: core + inline executor + encode Result", worker_run),
        ("worker: remember the call for head-restart recovery", worker_recovery),
        ("scheduler: decode Result, core, encode for client", sched_result),
        ("client: decode Result, unpickle the value", client_result),
    ]
    # Warm the core: the function is measured as short (inline, pipelined) after a run.
    for _ in range(50):
        for _, fn in hops:
            fn()
    ctxmod._set(None)
    per_hop: dict[str, list[float]] = {name: [] for name, _ in hops}
    totals: list[float] = []
    for _ in range(a.repeats):
        acc = dict.fromkeys(per_hop, 0)
        t_all = time.perf_counter_ns()
        for _ in range(a.n):
            for name, fn in hops:
                t = time.perf_counter_ns()
                fn()
                acc[name] += time.perf_counter_ns() - t
        totals.append((time.perf_counter_ns() - t_all) / a.n / 1e3)
        for name in per_hop:
            per_hop[name].append(acc[name] / a.n / 1e3)

    raw: list[float] = []
    if not a.no_raw:
        from _raw import RawPath, best_roundtrip_us

        path = RawPath(transport="ipc")
        try:
            for _ in range(a.repeats):
                raw.append(best_roundtrip_us(path, min(a.n, 2000)))
        finally:
            path.close()

    def mm(v: list[float]) -> str:
        return f"{min(v):7.1f} / {statistics.median(v):7.1f}"

    print(f"\nCPU per hop of one no-op call, µs (min / median of {a.repeats} x {a.n} calls; "
          f"perf_counter_ns; {os.cpu_count()} cores)\n")
    print("| hop | µs (min / median) |")
    print("| --- | ---: |")
    for name, _ in hops:
        print(f"| {name} | {mm(per_hop[name])} |")
    print(f"| **all hops' Python work** | {mm([sum(v[i] for v in per_hop.values()) for i in range(a.repeats)])} |")
    if raw:
        print(f"| transport: raw four-hop zmq round trip (ipc, p50) | {mm(raw)} |")
    print(f"\n(the loop itself, with timer overhead: {mm(totals)} µs per call)")


if __name__ == "__main__":
    main()
