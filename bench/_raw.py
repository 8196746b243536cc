"""Raw pyzmq baselines for bench/overhead.py: the transport's floor for gpufn's path.

A forwarding process with one ROUTER (clients and echo workers both connect, as with
gpufn's scheduler) relays each request to an echo worker and the reply back:
client -> forwarder -> worker -> forwarder -> client, no Python logic besides routing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import zmq


def forwarder(addr_q: Any, transport: str) -> None:
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
    rr = 0
    while True:
        frames = sock.recv_multipart(copy=False)
        sender = frames[0].bytes
        kind = frames[1].bytes
        if kind == b"W":  # worker hello
            workers.append(sender)
        elif kind == b"Q":  # client request: [client, Q, payload...]
            w = workers[rr % len(workers)]
            rr += 1
            sock.send_multipart([w, sender, *frames[2:]], copy=False)
        elif kind == b"R":  # worker reply: [worker, R, client, payload...]
            sock.send_multipart([frames[2], *frames[3:]], copy=False)
        elif kind == b"X":
            break
    sock.close(0)
    ctx.term()
    if addr.startswith("ipc://"):
        os.unlink(addr.removeprefix("ipc://"))


def echo_worker(addr: str, small_reply: bool) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    sock.send_multipart([b"W"])
    while True:
        frames = sock.recv_multipart(copy=False)
        client = frames[0]
        if frames[1].bytes == b"stop":
            break
        sock.send_multipart([b"R", client, b"ok"] if small_reply else [b"R", client, *frames[1:]],
                            copy=False)


class RawPath:
    def __init__(self, n_workers: int = 1, small_reply: bool = False, transport: str = "tcp") -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.fwd = ctx.Process(target=forwarder, args=(q, transport), daemon=True)
        self.fwd.start()
        self.addr = q.get(timeout=30)
        self.workers = [ctx.Process(target=echo_worker, args=(self.addr, small_reply), daemon=True)
                        for _ in range(n_workers)]
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
        self.sock.send_multipart([b"Q", payload], copy=False)
        self.sock.recv_multipart(copy=False)

    def pipelined(self, payloads: list[Any], window: int = 256) -> None:
        sent = recv = 0
        n = len(payloads)
        while recv < n:
            while sent < n and sent - recv < window:
                self.sock.send_multipart([b"Q", payloads[sent]], copy=False)
                sent += 1
            self.sock.recv_multipart(copy=False)
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
