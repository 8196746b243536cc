"""Streaming: time to the first value vs the whole generation, and raw item throughput.

A toy generator makes `--items` values, one every `--step` seconds (a decoder's token
step). The caller iterates `f.remote_gen(...)` on a warm worker of the embedded cluster
and records when the first value and the last one arrived, against the same generator
consumed as one `.remote()` call that returns the list (what a caller waited for before
streaming). Then the stream's throughput with no step (values/s through worker ->
scheduler -> client under the credit window), and the call's own `result_meta()`.
Against baselines measured in the same run, rounds interleaved: the burst against a raw
zmq stream of the same pickled values through a forwarder (client -> forwarder -> producer
and back, bench/_raw.py), and the first value of a stream with no step against a no-op
`.remote()` (what a caller waits for either way).

    python bench/stream.py [--items 32] [--step 0.05] [--repeats 3] [--burst 20000]
    python bench/stream.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("GPUFN_CPU_DEVICES", "1")
os.environ.setdefault("GPUFN_PROGRESS", "0")

import gpufn


@gpufn.gpu
def tokens(n: int, step: float) -> Iterator[int]:
    for i in range(n):
        if step:
            time.sleep(step)
        yield i


@gpufn.gpu
def all_tokens(n: int, step: float) -> list[int]:
    return list(tokens.local(n, step))


@gpufn.gpu
def noop() -> None:
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--step", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--burst", type=int, default=20_000)
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    a = ap.parse_args()
    if a.quick:
        a.items, a.step, a.repeats, a.burst = 8, 0.01, 3, 2000
    from _raw import RawStream

    gpufn.connect()
    list(tokens.remote_gen(2, 0.0))  # warm: code on the worker
    all_tokens.remote(1, 0.0)
    for _ in range(100):
        noop.remote()
    raw = RawStream()
    firsts, lasts, wholes = [], [], []
    rates: list[float] = []
    raw_rates: list[float] = []
    first0: list[float] = []
    noops: list[float] = []
    raw_first: list[float] = []
    meta: dict[str, object] = {}
    try:
        for r in range(a.repeats):
            t0 = time.perf_counter()
            first = None
            for _v in tokens.remote_gen(a.items, a.step):
                if first is None:
                    first = time.perf_counter() - t0
            lasts.append(time.perf_counter() - t0)
            firsts.append(first or 0.0)
            t0 = time.perf_counter()
            all_tokens.remote(a.items, a.step)
            wholes.append(time.perf_counter() - t0)
            # the burst and its raw twin, alternating which goes first
            for which in (("gpufn", "raw") if r % 2 == 0 else ("raw", "gpufn")):
                if which == "raw":
                    _, took = raw.run(a.burst)
                    raw_rates.append(a.burst / took)
                else:
                    call = tokens.spawn(a.burst, 0.0)
                    t0 = time.perf_counter()
                    n = sum(1 for _ in call.stream())
                    rates.append(n / (time.perf_counter() - t0))
                    meta = call.result_meta()
            # the first value of a stream against a no-op call, medians of 50 each
            f, z, rf = [], [], []
            for _ in range(50):
                t0 = time.perf_counter()
                stream = tokens.remote_gen(1, 0.0)
                next(stream)
                f.append(time.perf_counter() - t0)
                for _v in stream:
                    pass
                t0 = time.perf_counter()
                noop.remote()
                z.append(time.perf_counter() - t0)
                rf.append(raw.run(1)[0])
            first0.append(statistics.median(f))
            noops.append(statistics.median(z))
            raw_first.append(statistics.median(rf))
            print(f"round {r + 1}/{a.repeats} done", file=sys.stderr)
    finally:
        raw.close()
    med = statistics.median

    def mm(v: list[float], scale: float = 1.0, fmt: str = "{:,.1f}") -> str:
        return f"{fmt.format(min(v) * scale)} / {fmt.format(med(v) * scale)}"

    print(f"{a.items} values, one every {a.step * 1000:.0f} ms, min / median of {a.repeats}:")
    print(f"  first streamed value      {mm(firsts, 1000)} ms")
    print(f"  last streamed value       {mm(lasts, 1000)} ms")
    print(f"  .remote() returning list  {mm(wholes, 1000)} ms")
    print(f"\n| measure ({a.repeats} rounds, min / median) | gpufn | baseline | ratio (median) |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| burst of {a.burst:,} values, no step (values/s at the caller) | {mm(rates, 1, '{:,.0f}')} "
          f"| raw zmq stream {mm(raw_rates, 1, '{:,.0f}')} | {med(rates) / med(raw_rates):.2f}x raw |")
    print(f"| first value of a stream, no step (µs) | {mm(first0, 1e6, '{:,.0f}')} "
          f"| no-op .remote() {mm(noops, 1e6, '{:,.0f}')} | {med(first0) / med(noops):.2f}x a no-op |")
    print(f"| (raw zmq: first value of a stream, µs) | | {mm(raw_first, 1e6, '{:,.0f}')} | |")
    print(f"worker's result_meta of the last burst: items={meta.get('items')}, "
          f"items_per_s={meta.get('items_per_s') or 0:,.0f}")


if __name__ == "__main__":
    main()
