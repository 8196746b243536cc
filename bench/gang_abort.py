"""How often a failing gang rank leaves another rank stuck: rounds of warm 4-rank gang
calls, then one gang whose rank 0 raises while the other ranks enter an all_reduce.

    python bench/gang_abort.py [--rounds 150] [--warm 20] [--world 4]

Each breaker gang should fail at once and the next call find every worker in service.
A rank stuck in gloo after the abort (worker/groups.py's module doc says why that
happened) holds its worker until the scheduler kills it, 10 s after the abort: the
breaker then answers after the gang's 3 s settle (a round with a stuck rank) and the
next call waits for the worker's restart (a slow next call; a slow join of the next
gang counts there too). The script prints both rates, with the breaker's and the next
call's times (min / median / max) over all rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import connect_ready


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--warm", type=int, default=20, help="warm gang calls before each breaker")
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    os.environ.setdefault("GPUFN_CPU_DEVICES", str(a.world))
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import torch
    import torch.distributed as dist

    import gpufn

    @gpufn.gpu(count=a.world, timeout=120)
    def noop() -> None:
        dist.all_reduce(torch.ones(1))

    @gpufn.gpu(count=a.world, timeout=120)
    def breaker() -> None:
        if gpufn.context().rank == 0:
            raise RuntimeError("break the group")
        dist.all_reduce(torch.ones(1))

    connect_ready()

    broke: list[float] = []
    after: list[float] = []
    stuck: list[int] = []  # the breaker answered only after the gang's settle
    slow: list[int] = []  # the next call waited (a worker restarting, or a slow join)
    for r in range(a.rounds):
        for _ in range(a.warm):
            noop.remote()
        t = time.perf_counter()
        try:
            breaker.remote()
        except RuntimeError:
            pass
        else:
            raise SystemExit("the breaker gang did not fail")
        broke.append(time.perf_counter() - t)
        t = time.perf_counter()
        noop.remote()
        after.append(time.perf_counter() - t)
        if broke[-1] > 2.0:
            stuck.append(r)
        if after[-1] > 2.0:
            slow.append(r)
        if broke[-1] > 2.0 or after[-1] > 2.0:
            print(f"{time.strftime('%H:%M:%S')} round {r}: breaker {broke[-1]:.2f}s, "
                  f"next call {after[-1]:.2f}s", file=sys.stderr, flush=True)

    def ms(v: list[float]) -> str:
        return f"{min(v) * 1e3:,.0f} / {statistics.median(v) * 1e3:,.0f} / {max(v) * 1e3:,.0f} ms"

    print(f"breaker gang (rank 0 raises): {ms(broke)}  (min / median / max)")
    print(f"the next gang call:           {ms(after)}")
    for what, rounds in (("a stuck rank", stuck), ("a slow next call", slow)):
        print(f"rounds with {what}: {len(rounds)} of {a.rounds} "
              f"({len(rounds) / a.rounds:.1%}){': ' + str(rounds) if rounds else ''}")


if __name__ == "__main__":
    main()
