"""Raw pyzmq baselines for bench/overhead.py: the transport's floor for gpufn's path.

A forwarding process with one ROUTER (clients and echo workers both connect, as with
gpufn's scheduler) relays each request to an echo worker and the reply back:
client -> forwarder -> worker -> forwarder -> client, no Python logic besides routing.

The fastest honest floor for those four hops: small messages are sent and received with
`copy=True` (a `zmq.Frame` per part costs more than copying a few bytes: about 14 µs per
round trip here), large payloads with `copy=False` (`large=True`). Where the processes run
matters more than anything else in it: on 2 cores the same round trip reads ~120 µs
with all three processes on one core, ~170 µs with the client on one core and the
forwarder and worker on the other, and anywhere between when the OS chooses (other load
moves them). That, and `copy=False` on tiny frames, is why the floor read 172-182 µs
inside bench/overhead.py and ~95 µs driven alone on a quiet machine: compare the two
systems measured in the same run, back to back, never a floor taken at another time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import zmq


def forwarder(addr_q: Any, transport: str, copy: bool = True) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if transport == "ipc":
        addr = f"ipc://{tempfile.gettempdir()}/gpufn-bench-{os.getpid()}.sock"
        sock.bind(addr)
    else:
        addr = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    addr_q.put(addr)
    workers: list[bytes] = []
    early: list[list[Any]] = []  # requests that came before any worker (a slow start)
    rr = 0
    while True:
        frames = sock.recv_multipart(copy=copy)
        sender = frames[0] if copy else frames[0].bytes
        kind = frames[1] if copy else frames[1].bytes
        if kind == b"W":  # worker hello
            workers.append(sender)
            for f in early:
                sock.send_multipart([sender, *f], copy=copy)
            early.clear()
        elif kind == b"Q" and not workers:
            early.append([sender, *frames[2:]])
        elif kind == b"Q":  # client request: [client, Q, payload...]
            w = workers[rr % len(workers)]
            rr += 1
            sock.send_multipart([w, sender, *frames[2:]], copy=copy)
        elif kind == b"R":  # worker reply: [worker, R, client, payload...]
            sock.send_multipart([frames[2], *frames[3:]], copy=copy)
        elif kind == b"X":
            break
    sock.close(0)
    ctx.term()
    if addr.startswith("ipc://"):
        os.unlink(addr.removeprefix("ipc://"))


def echo_worker(addr: str, small_reply: bool, copy: bool = True) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    sock.send_multipart([b"W"])
    while True:
        frames = sock.recv_multipart(copy=copy)
        client = frames[0]
        if (frames[1] if copy else frames[1].bytes) == b"stop":
            break
        sock.send_multipart([b"R", client, b"ok"] if small_reply else [b"R", client, *frames[1:]],
                            copy=copy)


def stream_worker(addr: str) -> None:
    """Answers [client, n] with n pickled ints, then b"end" (a raw generator's stream)."""
    import pickle

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(addr)
    sock.send_multipart([b"W"])
    while True:
        client, req = sock.recv_multipart()
        if req == b"stop":
            break
        for i in range(int(req)):
            sock.send_multipart([b"R", client, pickle.dumps(i, protocol=5)])
        sock.send_multipart([b"R", client, b"end"])


class RawStream:
    """A client -> forwarder -> stream worker path: items flow back through the forwarder."""

    def __init__(self, transport: str = "ipc") -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.fwd = ctx.Process(target=forwarder, args=(q, transport, True), daemon=True)
        self.fwd.start()
        self.addr = q.get(timeout=30)
        self.worker = ctx.Process(target=stream_worker, args=(self.addr,), daemon=True)
        self.worker.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(self.addr)
        time.sleep(0.5)
        self.run(1)

    def run(self, n: int) -> tuple[float, float]:
        """(seconds to the first item, seconds to the end) for a stream of n items."""
        import pickle

        t0 = time.perf_counter()
        self.sock.send_multipart([b"Q", str(n).encode()])
        first = 0.0
        while True:
            (frame,) = self.sock.recv_multipart()
            if frame == b"end":
                return first, time.perf_counter() - t0
            if not first:
                first = time.perf_counter() - t0
            pickle.loads(frame)

    def close(self) -> None:
        self.sock.send_multipart([b"Q", b"stop"])
        self.sock.send_multipart([b"X"])
        time.sleep(0.2)
        for p in (self.fwd, self.worker):
            p.join(2)
            if p.is_alive():
                p.kill()
        self.sock.close(0)
        self.ctx.term()


class RawPath:
    def __init__(self, n_workers: int = 1, small_reply: bool = False, transport: str = "tcp",
                 large: bool = False) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.copy = not large  # zero-copy frames only pay off for large payloads
        self.fwd = ctx.Process(target=forwarder, args=(q, transport, self.copy), daemon=True)
        self.fwd.start()
        self.addr = q.get(timeout=30)
        self.workers = [ctx.Process(target=echo_worker, args=(self.addr, small_reply, self.copy),
                                    daemon=True) for _ in range(n_workers)]
        for w in self.workers:
            w.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(self.addr)
        time.sleep(0.5)
        self.roundtrip(b"warm")

    def roundtrip(self, payload: Any) -> None:
        self.sock.send_multipart([b"Q", payload], copy=self.copy)
        self.sock.recv_multipart(copy=self.copy)

    def pipelined(self, payloads: list[Any], window: int = 256) -> None:
        sent = recv = 0
        n = len(payloads)
        while recv < n:
            while sent < n and sent - recv < window:
                self.sock.send_multipart([b"Q", payloads[sent]], copy=self.copy)
                sent += 1
            self.sock.recv_multipart(copy=self.copy)
            recv += 1

    def close(self) -> None:
        for _ in self.workers:
            self.sock.send_multipart([b"Q", b"stop"])
        self.sock.send_multipart([b"X"])
        time.sleep(0.2)
        for p in [self.fwd, *self.workers]:
            p.join(2)
            if p.is_alive():
                p.kill()
        self.sock.close(0)
        self.ctx.term()


def direct_worker(addr_q: Any) -> None:
    """A ROUTER echo worker that clients reach straight, no forwarder: the floor of a
    call under a lease (client -> worker -> client, over TCP loopback as gpufn's)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    addr_q.put(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    while True:
        client, payload = sock.recv_multipart()
        if payload == b"stop":
            break
        sock.send_multipart([client, b"ok"])
    sock.close(0)
    ctx.term()


class RawDirect:
    """client -> worker -> client: two hops, the new floor (issue: repeat calls skip the head)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.worker = ctx.Process(target=direct_worker, args=(q,), daemon=True)
        self.worker.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(q.get(timeout=30))
        self.roundtrip(b"warm")

    def roundtrip(self, payload: Any) -> None:
        self.sock.send(payload)
        self.sock.recv()

    def pipelined(self, payloads: list[Any], window: int = 256) -> None:
        sent = recv = 0
        n = len(payloads)
        while recv < n:
            while sent < n and sent - recv < window:
                self.sock.send(payloads[sent])
                sent += 1
            self.sock.recv()
            recv += 1

    def close(self) -> None:
        self.sock.send(b"stop")
        self.worker.join(2)
        if self.worker.is_alive():
            self.worker.kill()
        self.sock.close(0)
        self.ctx.term()


def best_roundtrip_us(path: RawPath, n: int, payload: bytes = b"x") -> float:
    """p50 of `n` round trips (after 200 to warm up), in µs."""
    for _ in range(200):
        path.roundtrip(payload)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        path.roundtrip(payload)
        lat.append(time.perf_counter() - t)
    lat.sort()
    return lat[len(lat) // 2] * 1e6
