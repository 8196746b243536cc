"""`@gpu(count=N, spmd=False)`: one process that sees all N granted devices.

A device worker is pinned to its own GPU (CUDA_VISIBLE_DEVICES set before torch
starts), so it cannot see the others. For a single-process multi-device call the first
device's worker starts a helper process pinned to the whole set (by UUID) and runs the
call there; the other devices' workers are held idle meanwhile. The helper is kept warm
for the same device set and replaced when the set changes.

Cost: the first call on a device set pays a process start with a torch import and, on
GPUs, a CUDA context on each device (seconds; ~300-500 MiB per device while warm).
Repeat calls on the same set pay a pipe round trip and a second (de)serialization of
arguments and result.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from gpufn import serialization as ser

POLL_SECONDS = 0.05


class _PipeStream:
    def __init__(self, conn: Connection, name: str, lock: threading.Lock) -> None:
        self.conn, self.name, self.lock = conn, name, lock
        self.inv = ""  # the call whose output this is

    def write(self, s: str) -> int:
        if s:
            with self.lock:
                self.conn.send(("out", self.inv, self.name, s))
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _helper_main(conn: Connection, kind: str, count: int, parent: int, visible: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before torch starts CUDA
    from gpufn import _sockets
    from gpufn import call_context as ctxmod

    _sockets.watch_parent(parent, lambda: os._exit(0))
    import torch

    if kind == "cuda" and torch.cuda.is_available():
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        devices = [torch.device("cpu")] * count
    lock = threading.Lock()
    streams = [_PipeStream(conn, "stdout", lock), _PipeStream(conn, "stderr", lock)]
    sys.stdout, sys.stderr = streams
    code: dict[str, Any] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        inv, name, code_id, code_frames, arg_frames, attempt = msg
        for s in streams:
            s.inv = inv
        t0 = time.perf_counter()
        try:
            if code_id not in code:
                code[code_id] = ser.load_code(code_frames)
            ctxmod._set(ctxmod.CallContext(invocation_id=inv, function=name, device=devices[0],
                                           devices=list(devices), attempt=attempt))
            args, kwargs = ser.loads(arg_frames)
            frames = ser.dumps(code[code_id](*args, **kwargs))
            reply: tuple[Any, ...] = ("ok", [bytes(memoryview(f)) for f in frames])
        except BaseException as e:
            frames, tb = ser.dump_exception(e)
            reply = ("err", [bytes(memoryview(f)) for f in frames], type(e).__name__, str(e), tb)
        finally:
            ctxmod._set(None)
        with lock:
            conn.send((reply[0], inv, *reply[1:], time.perf_counter() - t0))


class DeviceSetHelper:
    """A warm helper process pinned to one set of devices."""

    def __init__(self, devices: list[dict[str, Any]]) -> None:
        self.keys = tuple(d["key"] for d in devices)
        kind = devices[0].get("kind", "cpu")
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.sent_code: set[str] = set()
        self._lock = threading.Lock()
        visible = ",".join(d["uuid"] for d in devices) if kind == "cuda" else ""
        self.proc = ctx.Process(target=_helper_main,
                                args=(child, kind, len(devices), os.getpid(), visible),
                                name="gpufn-multidevice", daemon=True)
        self.proc.start()
        child.close()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def run(self, inv: str, name: str, code_id: str, code_frames: list[bytes], args: tuple[Any, ...],
            kwargs: dict[str, Any], attempt: int) -> Any:
        """Run the call in the helper; its prints go to this thread's stdout/stderr.

        If waiting ends any other way than with this call's reply (a cancel, a dead
        helper), the helper is killed: it may still be running the call, and a later call
        must never receive this one's output or value."""
        with self._lock:
            try:
                return self._run(inv, name, code_id, code_frames, args, kwargs, attempt)
            except BaseException:
                self.close(force=True)
                raise

    def _run(self, inv: str, name: str, code_id: str, code_frames: list[bytes],
             args: tuple[Any, ...], kwargs: dict[str, Any], attempt: int) -> Any:
        frames = [bytes(memoryview(f)) for f in ser.dumps((args, kwargs))]
        send_code = code_frames if code_id not in self.sent_code else []
        self.conn.send((inv, name, code_id, send_code, frames, attempt))
        self.sent_code.add(code_id)
        while True:
            while not self.conn.poll(POLL_SECONDS):  # short waits let a cancel land
                if not self.proc.is_alive():
                    raise RuntimeError(f"the multi-device helper process died "
                                       f"(exit code {self.proc.exitcode})")
            msg = self.conn.recv()
            if msg[1] != inv:
                continue  # from an earlier call (cannot happen once killed; kept safe)
            if msg[0] == "out":
                (sys.stdout if msg[2] == "stdout" else sys.stderr).write(msg[3])
                continue
            if msg[0] == "ok":
                return ser.loads(msg[2])
            raise ser.load_exception(msg[2], msg[3], msg[4], msg[5],
                                     f"traceback in the multi-device process of {name}:")

    def close(self, force: bool = False) -> None:
        if force:
            self.proc.kill()
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)
