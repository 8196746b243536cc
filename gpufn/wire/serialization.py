"""Pickling of user code, arguments, results and exceptions into zero-copy frames.

A payload is `[pickle_stream, *buffers]`: pickle protocol 5 with out-of-band buffers, so
tensors, arrays, bytes and any `pickle.PickleBuffer` travel as their own frames without a
copy into the stream; on one host the largest go as shared-memory files (gpufn/wire/shm.py),
a buffer's frame then naming its file (`shm.mark`).
Functions from `__main__` and notebook cells pickle by value (cloudpickle).
"""

from __future__ import annotations

import hashlib
import io
import linecache
import mmap
import os
import pickle
import sys
import threading
import traceback
import types
from collections.abc import Sequence
from typing import Any

import cloudpickle

from gpufn.exceptions import PayloadTooLarge, RemoteError, RemoteTraceback, SerializationError
from gpufn.wire import config, source_lines
from gpufn.wire import shm as shmem

# Buffers below this size stay inside the pickle stream (a frame costs more than a copy).
OOB_THRESHOLD = 64 * 1024


def _rebuild_bytes(buf: Any, mutable: bool) -> bytes | bytearray:
    return bytearray(buf) if mutable else bytes(buf)


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    mv = memoryview(buf)
    if mv.nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        # Zero-copy over the received frame (writable); copy only if it is read-only.
        flat = torch.frombuffer(mv if not mv.readonly else bytearray(mv), dtype=torch.uint8)
    t = flat.view(getattr(torch, dtype)).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _rebuild_shm_bytes(name: str, nbytes: int, mutable: bool) -> bytes | bytearray:
    mm = shmem.take(name, nbytes)
    try:
        return bytearray(mm) if mutable else bytes(mm)
    finally:
        if isinstance(mm, mmap.mmap):
            mm.close()


def _rebuild_shm_tensor(name: str, nbytes: int, dtype: str, shape: tuple[int, ...],
                        requires_grad: bool, offset: int = 0) -> Any:
    """A tensor that is a view of the shared-memory file's mapping (no copy), at `offset`
    in it; the file is unlinked (a pooled one is in use as long as the tensor), so the
    memory goes back when the tensor is freed."""
    import torch

    if nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(shmem.take(name, offset + nbytes), dtype=torch.uint8)[offset:]
    t = flat.view(getattr(torch, dtype)).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _out_of_band(raw: memoryview, shm: shmem.Outgoing | None) -> Any:
    """The frame of an out-of-band buffer: its bytes, or with `shm` and at least its
    threshold, a mark naming the shared-memory file they were written to (or the
    argument's file they lie in, for a worker's result: named, not copied)."""
    if shm is None or raw.nbytes < shm.threshold:
        return raw
    at = shm.view_of(_address(raw), raw.nbytes) if shm.lent else None
    name, offset = at if at is not None else (shm.put(raw), 0)
    if name is None:  # no room in shared memory (said once): through the socket
        return raw
    return shmem.mark(name, raw.nbytes, offset, raw.readonly)


def _address(view: memoryview) -> int:
    """Where a contiguous buffer's bytes start in this process."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _received_buffer(frame: Any) -> Any:
    """A received out-of-band frame as the buffer pickle hands its reconstructor: the
    frame itself, or for a shared-memory mark (shorter than any real out-of-band frame)
    a view of the file's mapping, no copy, which keeps the mapping (and a pooled file's
    use) alive as long as it or what views it."""
    if len(frame) >= OOB_THRESHOLD:
        return frame
    name, nbytes, offset, readonly = shmem.marked(frame)
    view = memoryview(shmem.take(name, offset + nbytes))[offset:offset + nbytes]
    return view.toreadonly() if readonly else view


def _contiguous_array(obj: Any) -> Any:
    """A large numpy array that is neither C- nor F-contiguous, reduced as a contiguous
    copy, so its bytes go out of band (numpy pickles such an array's bytes in-band)."""
    np = sys.modules.get("numpy")
    if (np is None or type(obj) is not np.ndarray or obj.nbytes < OOB_THRESHOLD
            or obj.dtype.hasobject or obj.flags.c_contiguous or obj.flags.f_contiguous):
        return NotImplemented
    return np.ascontiguousarray(obj).__reduce_ex__(5)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle plus out-of-band buffers for torch tensors and large bytes, and with
    `shm` set, shared-memory files for the largest (see gpufn/wire/shm.py; every other
    out-of-band buffer, numpy's among them, takes that path in `dumps`' callback).

    Tensors arrive on the CPU: a result never pulls a CUDA context into the caller.
    """

    shm: shmem.Outgoing | None = None

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        shm = self.shm
        if t is _OOBBytes and shm is not None and len(obj.data) >= shm.threshold:
            obj, t = obj.data, type(obj.data)
        if (t is bytes or t is bytearray) and len(obj) >= OOB_THRESHOLD:
            if shm is not None and len(obj) >= shm.threshold:
                name = shm.put(memoryview(obj))
                if name is not None:  # else the tmpfs is full: through the socket
                    return _rebuild_shm_bytes, (name, len(obj), t is bytearray)
            return _rebuild_bytes, (pickle.PickleBuffer(obj), t is bytearray)
        torch = sys.modules.get("torch")
        if (torch is not None and t is torch.Tensor and obj.layout is torch.strided
                and not obj.is_quantized and obj.nbytes >= OOB_THRESHOLD):
            c = obj.detach().to("cpu").contiguous()
            raw = c.reshape(-1).view(torch.uint8).numpy()
            dtype = str(c.dtype).removeprefix("torch.")
            if shm is not None and obj.nbytes >= shm.threshold:
                at = shm.view_of(c.data_ptr(), int(raw.nbytes)) if shm.lent else None
                if at is not None:  # the result is (in) an argument's file: named, not copied
                    return _rebuild_shm_tensor, (at[0], int(raw.nbytes), dtype, tuple(c.shape),
                                                 obj.requires_grad, at[1])
                name = shm.put(memoryview(raw))
                if name is not None:  # else the tmpfs is full: through the socket
                    return _rebuild_shm_tensor, (name, int(raw.nbytes), dtype, tuple(c.shape),
                                                 obj.requires_grad)
            return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype,
                                     tuple(c.shape), obj.requires_grad)
        reduced = _contiguous_array(obj)
        return reduced if reduced is not NotImplemented else super().reducer_override(obj)


class _OOBBytes:
    """Large bytes/bytearray wrapped so pickle sends them out of band (the C pickler
    writes bytes in-band and never asks `reducer_override` about them)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _rebuild_bytes, (pickle.PickleBuffer(self.data), type(self.data) is bytearray)


def _wrap_bytes(obj: Any, depth: int = 3) -> Any:
    """Wrap large bytes found in arguments and results (containers up to `depth` deep)."""
    t = type(obj)
    if t is bytes or t is bytearray:
        return _OOBBytes(obj) if len(obj) >= OOB_THRESHOLD else obj
    if depth == 0:
        return obj
    if t is tuple or t is list:
        items = [_wrap_bytes(x, depth - 1) for x in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return t(items)
    if t is dict:
        vals = {k: _wrap_bytes(v, depth - 1) for k, v in obj.items()}
        return obj if all(vals[k] is v for k, v in obj.items()) else vals
    return obj


_SCALARS = (int, float, str, bool, type(None), complex)


def plain(obj: Any, depth: int = 3) -> bool:
    """Small scalars and small containers of them: the C pickler alone is exact for these
    (nothing to send by value) and several times faster than cloudpickle's."""
    t = type(obj)
    if t in _SCALARS or (t is bytes and len(obj) < OOB_THRESHOLD):
        return True
    if depth == 0:
        return False
    if t is tuple or t is list:
        return len(obj) <= 32 and all(plain(x, depth - 1) for x in obj)
    if t is dict:
        return len(obj) <= 32 and all(type(k) is str and plain(v, depth - 1)
                                      for k, v in obj.items())
    return False


def dumps(obj: Any, shm: shmem.Outgoing | None = None, is_plain: bool = False) -> list[Any]:
    """Frames for obj: the pickle stream then each large out-of-band buffer. With `shm`,
    buffers of at least `shm.threshold` bytes go into shared-memory files instead (their
    names in the stream or in the buffer's frame); on failure the files made so far are
    removed. `is_plain`: the caller found `plain(obj)` already."""
    if is_plain or plain(obj):
        return [pickle.dumps(obj, protocol=5)]
    obj = _wrap_bytes(obj)
    buffers: list[Any] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < OOB_THRESHOLD:
            return True  # serialize in-band
        buffers.append(_out_of_band(raw, shm))
        return False

    out = io.BytesIO()
    pickler = _Pickler(out, protocol=5, buffer_callback=keep)
    pickler.shm = shm
    try:
        pickler.dump(obj)
    except BaseException:
        if shm is not None:
            shmem.release(shm.names)
            shm.names.clear()
        raise
    return [out.getvalue(), *buffers]


def loads(frames: Sequence[Any]) -> Any:
    """Inverse of dumps; accepts bytes, memoryviews or zmq Frames."""
    if not frames:
        raise SerializationError("empty payload: nothing was sent to unpickle")
    head = frames[0]
    bufs = [_received_buffer(f.buffer if hasattr(f, "buffer") else f) for f in frames[1:]]
    stream = head.buffer if hasattr(head, "buffer") else head
    return pickle.loads(stream, buffers=bufs)


def content_hash(*parts: bytes | memoryview) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))  # length-prefixed: ("a", "b") != ("ab",)
        h.update(p)
    return h.hexdigest()


def dump_code(fn: Any, name: str) -> tuple[str, list[Any]]:
    """(code id, frames) for a callable; the id is its content hash.

    cloudpickle renames pickled code to "<dynamic-code>"; the source file's name and
    lines travel along so remote tracebacks show the user's file, line and source
    (notebook cells included: their lines come from this process's linecache).
    """
    target = getattr(fn, "__gpufn_target__", fn)  # a function wrapped with its call options
    if getattr(target, "__module__", None) == "__main__":
        from gpufn.wire.byvalue import register_main_locals

        register_main_locals()  # a script's or notebook's helper modules go along by value
    code = getattr(target, "__code__", None)
    filename = code.co_filename if code is not None else ""
    lines: dict[int, str] = {}
    if filename:
        whole = linecache.getlines(filename, getattr(target, "__globals__", None))
        if sum(map(len, whole)) <= 2_000_000:
            lines = source_lines.needed(target, filename, whole)
    try:
        frames = dumps((fn, filename, lines))
    except Exception as e:
        raise SerializationError(
            f"function {name!r} cannot be pickled: {e}. A function sent to a worker may only "
            "close over picklable values; create locks, sockets and open files inside it."
        ) from e
    return content_hash(*frames), frames


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


# Unpickling code imports the modules it names; two threads doing so at once (a worker's
# main thread loading a function, its loader thread a model's loader, both importing
# gpufn.engines) can meet Python's import-lock deadlock detection (_DeadlockError, seen
# in a CI run). One at a time: code is loaded once per function or model.
_CODE_LOADS = threading.RLock()


def load_code(frames: Sequence[Any]) -> Any:
    """The callable from dump_code frames, with its source file name and lines restored."""
    with _CODE_LOADS:
        fn, filename, lines = loads(frames)
    target = getattr(fn, "__gpufn_target__", fn)
    code = getattr(target, "__code__", None)
    if filename and code is not None and code.co_filename != filename:
        try:
            target.__code__ = _renamed(code, filename)
        except (AttributeError, TypeError, ValueError):
            pass
    if filename and lines and not os.path.exists(filename):
        source_lines.install(filename, lines)
    return fn


def payload_bytes(frames: Sequence[Any]) -> int:
    """The size of a payload's frames (bytes, memoryviews or zmq Frames), without copying."""
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


def check_payload(frames: Sequence[Any], what: str, extra: int = 0) -> None:
    """Refuse a payload over GPUFN_MAX_PAYLOAD before it is sent anywhere (`extra`: the
    bytes it put in shared memory, which count too)."""
    limit = config.max_payload()
    size = payload_bytes(frames) + extra
    if size > limit:
        raise PayloadTooLarge(
            f"{what} is {size} bytes, over the limit of {limit} bytes (GPUFN_MAX_PAYLOAD); "
            "nothing was sent. Pass a path or a model handle instead of the data, split the "
            "work, or raise GPUFN_MAX_PAYLOAD on the scheduler, workers and clients alike.")


def dump_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              shm: shmem.Outgoing | None = None, is_plain: bool = False) -> list[Any]:
    """Frames for a call's arguments; on failure name the argument that cannot be pickled.
    Arguments over GPUFN_MAX_PAYLOAD raise PayloadTooLarge here, at the call site."""
    try:
        frames = dumps((args, kwargs), shm, is_plain)
    except Exception as e:
        culprit = "the arguments"
        for i, a in enumerate(args):
            try:
                cloudpickle.dumps(a)
            except Exception:
                culprit = f"positional argument {i} ({type(a).__name__})"
                break
        else:
            for k, v in kwargs.items():
                try:
                    cloudpickle.dumps(v)
                except Exception:
                    culprit = f"keyword argument {k!r} ({type(v).__name__})"
                    break
        raise SerializationError(
            f"cannot send {culprit} of {name}(): {e}. Nothing was sent. Pass data that can be "
            "pickled (tensors, arrays, plain Python values), or build the object inside the function."
        ) from None
    try:
        check_payload(frames, f"the arguments of {name}()", shm.nbytes if shm else 0)
    except PayloadTooLarge:
        if shm is not None:
            shmem.release(shm.names)
        raise
    return frames


def dump_exception(exc: BaseException) -> tuple[list[Any], str]:
    """(frames, traceback text) for an exception raised by user code.

    The frames hold the exception itself when it survives a pickle round trip here,
    else a RemoteError carrying its type name, message and traceback text.
    """
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        frames = dumps(exc.with_traceback(None))
        loads(frames)  # an exception that pickles but cannot be rebuilt is common
    except Exception:
        frames = dumps(RemoteError(type(exc).__name__, str(exc), tb))
    return frames, tb


def load_exception(
    frames: Sequence[Any], type_name: str, message: str, tb: str, where: str
) -> BaseException:
    """Rebuild a remote exception as its own type with the remote traceback as `__cause__`;
    a RemoteError (type name, message, traceback text) when the type is not importable here."""
    try:
        exc = loads(frames)
        if not isinstance(exc, BaseException):
            raise TypeError(f"payload is a {type(exc).__name__}, not an exception")
    except Exception:
        exc = RemoteError(type_name, message, tb)
    if isinstance(exc, RemoteError) and not exc.traceback:
        exc.traceback = tb
    exc.__cause__ = RemoteTraceback(f"{where}\n{tb}")
    try:
        exc.remote_traceback = tb
    except Exception:
        pass
    return exc
