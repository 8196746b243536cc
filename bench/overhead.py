"""Call-path overhead: gpufn vs the raw transport (and Ray, if installed), in one run.

Prints, for this machine, side by side:
  * p50/p99 round trip of a no-op `.remote()` on a warm worker (repeat calls go
    straight to it under a lease) vs a raw pyzmq DEALER -> echo worker ROUTER round trip
    over TCP loopback (the floor of that path), and vs the old floor, a raw round trip
    through a forwarder (client -> forwarder -> worker and back);
  * the same `.remote()` with leases off (GPUFN_LEASE_SECONDS=0: every call through the
    scheduler), and the scheduler's CPU time per call over a long `.map` both ways;
  * of that round trip: the cost of pickling the function's code again for each call
    (calls see globals as they are when made; unchanged code is not resent);
  * `.map()` throughput over 10,000 no-op inputs;
  * 1,000 inputs of a 4 MiB tensor each (MB/s) vs raw zmq moving the same bytes;
  * a 256 MiB tensor sent to a worker and back (shared memory, gpufn/wire/shm.py) vs
    raw zmq echoing the same bytes over the same four hops (and the same with the
    function returning a new tensor, `x.clone()`), and a 64 MiB numpy array there and
    back (`--np-mib`; numpy's pickle-5 buffers take the same path) vs raw zmq echoing
    its bytes; `--only shm` runs just these, `--only numpy` just the array;
  * the same no-op round trip and 10k-task throughput with Ray when `ray` is importable;
  * with --curve: the cost of CURVE encryption, the same three measurements on an
    embedded cluster over TCP loopback, plaintext against CURVE (GPUFN_CURVE=1).

The systems are interleaved within each round, each measured with the others stopped:
gpufn's embedded cluster is started, measured and torn down, then the raw transport's
processes, then Ray's (`ray.init` .. `ray.shutdown`); the order rotates from round to
round so no system always goes first. Each measurement is repeated (--repeats) and
reported as min / median.

    python bench/overhead.py [--repeats 5] [--transport ipc|tcp] [--no-ray] [--curve] [--big-mib 256]
    python bench/overhead.py --only shm    # just the big tensor and array there and back
    python bench/overhead.py --only numpy  # just the 64 MiB numpy array there and back
    python bench/overhead.py --quick       # a short smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import alive, descendants
from _raw import RawDirect, RawPath

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


def wait_gone(pids: set[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return sorted(p for p in pids if alive(p))


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-latency", type=int, default=2000)
    ap.add_argument("--n-map", type=int, default=10_000)
    ap.add_argument("--n-large", type=int, default=1000)
    ap.add_argument("--big-mib", type=int, default=256,
                    help="MiB of the tensor sent there and back (shared memory when >= 64)")
    ap.add_argument("--n-big", type=int, default=5)
    ap.add_argument("--np-mib", type=int, default=64,
                    help="MiB of the numpy array sent there and back (shared memory when >= 64)")
    ap.add_argument("--transport", choices=["ipc", "tcp"], default="ipc",
                    help="embedded cluster transport (ipc is its default)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (2 rounds, small n)")
    ap.add_argument("--only", choices=["all", "shm", "numpy"], default="all",
                    help="shm: only the big tensor and array there and back (gpufn and raw "
                         "zmq); numpy: only the array")
    ap.add_argument("--curve", action="store_true",
                    help="also measure TCP loopback plaintext against CURVE-encrypted")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.n_latency, a.n_map, a.n_large, a.n_big = 2, 200, 1000, 50, 2
    os.environ["GPUFN_EMBEDDED_TRANSPORT"] = a.transport
    os.environ["GPUFN_CPU_DEVICES"] = str(a.devices)
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import torch

    import gpufn
    from gpufn.client import default as gclient

    @gpufn.gpu
    def noop() -> None:
        return None

    @gpufn.gpu
    def noop1(x: Any) -> None:
        return None

    @gpufn.gpu
    def echo(x: Any) -> Any:
        return x

    @gpufn.gpu
    def clone(x: Any) -> Any:
        return x.clone()

    tensor = torch.zeros(MiB, dtype=torch.float32)  # 4 MiB
    payload = tensor.numpy().tobytes()
    big_mib = a.big_mib
    big = torch.ones(big_mib * MiB // 4, dtype=torch.float32)  # over GPUFN_SHM_THRESHOLD
    big_payload = big.numpy().tobytes()
    import numpy as np

    array = np.ones(a.np_mib * MiB // 4, dtype=np.float32)  # a numpy array, not a tensor
    array_payload = array.tobytes()
    rows: dict[str, list[float]] = {}
    leftover: set[int] = set()  # slow to exit after a phase; checked again at the end

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    def measure_array(prefix: str) -> None:
        echo.remote(array)  # warm
        dt = timed(lambda: [echo.remote(array) for _ in range(a.n_big)])
        add(f"{prefix} array MB/s", a.n_big * 2 * a.np_mib * MiB / dt / 1e6)  # there and back

    def measure_big(prefix: str) -> None:
        measure_array(prefix)
        if a.only == "numpy":
            return
        echo.remote(big)  # warm
        dt = timed(lambda: [echo.remote(big) for _ in range(a.n_big)])
        add(f"{prefix} big MB/s", a.n_big * 2 * big_mib * MiB / dt / 1e6)  # there and back
        if prefix == "gpufn":  # the result a new tensor: not the argument's memory sent back
            clone.remote(big)
            dt = timed(lambda: [clone.remote(big) for _ in range(a.n_big)])
            add(f"{prefix} big clone MB/s", a.n_big * 2 * big_mib * MiB / dt / 1e6)

    def cpu_ratio(off: float, on: float, calls: int) -> str:
        """How much less the scheduler spends per call with leases; the CPU clock ticks in
        1/SC_CLK_TCK s, so a reading of 0 says only "under one tick over the map"."""
        if on > 0:
            return f"{off / on:.1f}x less"
        tick = 1e6 / os.sysconf("SC_CLK_TCK") / calls
        return f">{off / tick:.0f}x less (under one clock tick, {tick:.1f} us/call)"

    def head_cpu() -> float:
        """CPU seconds the embedded cluster's scheduler process has used."""
        pid = next(p for p in descendants(os.getpid()) if "gpufn.scheduler" in cmdline(p))
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def measure_gpufn(prefix: str = "gpufn", curve: bool | None = None) -> None:
        """The embedded cluster (curve None), or one over TCP loopback with or without
        CURVE; rows are named `prefix ...`."""
        before = descendants(os.getpid())
        if prefix == "nolease":
            os.environ["GPUFN_LEASE_SECONDS"] = "0"
        cluster: Any = None
        if curve is None:
            client = gpufn.connect()
        else:
            os.environ["GPUFN_CURVE"] = "1" if curve else "0"
            cluster = LocalCluster(a.devices, transport="tcp", keys=keys if curve else None)
            address, token = cluster.start()
            assert (config.split_address(address)[1] is not None) == curve, address
            client = gpufn.connect(address, token=token)
        try:
            deadline = time.monotonic() + 120
            while any(d["state"] != "ready" for d in client.status()["devices"]):
                if time.monotonic() > deadline:
                    raise SystemExit(f"workers did not start: {client.status()['devices']}")
                time.sleep(0.1)
            if a.only != "all":
                measure_big(prefix)
                return
            for _ in range(200):
                noop.remote()
            list(noop1.map(range(4 * a.devices)))
            # Each call pickles the function again (it must see its globals as they are
            # now); unchanged code keeps its id and is not sent again. What that costs:
            n = 2000
            t0 = time.perf_counter()
            for _ in range(n):
                noop.register_message()
            add("gpufn code pickle us", (time.perf_counter() - t0) / n * 1e6)
            p50, p99 = roundtrips(noop.remote, a.n_latency)
            add(f"{prefix} p50 us", p50 * 1e6)
            add(f"{prefix} p99 us", p99 * 1e6)
            cpu0 = head_cpu() if curve is None else 0.0
            dt = timed(lambda: list(noop1.map(range(a.n_map))))
            add(f"{prefix} map calls/s", a.n_map / dt)
            if curve is None:
                add(f"{prefix} head cpu us/call", (head_cpu() - cpu0) / a.n_map * 1e6)
            if prefix == "nolease":
                return
            dt = timed(lambda: list(noop1.map([tensor] * a.n_large)))
            add(f"{prefix} 4MiB MB/s", a.n_large * 4 * MiB / dt / 1e6)
            measure_big(prefix)
        finally:
            mine = descendants(os.getpid()) - before
            gclient._shutdown_default()
            if cluster is not None:
                cluster.stop()
            os.environ.pop("GPUFN_CURVE", None)
            os.environ.pop("GPUFN_LEASE_SECONDS", None)
            leftover.update(wait_gone(mine))

    def measure_raw() -> None:
        before = descendants(os.getpid())
        full = a.only == "all"
        raw = {t: RawPath(transport=t) for t in ("tcp", "ipc")} if full else {}
        many = [RawPath(small_reply=True, transport=a.transport, n_workers=a.devices),
                RawPath(small_reply=True, transport=a.transport, n_workers=a.devices,
                        large=True)] if full else []
        echo_large = RawPath(transport=a.transport, large=True)  # echoes the payload back
        direct = RawDirect() if full else None
        try:
            if direct is not None:
                p50, p99 = roundtrips(functools.partial(direct.roundtrip, b"x"), a.n_latency)
                add("raw direct p50 us", p50 * 1e6)
                add("raw direct p99 us", p99 * 1e6)
            for t, path in raw.items():
                p50, p99 = roundtrips(functools.partial(path.roundtrip, b"x"), a.n_latency)
                add(f"raw {t} p50 us", p50 * 1e6)
                add(f"raw {t} p99 us", p99 * 1e6)
            if full:
                raw_small, raw_large = many
                dt = timed(lambda: raw_small.pipelined([b"x"] * a.n_map))
                add("raw map msgs/s", a.n_map / dt)
                dt = timed(lambda: raw_large.pipelined([payload] * a.n_large, window=64))
                add("raw 4MiB MB/s", a.n_large * 4 * MiB / dt / 1e6)
            echo_large.roundtrip(array_payload)  # warm
            dt = timed(lambda: [echo_large.roundtrip(array_payload) for _ in range(a.n_big)])
            add("raw array MB/s", a.n_big * 2 * a.np_mib * MiB / dt / 1e6)
            if a.only != "numpy":
                echo_large.roundtrip(big_payload)  # warm
                dt = timed(lambda: [echo_large.roundtrip(big_payload) for _ in range(a.n_big)])
                add("raw big MB/s", a.n_big * 2 * big_mib * MiB / dt / 1e6)
        finally:
            for path in [*raw.values(), *many, echo_large]:
                path.close()
            if direct is not None:
                direct.close()
            leftover.update(wait_gone(descendants(os.getpid()) - before))

    systems: list[tuple[str, Callable[[], None]]] = [("gpufn", measure_gpufn), ("raw", measure_raw)]
    if a.only == "all":
        systems.append(("nolease", functools.partial(measure_gpufn, "nolease")))
    if a.curve:
        import tempfile
        from pathlib import Path

        from gpufn.cluster.embedded import LocalCluster
        from gpufn.net import curve as security
        from gpufn.wire import config

        keys = Path(tempfile.mkdtemp(prefix="gpufn-bench-")) / "keys"
        security.server_keys(keys, create=True)
        systems += [("tcp", functools.partial(measure_gpufn, "tcp", False)),
                    ("curve", functools.partial(measure_gpufn, "curve", True))]
    ray: Any = None
    if not a.no_ray:
        try:
            import ray
        except ImportError:
            ray = None
            print("note: Ray is not installed (pip install ray); its rows are skipped",
                  file=sys.stderr)
    if ray is not None:
        @ray.remote
        def rnoop() -> None:
            return None

        def measure_ray() -> None:
            before = descendants(os.getpid())
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     object_store_memory=256 * MiB)
            try:
                for _ in range(200):
                    ray.get(rnoop.remote())
                p50, p99 = roundtrips(lambda: ray.get(rnoop.remote()), a.n_latency)
                add("ray task p50 us", p50 * 1e6)
                add("ray task p99 us", p99 * 1e6)
                dt = timed(lambda: ray.get([rnoop.remote() for _ in range(a.n_map)]))
                add("ray 10k tasks/s", a.n_map / dt)
            finally:
                ray.shutdown()
                leftover.update(wait_gone(descendants(os.getpid()) - before))

        systems.append(("ray", measure_ray))

    for r in range(a.repeats):
        k = r % len(systems)
        order = systems[k:] + systems[:k]
        for _, measure in order:
            measure()
        print(f"round {r + 1}/{a.repeats} done (order: {', '.join(n for n, _ in order)})",
              file=sys.stderr)
    ray_rows = {k: v for k, v in rows.items() if k.startswith("ray ")}
    curve_rows = {k: v for k, v in rows.items() if k.startswith(("tcp ", "curve "))}
    rows = {k: v for k, v in rows.items() if not k.startswith("ray ") and k not in curve_rows}

    from rich.console import Console
    from rich.table import Table

    med = {k: statistics.median(v) for k, v in {**rows, **ray_rows}.items()}
    tr = a.transport
    t = Table(title=f"gpufn call overhead ({a.repeats} rounds, min / median; each round measures "
                    f"gpufn, raw zmq{' and Ray' if ray_rows else ''} in turn, the others stopped; "
                    f"embedded transport {tr}, {a.devices} simulated devices, "
                    f"{os.cpu_count()} cores)")
    t.add_column("measurement")
    t.add_column("gpufn", justify="right")
    t.add_column("baseline", justify="right")
    t.add_column("ratio (median)", justify="right")
    if a.only == "all":
        t.add_row("no-op .remote() p50 (us)", summarize(rows["gpufn p50 us"]),
                  f"raw direct {summarize(rows['raw direct p50 us'])}",
                  f"{med['gpufn p50 us'] / med['raw direct p50 us']:.2f}x raw direct")
        t.add_row("no-op .remote() p99 (us)", summarize(rows["gpufn p99 us"]),
                  f"raw direct {summarize(rows['raw direct p99 us'])}",
                  f"{med['gpufn p99 us'] / med['raw direct p99 us']:.2f}x raw direct")
        t.add_row("  (the old floor: raw through a forwarder, p50 us)", "",
                  f"raw {tr} {summarize(rows[f'raw {tr} p50 us'])}",
                  f"{med['gpufn p50 us'] / med[f'raw {tr} p50 us']:.2f}x")
        t.add_row("  (leases off: every call through the scheduler, p50 us)",
                  summarize(rows["nolease p50 us"]), "",
                  f"{med['nolease p50 us'] / med['gpufn p50 us']:.2f}x slower")
        t.add_row("  (scheduler CPU per call over the .map, us; leases off)",
                  summarize(rows["gpufn head cpu us/call"]),
                  summarize(rows["nolease head cpu us/call"]),
                  cpu_ratio(med["nolease head cpu us/call"], med["gpufn head cpu us/call"],
                            a.n_map))
        t.add_row("  (of which: pickling the function's code per call, us)",
                  summarize(rows["gpufn code pickle us"]), "", "")
        other = "tcp" if tr == "ipc" else "ipc"
        t.add_row("  (raw round trip over the other transport)", "",
                  f"raw {other} {summarize(rows[f'raw {other} p50 us'])}", "")
        t.add_row(f".map() {a.n_map:,} no-ops (calls/s)", summarize(rows["gpufn map calls/s"]),
                  f"raw {summarize(rows['raw map msgs/s'])}",
                  f"{med['gpufn map calls/s'] / med['raw map msgs/s']:.2f}x raw")
        t.add_row("  (leases off, calls/s)", summarize(rows["nolease map calls/s"]), "",
                  f"{med['gpufn map calls/s'] / med['nolease map calls/s']:.2f}x")
        t.add_row(f".map() {a.n_large:,} x 4 MiB tensors (MB/s)", summarize(rows["gpufn 4MiB MB/s"]),
                  f"raw {summarize(rows['raw 4MiB MB/s'])}",
                  f"{med['gpufn 4MiB MB/s'] / med['raw 4MiB MB/s']:.2f}x raw")
    if a.only != "numpy":
        t.add_row(f".remote() of a {big_mib} MiB tensor, there and back (MB/s)",
                  summarize(rows["gpufn big MB/s"]), f"raw {summarize(rows['raw big MB/s'])}",
                  f"{med['gpufn big MB/s'] / med['raw big MB/s']:.2f}x raw")
        t.add_row("  (the same, the function returning x.clone(): a new tensor back)",
                  summarize(rows["gpufn big clone MB/s"]),
                  f"raw {summarize(rows['raw big MB/s'])}",
                  f"{med['gpufn big clone MB/s'] / med['raw big MB/s']:.2f}x raw")
    t.add_row(f".remote() of a {a.np_mib} MiB numpy array, there and back (MB/s)",
              summarize(rows["gpufn array MB/s"]), f"raw {summarize(rows['raw array MB/s'])}",
              f"{med['gpufn array MB/s'] / med['raw array MB/s']:.2f}x raw")
    if ray_rows:
        t.add_row("Ray task no-op p50 (us)", "", summarize(ray_rows["ray task p50 us"]),
                  f"gpufn {med['ray task p50 us'] / med['gpufn p50 us']:.2f}x faster")
        t.add_row(f"Ray {a.n_map:,} tasks (tasks/s)", "", summarize(ray_rows["ray 10k tasks/s"]),
                  f"gpufn {med['gpufn map calls/s'] / med['ray 10k tasks/s']:.2f}x")
    elif a.only == "all":
        t.add_row("Ray", "", "not installed (pip install ray)", "")
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(t)
    if curve_rows:
        cm = {k: statistics.median(v) for k, v in curve_rows.items()}
        c = Table(title=f"what CURVE costs: embedded cluster over TCP loopback, plaintext vs "
                        f"CURVE ({a.repeats} rounds, min / median)")
        for col in ("measurement", "TCP plaintext", "TCP CURVE", "CURVE / plaintext (median)"):
            c.add_column(col, justify="left" if col == "measurement" else "right")
        for label, key in (("no-op .remote() p50 (us)", "p50 us"),
                           ("no-op .remote() p99 (us)", "p99 us"),
                           (f".map() {a.n_map:,} no-ops (calls/s)", "map calls/s"),
                           (f".map() {a.n_large:,} x 4 MiB tensors (MB/s)", "4MiB MB/s")):
            c.add_row(label, summarize(curve_rows[f"tcp {key}"]),
                      summarize(curve_rows[f"curve {key}"]),
                      f"{cm[f'curve {key}'] / cm[f'tcp {key}']:.2f}x")
        console.print(c)
    # multiprocessing's resource tracker (started by the raw path) lives until we exit
    left = [p for p in wait_gone(leftover, 30.0) if "resource_tracker" not in cmdline(p)]
    if left:
        for p in left:
            print(f"process left behind: {p} {cmdline(p)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
