"""Functions that retry on exceptions (`gpufn.Retries(...)`, `on=(Exception,)` unless
said otherwise) and functions with a `timeout` now go under leases: a no-op `.remote()`
of each, of a plain function, and of each with leases off (`GPUFN_LEASE_SECONDS=0`, as
every such function ran before), in one run, rounds interleaved. And the failing path:
calls whose first attempt raises and whose retry answers, leased against leases off.

    python bench/retry_lease.py [--n 2000] [--repeats 3]

Prints the p50 per call of each (min / median of the rounds' p50s) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r'''
import os, sys, tempfile, time, statistics
import gpufn

@gpufn.gpu(memory="1MiB")
def plain(x):
    return x

@gpufn.gpu(memory="1MiB", retries=gpufn.Retries(max_retries=2, initial_delay=0.0))
def retrying(x):
    return x

@gpufn.gpu(memory="1MiB", timeout=60)  # as the README's quickstart function
def timed(x):
    return x

@gpufn.gpu(memory="1MiB", retries=gpufn.Retries(max_retries=2, initial_delay=0.0,
                                                on=(ValueError,)))
def fails_first(path):
    if not os.path.exists(path):
        open(path, "w").close()
        raise ValueError("first attempt")
    return 1

n, which = int(sys.argv[1]), sys.argv[2]
fn = {"plain": plain, "retrying": retrying, "timed": timed}.get(which)
scratch = tempfile.mkdtemp()
if fn is not None:
    for i in range(200):
        fn.remote(i)
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn.remote(i)
        times.append(time.perf_counter() - t)
else:
    for i in range(20):
        fails_first.remote(f"{scratch}/w{i}")
    times = []
    for i in range(n // 10):
        t = time.perf_counter()
        fails_first.remote(f"{scratch}/c{i}")
        times.append(time.perf_counter() - t)
print(statistics.median(times) * 1e6)
'''


def run(which: str, n: int, leases: bool) -> float:
    env = dict(os.environ, GPUFN_CPU_DEVICES="1", GPUFN_PROGRESS="0")
    env.pop("GPUFN_ADDRESS", None)
    if not leases:
        env["GPUFN_LEASE_SECONDS"] = "0"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
    try:
        out = subprocess.run([sys.executable, f.name, str(n), which], env=env, check=True,
                             capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cases = [("plain", True), ("retrying", True), ("retrying", False), ("timed", True),
             ("timed", False), ("fails_first", True), ("fails_first", False)]
    got: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    start = time.monotonic()
    for r in range(a.repeats):
        for c in cases:
            got[c].append(run(c[0], a.n, c[1]))
        print(f"round {r + 1}: " + ", ".join(f"{w}{'' if on else ' (leases off)'} "
                                            f"{got[(w, on)][-1]:.0f} us" for w, on in cases),
              flush=True)
    med = {c: statistics.median(v) for c, v in got.items()}
    print(f"\np50 per call, min / median of {a.repeats} rounds ({time.monotonic() - start:.0f} s):")
    for (w, on), v in got.items():
        print(f"  {w:12s} {'leased' if on else 'leases off':10s} {min(v):8.0f} / {med[(w, on)]:8.0f} us")
    print(f"\nretrying, leased vs plain, leased:     {med[('retrying', True)] / med[('plain', True)]:.2f}x")
    print(f"retrying, leases off vs leased:       {med[('retrying', False)] / med[('retrying', True)]:.2f}x slower")
    print(f"timeout=60, leased vs plain, leased:  {med[('timed', True)] / med[('plain', True)]:.2f}x")
    print(f"timeout=60, leases off vs leased:     {med[('timed', False)] / med[('timed', True)]:.2f}x slower")
    print(f"first attempt raises, leases off vs leased: "
          f"{med[('fails_first', False)] / med[('fails_first', True)]:.2f}x slower")


if __name__ == "__main__":
    main()
