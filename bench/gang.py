"""Gang call overhead: a no-op `@gpu(count=4)` call on a warm gang vs a warm gloo group
driven by hand, vs the first (cold) call of a new gang, vs launching the same SPMD
script with `torchrun --nproc-per-node 4`.

    python bench/gang.py [--repeats 5] [--world 4] [--collectives 1]
    python bench/gang.py --quick      # a short smoke run

Warm alternative (the floor for a warm pool): 4 persistent processes that each hold an
initialised gloo group and wait on a pyzmq DEALER socket (gpufn's transport, over a
Unix socket); the driver sends each "run", they all_reduce one element and answer.
`--collectives N`: both the gang and the hand-driven ranks run N all_reduces per call
(the second one finds the ranks as the first left them, not woken together).
No scheduler, no placement, no serialisation of code: how close gpufn's warm gang
comes to it is the printed ratio. Relayed (`--relay`, a profile of the gap): the same
group driven through one relay process in between, as gpufn's scheduler sits between
caller and workers (the driver's "run" to the relay, fanned out to the ranks, their
answers gathered there, one answer back): what that extra hop alone costs, with no
Python work besides routing.
Cold = the first call after the gang's group was torn down (a failing rank breaks it),
on workers that are already running: a process-group init, no process start.
torchrun = starting 4 Python processes that import torch, init a gloo group, run the
same no-op and exit: what each call costs without a warm pool (a warm pool vs
launching processes, not a like-for-like comparison).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import connect_ready

SPMD_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
""")


# ---------------------------------------------------------------------------- warm pool

def pool_rank(rank: int, world: int, store_port: int, addr: str, collectives: int = 1) -> None:
    """One rank of the hand-driven warm group: init once, then all_reduce per command."""
    import torch
    import torch.distributed as dist
    import zmq

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}",
                            rank=rank, world_size=world)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    sock.send(b"ready")
    try:
        while sock.recv() == b"run":
            for _ in range(collectives):
                dist.all_reduce(torch.ones(1))
            sock.send(b"done")
    finally:
        dist.destroy_process_group()
        sock.close(0)
        ctx.term()


def relay(front: str, back: str, world: int) -> None:
    """The relay of `RelayedGroup`: the driver's "run" to every rank, one "done" back once
    all answered; it says "ready" to the driver once every rank is there."""
    import zmq

    ctx = zmq.Context()
    up, down = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    up.connect(front)
    down.bind(back)
    ranks = [down.recv_multipart()[0] for _ in range(world)]
    up.send(b"ready")
    try:
        while up.recv() == b"run":
            for r in ranks:
                down.send_multipart([r, b"run"])
            for _ in ranks:
                down.recv_multipart()
            up.send(b"done")
    finally:
        for r in ranks:
            down.send_multipart([r, b"stop"])
        up.close(0)
        down.close(0)
        ctx.term()


class WarmGroup:
    """`world` processes holding a gloo group, driven over zmq ROUTER -> DEALER (ipc);
    with `relayed`, through a relay process in between (see `relay`)."""

    def __init__(self, world: int, relayed: bool = False, collectives: int = 1) -> None:
        import zmq

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.addr = f"ipc://{tempfile.gettempdir()}/gpufn-bench-gang-{os.getpid()}.sock"
        self.sock.bind(self.addr)
        spawn = mp.get_context("spawn")
        ranks_at = self.addr
        self.procs = []
        if relayed:
            ranks_at = self.addr.replace(".sock", "-relay.sock")
            self.procs.append(spawn.Process(target=relay, args=(self.addr, ranks_at, world),
                                            daemon=True))
        self.procs += [spawn.Process(target=pool_rank, args=(r, world, port, ranks_at, collectives),
                                     daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.peers: list[bytes] = []
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        deadline = time.monotonic() + 120
        while len(self.peers) < (1 if relayed else world):
            if not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                self.close()
                raise RuntimeError("the warm gloo group did not start")
            peer, _ = self.sock.recv_multipart()
            self.peers.append(peer)

    def call(self) -> None:
        for peer in self.peers:
            self.sock.send_multipart([peer, b"run"])
        for _ in self.peers:
            self.sock.recv_multipart()

    def close(self) -> None:
        for peer in self.peers:
            self.sock.send_multipart([peer, b"stop"])
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.sock.close(0)
        self.ctx.term()
        for path in (self.addr, self.addr.replace(".sock", "-relay.sock")):
            try:
                os.unlink(path.removeprefix("ipc://"))
            except OSError:
                pass


# ---------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--warm-calls", type=int, default=50)
    ap.add_argument("--collectives", type=int, default=1,
                    help="all_reduces per call, in the gang and in the hand-driven ranks alike")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--relay", action="store_true",
                    help="also the hand-driven group through a relay process (the extra hop alone)")
    ap.add_argument("--figure", action="store_true",
                    help="also a GPUFN-FIGURE line (scripts/gpu_check.sh's summary)")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.warm_calls = 2, 10
    os.environ.setdefault("GPUFN_CPU_DEVICES", str(a.world))
    os.environ.setdefault("GPUFN_PROGRESS", "0")

    import torch
    import torch.distributed as dist

    import gpufn

    collectives = a.collectives

    @gpufn.gpu(count=a.world, timeout=120)
    def noop() -> None:
        for _ in range(collectives):
            dist.all_reduce(torch.ones(1))

    connect_ready()

    group = WarmGroup(a.world, collectives=a.collectives)
    relayed = WarmGroup(a.world, relayed=True, collectives=a.collectives) if a.relay else None
    for _ in range(10):
        group.call()
        if relayed is not None:
            relayed.call()

    def warm_median(fn: Any) -> float:
        samples = []
        for _ in range(a.warm_calls):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    cold: list[float] = []
    warm: list[float] = []
    hand: list[float] = []
    hop: list[float] = []
    launch: list[float] = []
    try:
        for r in range(a.repeats):
            # cold: abort the warm group by running a gang whose rank fails, then time the next call
            @gpufn.gpu(count=a.world, timeout=120)
            def breaker() -> None:
                if gpufn.context().rank == 0:
                    raise RuntimeError("break the group")
                dist.all_reduce(torch.ones(1))

            try:
                breaker.remote()
            except RuntimeError:
                pass
            t = time.perf_counter()
            noop.remote()
            cold.append(time.perf_counter() - t)
            # warm, alternating which of the two warm paths goes first
            pair = [("gpufn", noop.remote, warm), ("hand", group.call, hand)]
            if relayed is not None:
                pair.append(("relayed", relayed.call, hop))
            k = r % len(pair)
            for _, fn, into in pair[k:] + pair[:k]:
                into.append(warm_median(fn))
            with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
                f.write(SPMD_SCRIPT)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={a.world}", f.name], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            launch.append(time.perf_counter() - t)
            os.unlink(f.name)
            print(f"round {r + 1}/{a.repeats} done", file=sys.stderr)
    finally:
        group.close()
        if relayed is not None:
            relayed.close()

    from rich.console import Console
    from rich.table import Table

    def ms(v: list[float]) -> str:
        return f"{min(v) * 1e3:,.1f} / {statistics.median(v) * 1e3:,.1f}"

    tab = Table(title=f"no-op gang call, world size {a.world}, {a.collectives} all_reduce(s) per call "
                    f"({a.repeats} runs, min / median ms; "
                    f"warm rows: median of {a.warm_calls} calls per run; {os.cpu_count()} cores, "
                    "gloo on simulated devices)")
    tab.add_column("path")
    tab.add_column("ms", justify="right")
    tab.add_column("vs gpufn warm (median)", justify="right")
    mw, mh = statistics.median(warm), statistics.median(hand)
    tab.add_row("warm: gpufn warm gang (no init)", ms(warm), "1x")
    tab.add_row(f"warm: hand-driven gloo group ({a.world} processes, zmq ipc, no scheduler)", ms(hand),
              f"{mh / mw:.2f}x")
    if hop:
        tab.add_row("warm: the same group through a relay process (one hop more, no Python work)",
                    ms(hop), f"{statistics.median(hop) / mw:.2f}x")
    tab.add_row("gpufn cold gang (group init on running workers)", ms(cold),
              f"{statistics.median(cold) / mw:,.0f}x")
    tab.add_row(f"a warm pool vs launching processes: torchrun --nproc-per-node {a.world}", ms(launch),
              f"{statistics.median(launch) / mw:,.0f}x")
    Console(width=None if sys.stdout.isatty() else 120).print(tab)
    print(f"gpufn's warm gang takes {mw / mh:.2f}x the hand-driven warm group's time per call "
          f"({(mw - mh) * 1e3:+.1f} ms: scheduler hop, placement, code and result frames)")
    if hop:
        mr = statistics.median(hop)
        print(f"the relayed group takes {mr / mh:.2f}x the direct one (the hop alone); gpufn's warm "
              f"gang {mw / mr:.2f}x the relayed group")
    if a.figure:
        print(f"GPUFN-FIGURE warm {a.world}-rank gang / hand-driven group, {os.cpu_count()} cores "
              f"| {mw / mh:.2f}x ({ms(warm)} vs {ms(hand)} ms, min / median) "
              f"| issue 33: <= 1.5x; 2.63x on the 2-core build machine")


if __name__ == "__main__":
    main()
