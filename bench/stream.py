"""Streaming: time to the first value vs the whole generation, and raw item throughput.

A toy generator makes `--items` values, one every `--step` seconds (a decoder's token
step). The caller iterates `f.remote_gen(...)` on a warm worker of the embedded cluster
and records when the first value and the last one arrived, against the same generator
consumed as one `.remote()` call that returns the list (what a caller waited for before
streaming). Then the stream's throughput with no step (values/s through worker ->
scheduler -> client under the credit window), and the call's own `result_meta()`.

    python bench/stream.py [--items 32] [--step 0.05] [--repeats 3] [--burst 20000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--step", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--burst", type=int, default=20_000)
    a = ap.parse_args()
    gpufn.connect()
    list(tokens.remote_gen(2, 0.0))  # warm: code on the worker
    all_tokens.remote(1, 0.0)
    firsts, lasts, wholes = [], [], []
    for _ in range(a.repeats):
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
    med = statistics.median
    print(f"{a.items} values, one every {a.step * 1000:.0f} ms, median of {a.repeats}:")
    print(f"  first streamed value      {med(firsts) * 1000:8.1f} ms")
    print(f"  last streamed value       {med(lasts) * 1000:8.1f} ms")
    print(f"  .remote() returning list  {med(wholes) * 1000:8.1f} ms")
    call = tokens.spawn(a.burst, 0.0)
    t0 = time.perf_counter()
    n = sum(1 for _ in call.stream())
    took = time.perf_counter() - t0
    meta = call.result_meta()
    print(f"burst of {n} values, no step: {n / took:,.0f} values/s at the caller; worker's "
          f"result_meta: items={meta['items']}, first_item_s={meta['first_item_s'] * 1000:.2f} ms, "
          f"items_per_s={meta['items_per_s']:,.0f}")


if __name__ == "__main__":
    main()
