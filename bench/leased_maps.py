"""`.map` under leases against the scheduled path, in one run, on an embedded cluster.

Each round maps N no-ops and M calls of a 5 ms sleep (device time that uses no CPU) with
the map's calls leased (`gpufn.api.map_run.LEASED_MAPS = True`) and scheduled, in turn,
the order alternating between rounds; it prints calls/s min / median per way and the
ratio of the medians, and the share of the leased maps' calls that went under a lease
(each no-op map follows the 5 ms map of another function, whose leases it finds open and
idle on the devices). This decides whether `.map` takes leases (`LEASED_MAPS`): it must
not lose to the scheduled path on one device or many.

    python bench/leased_maps.py [--devices 2] [--rounds 3] [--n 10000] [--m 800]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=10000, help="no-op calls per map")
    ap.add_argument("--m", type=int, default=800, help="5 ms calls per map")
    a = ap.parse_args()
    os.environ["GPUFN_CPU_DEVICES"] = str(a.devices)
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import gpufn
    from gpufn.api import map_run
    from gpufn.client.default import get_client

    @gpufn.gpu
    def noop(x: int) -> int:
        return x

    @gpufn.gpu
    def work(ms: float) -> float:
        time.sleep(ms / 1000)
        return ms

    list(noop.map(range(200)))
    list(work.map([0.0] * 50))
    rates: dict[tuple[str, bool], list[float]] = {}
    shares: dict[str, list[float]] = {}
    leases = get_client().leases
    for r in range(a.rounds):
        for leased in ((True, False) if r % 2 == 0 else (False, True)):
            map_run.LEASED_MAPS = leased
            t, sent = time.perf_counter(), leases.direct_calls
            assert list(noop.map(range(a.n))) == list(range(a.n))
            rates.setdefault(("no-op", leased), []).append(a.n / (time.perf_counter() - t))
            if leased:
                shares.setdefault("no-op", []).append((leases.direct_calls - sent) / a.n)
            t, sent = time.perf_counter(), leases.direct_calls
            assert list(work.map([5.0] * a.m)) == [5.0] * a.m
            rates.setdefault(("5 ms", leased), []).append(a.m / (time.perf_counter() - t))
            if leased:
                shares.setdefault("5 ms", []).append((leases.direct_calls - sent) / a.m)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    print(f"\n.map calls/s on {a.devices} simulated devices, {a.rounds} rounds (min / median)")
    for kind in ("no-op", "5 ms"):
        on, off = rates[(kind, True)], rates[(kind, False)]
        ratio = statistics.median(on) / statistics.median(off)
        print(f"{kind:>6}: leased {min(on):8,.0f} / {statistics.median(on):8,.0f}   "
              f"scheduled {min(off):8,.0f} / {statistics.median(off):8,.0f}   {ratio:5.2f}x   "
              f"under a lease {min(shares[kind]):.2f} / {statistics.median(shares[kind]):.2f}")


if __name__ == "__main__":
    main()
