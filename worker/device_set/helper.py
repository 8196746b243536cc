"""`@gpu(count=N, spmd=False)`: one process that sees all N granted devices.

A device worker is pinned to its own GPU (CUDA_VISIBLE_DEVICES set before torch
starts), so it cannot see the others. For a single-process multi-device call the first
device's worker starts a helper process pinned to the whole set (by UUID) and runs the
call there; the other devices' workers are held idle meanwhile. The helper is kept warm
for the same device set and replaced when the set changes.

Cost: the first call on a device set pays a process start with a torch import and, on
GPUs, a CUDA context on each device (seconds; ~300-500 MiB per device while warm).
Repeat calls on the same set pay a pipe round trip; arguments and result cross it as the
pickled frames they arrived and leave as (the worker never unpickles them).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from gpufn.wire import jsonwire
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser

POLL_SECONDS = 0.05


def send(conn: Connection, msg: p.Message) -> None:
    """One protocol message over the pipe: its frame count, then each frame."""
    frames = p.encode(msg)
    conn.send_bytes(len(frames).to_bytes(4, "little"))
    for f in frames:
        conn.send_bytes(f)


def recv(conn: Connection) -> p.Message:
    n = int.from_bytes(conn.recv_bytes(), "little")
    return p.decode([conn.recv_bytes() for _ in range(n)])


class _PipeStream:
    def __init__(self, conn: Connection, name: str, lock: threading.Lock) -> None:
        self.conn, self.name, self.lock = conn, name, lock
        self.inv = ""  # the call whose output this is

    def write(self, s: str) -> int:
        if s:
            with self.lock:
                send(self.conn, p.Output(self.inv, self.name, s))
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _helper_main(conn: Connection, kind: str, count: int, parent: int, visible: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before torch starts CUDA
    from gpufn.net import processes
    from gpufn.runtime import context as ctxmod

    processes.watch_parent(parent, lambda: os._exit(0))
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
        msg = recv(conn)
        if not isinstance(msg, p.HelperRun):
            return  # Shutdown
        inv = msg.invocation_id
        for s in streams:
            s.inv = inv
        try:
            if msg.code_id not in code:
                code[msg.code_id] = ser.load_code(msg.frames[:msg.code_frames])
            ctxmod._set(ctxmod.CallContext(invocation_id=inv, function=msg.name, device=devices[0],
                                           devices=list(devices), attempt=msg.attempt))
            payload = msg.frames[msg.code_frames:]
            if jsonwire.is_json(payload):  # a call made over HTTP: JSON in, JSON out
                args, kwargs = jsonwire.load_call(payload)
                out = jsonwire.dump_value(code[msg.code_id](*args, **kwargs),
                                          f"the value returned by {msg.name}")
            else:
                args, kwargs = ser.loads(payload)
                out = ser.dumps(code[msg.code_id](*args, **kwargs))
            reply = p.HelperResult(inv, True, frames=tuple(out))
        except BaseException as e:
            frames, tb = ser.dump_exception(e)
            reply = p.HelperResult(inv, False, type(e).__name__, str(e), tb, tuple(frames))
        finally:
            ctxmod._set(None)
        with lock:
            send(conn, reply)


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

    def run(self, inv: str, name: str, code_id: str, code_frames: list[bytes],
            frames: tuple[Any, ...], attempt: int) -> tuple[Any, ...]:
        """Run the call in the helper on its pickled argument frames and return the
        pickled result frames (`attempt`: the attempt number, 1, 2, ...); its prints go to
        this thread's stdout/stderr.

        If waiting ends any other way than with this call's reply (a cancel, a dead
        helper), the helper is killed: it may still be running the call, and a later call
        must never receive this one's output or value."""
        with self._lock:
            try:
                return self._run(inv, name, code_id, code_frames, frames, attempt)
            except BaseException:
                self.close(force=True)
                raise

    def _run(self, inv: str, name: str, code_id: str, code_frames: list[bytes],
             frames: tuple[Any, ...], attempt: int) -> tuple[Any, ...]:
        send_code = code_frames if code_id not in self.sent_code else []
        send(self.conn, p.HelperRun(inv, name, code_id, attempt, len(send_code),
                                    (*send_code, *frames)))
        self.sent_code.add(code_id)
        while True:
            while not self.conn.poll(POLL_SECONDS):  # short waits let a cancel land
                if not self.proc.is_alive():
                    raise RuntimeError(f"the multi-device helper process died "
                                       f"(exit code {self.proc.exitcode})")
            msg = recv(self.conn)
            if not isinstance(msg, (p.Output, p.HelperResult)) or msg.invocation_id != inv:
                continue  # from an earlier call (cannot happen once killed; kept safe)
            if isinstance(msg, p.Output):
                (sys.stdout if msg.stream == "stdout" else sys.stderr).write(msg.text)
                continue
            if msg.ok:
                return msg.frames
            raise ser.load_exception(msg.frames, msg.error_type, msg.message, msg.traceback,
                                     f"traceback in the multi-device process of {name}:")

    def close(self, force: bool = False) -> None:
        if force:
            self.proc.kill()
        try:
            send(self.conn, p.Shutdown("closing"))
        except (OSError, ValueError):
            pass
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)


def stop_tracker() -> None:
    """At the worker's exit, after its helper is gone: multiprocessing's resource tracker,
    which the first spawned helper started, goes too (else the supervisor finds it in the
    worker's session and stops it as a call's leftover)."""
    from multiprocessing import resource_tracker

    try:
        resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]
    except Exception:  # not running, or a Python whose tracker has no _stop: it exits by itself
        pass
