"""The worker process shell: one per device, owning its CUDA context.

A DEALER socket to the scheduler, a handshake with protocol version, heartbeats that
keep flowing while user code runs in executor threads, and output shipping.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

import zmq

from gpufn import _sockets
from gpufn import protocol as p
from gpufn.worker.core import Execute, Exit, Interrupt, SendMsg, WorkerCore
from gpufn.worker.executor import Executor
from gpufn.worker.output import OutputRouter

log = logging.getLogger("gpufn.worker")

HEARTBEAT_SECONDS = 1.0
OUTPUT_FLUSH_SECONDS = 0.05


def _torch_device(kind: str) -> Any:
    try:
        import torch
    except ImportError:
        return "cpu"
    if kind == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


class WorkerProcess:
    def __init__(self, address: str, token: str, device_key: str, incarnation: int, kind: str) -> None:
        self.device_key = device_key
        self.incarnation = incarnation
        self.router = OutputRouter()
        self.router.install()
        self.core = WorkerCore(device_key, _torch_device(kind))
        self._done: deque[p.Result] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.executor = Executor(self.router, self._on_done)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        _sockets.configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, f"w/{device_key}/{incarnation}/{os.getpid()}".encode())
        self.sock.connect(address)
        self.token = token
        self._running = True

    def _on_done(self, result: p.Result) -> None:
        self._done.append(result)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is already awake

    def _send(self, msg: p.Message) -> None:
        self.sock.send_multipart(p.encode(msg), copy=False)

    def hello(self) -> None:
        self._send(p.Hello(p.Role.WORKER, p.PROTOCOL_VERSION, self.token, os.getpid(),
                           {"device": self.device_key, "incarnation": self.incarnation}))

    def handshake(self, timeout: float = 60.0) -> None:
        self.hello()
        if not self.sock.poll(int(timeout * 1000)):
            raise SystemExit(f"no answer from the scheduler within {timeout:.0f}s")
        msg = p.decode(self.sock.recv_multipart())
        if not isinstance(msg, p.Welcome) or not msg.ok:
            raise SystemExit(f"scheduler refused this worker: {getattr(msg, 'message', msg)}")

    def _act(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Execute):
                self.executor.submit(a.call)
            elif isinstance(a, SendMsg):
                if isinstance(a.msg, p.Result):
                    for out in self.router.drain(a.msg.invocation_id):
                        self._send(out)
                self._send(a.msg)
            elif isinstance(a, Interrupt):
                self.executor.interrupt(a.invocation_id)
            elif isinstance(a, Exit):
                log.info("worker %s exiting: %s", self.device_key, a.reason)
                self._running = False

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        while self._running:
            now = time.monotonic()
            if now >= next_beat:
                self._send(p.Heartbeat(self.executor.running(), {"completed": self.core.completed}))
                next_beat = now + HEARTBEAT_SECONDS
            wait = next_beat - now
            if self.router.pending():
                wait = min(wait, OUTPUT_FLUSH_SECONDS)
            ready = dict(poller.poll(max(0, int(wait * 1000))))
            if ready.get(self._wake_r):
                try:
                    os.read(self._wake_r, 65536)
                except BlockingIOError:
                    pass
            while self._done:
                self._act(self.core.done(self._done.popleft()))
            if ready.get(self.sock):
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = p.decode(frames)
                    if isinstance(msg, p.Error):
                        log.warning("scheduler: %s", msg.message)
                        if msg.error_kind == "AuthenticationError":
                            self.hello()  # the scheduler restarted: announce ourselves again
                        continue
                    try:
                        self._act(self.core.handle(msg))
                    except Exception as e:  # a bad message must not take the worker down
                        log.exception("failed to handle %s", type(msg).__name__)
                        inv = getattr(msg, "invocation_id", None)
                        if isinstance(msg, p.Run) and inv:
                            self.core.running.discard(inv)
                            self._send(p.Result(inv, False, "GpufnError",
                                                f"worker {self.device_key} failed: {e}", {}))
            if self.router.pending():
                for out in self.router.drain():
                    self._send(out)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m gpufn.worker")
    ap.add_argument("--address", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--incarnation", type=int, default=1)
    ap.add_argument("--kind", default="cpu")
    a = ap.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s gpufn-worker[{a.device}] %(levelname)s %(message)s"))
    glog = logging.getLogger("gpufn")
    glog.addHandler(handler)
    glog.setLevel(os.environ.get("GPUFN_LOG_LEVEL", "WARNING").upper())
    glog.propagate = False
    token = os.environ.get("GPUFN_TOKEN", "")
    worker = WorkerProcess(a.address, token, a.device, a.incarnation, a.kind)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    worker.handshake()
    try:
        worker.serve()
    finally:
        worker.close()
    # Executor threads may still run user code; do not wait for them.
    threading.Event().wait(0.05)
    os._exit(0)
