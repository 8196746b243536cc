"""Where a leased no-op `.remote()` spends its time, hop by hop, on real processes.

An embedded cluster of one simulated device; this client makes N no-op calls under a
lease and times its own steps (before the send: pickling, the Submit, taking the lease;
the zmq send; the wait for the answer; after it: decoding and unpickling); the worker
times the steps of its loop the call passes through (`bench/_lease_hop_site`, loaded
through PYTHONPATH only in the processes this script starts). The raw floor, a pyzmq
DEALER -> ROUTER echo over TCP loopback (`bench/_raw.py` RawDirect), is measured in the
same run. Medians per call, over --repeats rounds (min / median of the medians).

    python bench/lease_hops.py [--n 3000] [--repeats 3] [--one-cpu]

On a VM a wake-up on another vCPU can cost more than the work (this machine: the raw echo
26 µs on one vCPU, ~110 µs across two); `--one-cpu` measures with every process on one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER_STEPS = ["receive, decode, run, answer", "of which: run (inline, leased)",
                "of which: answer encoded", "of which: answer sent (zmq)",
                "after: lease step (next call, reports)", "after: the loop's other output"]
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one-cpu", action="store_true",
                    help="every process on one CPU (as `taskset -c 0`): no cross-CPU wake-ups, "
                         "so the round trips are the CPU both sides spend (docs/performance.md)")
    a = ap.parse_args()
    if a.one_cpu:  # inherited by the cluster's processes and the raw echo's
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    hops_dir = tempfile.mkdtemp(prefix="gpufn-hops-")
    os.environ.update(GPUFN_CPU_DEVICES="1", GPUFN_PROGRESS="0", GPUFN_BENCH_HOPS_DIR=hops_dir,
                      PYTHONPATH=os.pathsep.join(
                          [str(HERE / "_lease_hop_site"), os.environ.get("PYTHONPATH", "")]))

    import zmq
    from _raw import RawDirect

    import gpufn
    from gpufn.client import sync_channel
    from gpufn.net import sockets

    pc = time.perf_counter
    marks: list[tuple[str, float, float]] = []
    send = sockets.send

    def timed_send(sock: Any, frames: list[Any], flags: int = 0) -> None:
        t = pc()
        send(sock, frames, flags)
        marks.append(("send", t, pc()))

    poll = zmq.Poller.poll

    def timed_poll(self: Any, timeout: Any = None) -> Any:
        t = pc()
        r = poll(self, timeout)
        marks.append(("wait", t, pc()))
        return r

    sync_channel.sockets.send = timed_send
    zmq.Poller.poll = timed_poll  # type: ignore[method-assign]

    @gpufn.gpu
    def noop() -> None:
        return None

    rows: dict[str, list[float]] = {}
    raw = RawDirect()
    try:
        for _ in range(a.repeats):
            for _ in range(300):
                noop.remote()
            parts: dict[str, list[float]] = {"before": [], "send": [], "wait": [],
                                             "after": [], "total": []}
            for _ in range(a.n):
                marks.clear()
                t0 = pc()
                noop.remote()
                t1 = pc()
                s = [m for m in marks if m[0] == "send"]
                w = [m for m in marks if m[0] == "wait"]
                if len(s) != 1 or len(w) != 1:
                    continue  # not under a lease (its renewal), or a ping: not this path
                parts["before"].append(s[0][1] - t0)
                parts["send"].append(s[0][2] - s[0][1])
                parts["wait"].append(w[0][2] - w[0][1])
                parts["after"].append(t1 - w[0][2])
                parts["total"].append(t1 - t0)
            for k, v in parts.items():
                rows.setdefault(k, []).append(statistics.median(v) * 1e6)
            time.sleep(0.7)  # the worker's medians are written every 0.5 s
            for f in Path(hops_dir).glob("worker-*.txt"):
                for line in f.read_text().splitlines():
                    key, us, _n = line.split("\t")
                    rows.setdefault("worker: " + key, []).append(float(us))
            samples = []
            for _ in range(a.n):
                t = pc()
                raw.roundtrip(b"x")
                samples.append(pc() - t)
            rows.setdefault("raw", []).append(statistics.median(samples) * 1e6)
    finally:
        raw.close()

    def cell(k: str) -> str:
        v = rows.get(k, [])
        return f"{min(v):7.1f} / {statistics.median(v):7.1f}" if v else "      -"

    print(f"\nleased no-op .remote(), medians per call in us (min / median of {a.repeats} rounds)")
    for label, k in [("client: before the send (pickle, Submit, lease)", "before"),
                     ("client: zmq send", "send"),
                     ("client: waiting for the answer", "wait"),
                     *[(f"  worker: {k}", f"worker: {k}") for k in WORKER_STEPS],
                     ("client: after (decode, unpickle)", "after"),
                     ("total round trip", "total"),
                     ("raw zmq client -> worker -> client (same run)", "raw")]:
        print(f"{label:<52} {cell(k)}")
    total, floor = rows["total"], rows["raw"]
    print(f"{'ratio to raw (median)':<52} {statistics.median(total) / statistics.median(floor):7.2f}x")


if __name__ == "__main__":
    main()
