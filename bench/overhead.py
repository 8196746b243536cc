"""Call-path overhead: gpufn vs the raw transport (and Ray, if installed), in one run.

Prints, for this machine, side by side:
  * p50/p99 round trip of a no-op `.remote()` on a warm worker vs a raw pyzmq
    DEALER -> ROUTER forwarder -> echo worker round trip (the transport's floor);
  * `.map()` throughput over 10,000 no-op inputs;
  * 1,000 inputs of a 4 MiB tensor each (MB/s) vs raw zmq moving the same bytes;
  * the same no-op round trip and 10k-task throughput with Ray when `ray` is importable.
Each measurement is repeated (--repeats) and reported as min / median.

    python bench/overhead.py [--repeats 5] [--transport ipc|tcp] [--no-ray]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _raw import RawPath

MiB = 2**20


def percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]


def roundtrips(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    for _ in range(min(200, n)):
        fn()
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return percentiles(lat)


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def summarize(vals: list[float]) -> str:
    return f"{min(vals):,.0f} / {statistics.median(vals):,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-latency", type=int, default=2000)
    ap.add_argument("--n-map", type=int, default=10_000)
    ap.add_argument("--n-large", type=int, default=1000)
    ap.add_argument("--transport", choices=["ipc", "tcp"], default="ipc",
                    help="embedded cluster transport (ipc is its default)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true")
    a = ap.parse_args()
    os.environ["GPUFN_EMBEDDED_TRANSPORT"] = a.transport
    os.environ["GPUFN_CPU_DEVICES"] = str(a.devices)
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import torch

    import gpufn

    @gpufn.gpu
    def noop() -> None:
        return None

    @gpufn.gpu
    def noop1(x: Any) -> None:
        return None

    tensor = torch.zeros(MiB, dtype=torch.float32)  # 4 MiB
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    client = gpufn.connect()
    deadline = time.monotonic() + 120
    while any(d["state"] != "ready" for d in client.status()["devices"]):
        if time.monotonic() > deadline:
            raise SystemExit(f"workers did not start: {client.status()['devices']}")
        time.sleep(0.1)
    for _ in range(200):
        noop.remote()

    raw = {t: RawPath(transport=t) for t in ("tcp", "ipc")}
    raw_small = RawPath(small_reply=True, transport=a.transport, n_workers=a.devices)
    payload = tensor.numpy().tobytes()
    for r in range(a.repeats):
        for t, path in raw.items():
            p50, p99 = roundtrips(lambda path=path: path.roundtrip(b"x"), a.n_latency)
            add(f"raw {t} p50 us", p50 * 1e6)
            add(f"raw {t} p99 us", p99 * 1e6)
        p50, p99 = roundtrips(noop.remote, a.n_latency)
        add("gpufn p50 us", p50 * 1e6)
        add("gpufn p99 us", p99 * 1e6)
        dt = timed(lambda: list(noop1.map(range(a.n_map))))
        add("gpufn map calls/s", a.n_map / dt)
        dt = timed(lambda: raw_small.pipelined([b"x"] * a.n_map))
        add("raw map msgs/s", a.n_map / dt)
        dt = timed(lambda: list(noop1.map([tensor] * a.n_large)))
        add("gpufn 4MiB MB/s", a.n_large * 4 * MiB / dt / 1e6)
        dt = timed(lambda: raw_small.pipelined([payload] * a.n_large, window=64))
        add("raw 4MiB MB/s", a.n_large * 4 * MiB / dt / 1e6)
        print(f"round {r + 1}/{a.repeats} done", file=sys.stderr)
    for path in [*raw.values(), raw_small]:
        path.close()

    ray_rows: dict[str, list[float]] = {}
    if not a.no_ray:
        try:
            import ray
        except ImportError:
            ray = None
        if ray is not None:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

            @ray.remote
            def rnoop() -> None:
                return None

            for _ in range(a.repeats):
                p50, p99 = roundtrips(lambda: ray.get(rnoop.remote()), a.n_latency)
                ray_rows.setdefault("ray task p50 us", []).append(p50 * 1e6)
                ray_rows.setdefault("ray task p99 us", []).append(p99 * 1e6)
                dt = timed(lambda: ray.get([rnoop.remote() for _ in range(a.n_map)]))
                ray_rows.setdefault("ray 10k tasks/s", []).append(a.n_map / dt)
            ray.shutdown()

    from rich.console import Console
    from rich.table import Table

    med = {k: statistics.median(v) for k, v in {**rows, **ray_rows}.items()}
    tr = a.transport
    t = Table(title=f"gpufn call overhead ({a.repeats} runs, min / median; embedded transport {tr}, "
                    f"{a.devices} simulated devices, {os.cpu_count()} cores)")
    t.add_column("measurement")
    t.add_column("gpufn", justify="right")
    t.add_column("baseline", justify="right")
    t.add_column("ratio (median)", justify="right")
    t.add_row("no-op .remote() p50 (us)", summarize(rows["gpufn p50 us"]),
              f"raw {tr} {summarize(rows[f'raw {tr} p50 us'])}",
              f"{med['gpufn p50 us'] / med[f'raw {tr} p50 us']:.2f}x raw")
    t.add_row("no-op .remote() p99 (us)", summarize(rows["gpufn p99 us"]),
              f"raw {tr} {summarize(rows[f'raw {tr} p99 us'])}",
              f"{med['gpufn p99 us'] / med[f'raw {tr} p99 us']:.2f}x raw")
    other = "tcp" if tr == "ipc" else "ipc"
    t.add_row("  (raw round trip over the other transport)", "",
              f"raw {other} {summarize(rows[f'raw {other} p50 us'])}", "")
    t.add_row(f".map() {a.n_map:,} no-ops (calls/s)", summarize(rows["gpufn map calls/s"]),
              f"raw {summarize(rows['raw map msgs/s'])}",
              f"{med['gpufn map calls/s'] / med['raw map msgs/s']:.2f}x raw")
    t.add_row(f".map() {a.n_large:,} x 4 MiB tensors (MB/s)", summarize(rows["gpufn 4MiB MB/s"]),
              f"raw {summarize(rows['raw 4MiB MB/s'])}",
              f"{med['gpufn 4MiB MB/s'] / med['raw 4MiB MB/s']:.2f}x raw")
    if ray_rows:
        t.add_row("Ray task no-op p50 (us)", "", summarize(ray_rows["ray task p50 us"]),
                  f"gpufn {med['ray task p50 us'] / med['gpufn p50 us']:.2f}x faster")
        t.add_row("Ray 10k tasks (tasks/s)", "", summarize(ray_rows["ray 10k tasks/s"]),
                  f"gpufn {med['gpufn map calls/s'] / med['ray 10k tasks/s']:.2f}x")
    else:
        t.add_row("Ray", "", "not installed (pip install ray)", "")
    Console().print(t)


if __name__ == "__main__":
    main()
