"""The worker-side allocator boundary: one device's loaded models, measured (a
`torch.cuda.MemPool` per model on CUDA, storage bytes on CPU), moved between device and
host in place, with out-of-memory turned into `gpufn.OutOfMemory`.
"""

from __future__ import annotations

import gc
import os
import re
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from gpufn.exceptions import OutOfMemory
from gpufn.wire.units import format_bytes

T = TypeVar("T")

MAX_DEPTH = 8  # container/attribute nesting followed below a module or the loaded object
MAX_OBJECTS = 200_000  # objects visited at most while looking for tensors

_SKIP = (str, bytes, bytearray, int, float, complex, bool, type(None), range, type,
         types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.CodeType, types.FrameType)
_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


# ---------------------------------------------------------------------------- tensors

def find_tensors(obj: Any, *, max_depth: int = MAX_DEPTH,
                 max_objects: int = MAX_OBJECTS) -> list[torch.Tensor]:
    """Every distinct tensor object reachable from `obj`: module parameters and buffers
    (all submodules), tensors in attributes, dicts, lists, tuples and sets. Nesting
    below modules is followed `max_depth` levels; cycles are visited once."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack and len(seen) < max_objects:
        o, depth = stack.pop()
        if isinstance(o, _SKIP) or id(o) in seen or depth > max_depth:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            # A DTensor (a tensor-parallel shard) is moved and measured by its local
            # tensor: this rank's bytes, not the global shape's.
            local = getattr(o, "_local_tensor", None)
            found.append(local if isinstance(local, torch.Tensor) else o)
        elif isinstance(o, nn.Module):
            for m in o.modules():  # submodules cost no depth: models nest deeply
                seen.add(id(m))
                stack.extend((t, depth) for t in m._parameters.values() if t is not None)
                stack.extend((t, depth) for t in m._buffers.values() if t is not None)
                stack.extend((v, depth + 1) for k, v in vars(m).items()
                             if k not in _MODULE_SLOTS)
        elif isinstance(o, dict):
            stack.extend((v, depth + 1) for v in o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in o)
        else:
            attrs = getattr(o, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend((v, depth + 1) for v in attrs.values())
    return found


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor whose bytes live in one untyped storage we can copy as a whole."""
    return (t.layout == torch.strided and not t.is_meta
            and type(t) in (torch.Tensor, nn.Parameter))


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _tensor_bytes(t: torch.Tensor) -> int:
    if t.is_meta:
        return 0
    if _plain(t):
        return int(t.untyped_storage().nbytes())
    return int(t.element_size() * t.numel())


def measure_nbytes(obj: Any) -> int:
    """Bytes of all distinct tensor storages reachable from `obj` (shared storages,
    tied weights and views counted once; meta tensors count nothing)."""
    sizes: dict[tuple[Any, ...], int] = {}
    for t in find_tensors(obj):
        key = _storage_key(t) if _plain(t) else ("tensor", id(t))
        sizes[key] = _tensor_bytes(t)
    return sum(sizes.values())


def _rebind(t: torch.Tensor, device: torch.device, storage: Any = None) -> None:
    """Point `t` at `storage` (same offset, shape, strides), or at a copy on `device`.

    `.data =` keeps the Python object (Parameters stay Parameters, references held by
    user code stay valid) while its bytes move. An inference tensor must get an
    inference tensor, so the new one is made in the same mode.
    """
    with torch.inference_mode(t.is_inference()):
        if storage is None:
            t.data = t.data.to(device)
        else:
            t.data = torch.empty(0, dtype=t.dtype, device=device).set_(
                storage, t.storage_offset(), t.size(), t.stride())


def move_tensors(obj: Any, device: torch.device, *, pin: bool = False,
                 force: bool = False) -> int:
    """Move every tensor reachable from `obj` to `device` in place, one copy per storage
    (views and tied weights stay shared). Tensors already there are left alone unless
    `force`. `pin` allocates page-locked host memory. Returns the bytes copied; the
    caller synchronizes the device."""
    groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    copied = 0
    for t in find_tensors(obj):
        if t.is_meta or (t.device == device and not force):
            continue
        if not _plain(t):
            copied += _tensor_bytes(t)
            _rebind(t, device)
            continue
        groups.setdefault(_storage_key(t), []).append(t)
    for ts in groups.values():
        src = ts[0].untyped_storage()
        dst = torch.empty(src.nbytes(), dtype=torch.uint8, device=device,
                          pin_memory=pin).untyped_storage()
        dst.copy_(src, non_blocking=True)
        copied += src.nbytes()
        for t in ts:
            _rebind(t, device, dst)
    return copied


# ---------------------------------------------------------------------------- out of memory

_ASKED = re.compile(r"tried to allocate\s+([0-9.]+)\s*(bytes|[KMGT]?i?B)", re.IGNORECASE)
_FREE = re.compile(r"of which\s+([0-9.]+)\s*(bytes|[KMGT]?i?B)\s+is free", re.IGNORECASE)
_UNITS = {"bytes": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "not enough memory",
            "CUDA out of memory")


def _parse_size(pattern: re.Pattern[str], text: str) -> int | None:
    m = pattern.search(text)
    if m is None:
        return None
    return int(float(m.group(1)) * _UNITS.get(m.group(2).lower(), 1))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure (CUDA OOM, torch's CPU allocator, Python)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _CPU_OOM)


def host_available() -> int | None:
    """Bytes of host memory the kernel reports available (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _device_free(device: torch.device, free: int | None) -> int | None:
    if free is not None:
        return free
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available()


def out_of_memory(exc: BaseException, device: torch.device, what: str,
                  free: int | None = None) -> OutOfMemory:
    """The gpufn.OutOfMemory for allocation failure `exc` (what it asked, what was free)."""
    text = str(exc)
    asked = _parse_size(_ASKED, text)
    free = _parse_size(_FREE, text) if free is None else free
    free = _device_free(device, free)
    asked_s = "an allocation" if asked is None else format_bytes(asked)
    free_s = "unknown" if free is None else format_bytes(free)
    first = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    return OutOfMemory(
        f"{what} ran out of memory on {device}: asked for {asked_s} with {free_s} free "
        f"({first}). Use a smaller batch, or declare the workspace with @gpu(memory=...) "
        f"so the scheduler reserves room for it."
    )


def release_workspace(device: torch.device) -> None:
    """Give the memory of a failed invocation back so the resident models keep serving."""
    gc.collect()  # frames of the failed call may sit in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_guarded(device: torch.device | str, fn: Callable[..., T], /, *args: Any,
                **kwargs: Any) -> T:
    """Run `fn(*args, **kwargs)`; an allocation failure becomes gpufn.OutOfMemory after
    the call's memory is released. Other exceptions pass through unchanged."""
    dev = torch.device(device)
    err: OutOfMemory | None = None
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if isinstance(exc, OutOfMemory) or not is_out_of_memory(exc):
            raise
        err = out_of_memory(exc, dev, f"{getattr(fn, '__name__', 'the call')}()")
    # Outside the except block the failed call's traceback (and its tensors) is gone.
    assert err is not None
    release_workspace(dev)
    raise err


# ---------------------------------------------------------------------------- arena

@dataclass(frozen=True)
class LoadReport:
    """A finished load: device bytes the model holds (on CUDA its pool's reserved
    segments), bytes of its tensors, and the loader's wall time."""

    name: str
    nbytes: int
    seconds: float
    allocated: int


@dataclass(frozen=True)
class MoveReport:
    """An offload or restore: bytes copied and how long it took."""

    name: str
    nbytes: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class _Slot:
    obj: Any
    nbytes: int
    on_device: bool = True
    pool: Any = None  # the model's torch.cuda.MemPool while on a CUDA device


def _pool_bytes(pool: Any, index: int) -> tuple[int, int]:
    """(reserved, allocated) bytes of a MemPool's segments on device `index`."""
    reserved = allocated = 0
    want = tuple(pool.id)
    try:
        segments = torch.cuda.memory_snapshot(pool.id, include_traces=False)
    except TypeError:  # older torch: no per-pool snapshot arguments
        segments = pool.snapshot() if hasattr(pool, "snapshot") else []
    for seg in segments:
        if seg.get("device", index) != index:
            continue
        if "segment_pool_id" in seg and tuple(seg["segment_pool_id"]) != want:
            continue
        reserved += int(seg["total_size"])
        allocated += int(seg["allocated_size"])
    return reserved, allocated


def _host_empty_cache() -> None:
    """Return cached page-locked host blocks to the OS (so host budgets stay true)."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


class ModelArena:
    """The models loaded on one device, inside one worker process.

    On CUDA each model lives in its own MemPool (bytes measured exactly, freed
    completely on offload/evict). On CPU (simulated devices) bytes are counted from
    tensor storages and `capacity`, when set, is enforced like a real device's memory.
    """

    def __init__(self, device: torch.device | str = "cpu", capacity: int | None = None) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.capacity = capacity
        self._slots: dict[str, _Slot] = {}
        self._busy: set[str] = set()  # names being loaded
        self._lock = threading.RLock()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ----------------------------------------------------------- views

    def get(self, name: str) -> Any:
        """The loaded instance (the same object across offload and restore)."""
        slot = self._slots.get(name)
        if slot is None:
            raise KeyError(f"model {name!r} is not loaded on {self.device}")
        if not slot.on_device:
            raise RuntimeError(f"model {name!r} is offloaded to host memory; restore it first")
        return slot.obj

    def resident(self) -> dict[str, int]:
        """Models on the device: name -> bytes."""
        return {n: s.nbytes for n, s in self._slots.items() if s.on_device}

    def offloaded(self) -> dict[str, int]:
        """Models kept in host memory: name -> bytes."""
        return {n: s.nbytes for n, s in self._slots.items() if not s.on_device}

    @property
    def used(self) -> int:
        return sum(self.resident().values())

    @property
    def free(self) -> int | None:
        """Bytes left under `capacity` (None when the device itself is the limit)."""
        return None if self.capacity is None else self.capacity - self.used

    def _slot(self, name: str, on_device: bool) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise KeyError(f"model {name!r} is not loaded on {self.device}")
        if slot.on_device != on_device:
            where = "on the device" if slot.on_device else "offloaded"
            raise RuntimeError(f"model {name!r} is already {where}")
        return slot

    def _check_room(self, what: str, nbytes: int) -> None:
        free = self.free
        if free is not None and nbytes > free:
            err = OutOfMemory(
                f"{what} needs {format_bytes(nbytes)} but {format_bytes(free)} of "
                f"{format_bytes(self.capacity or 0)} is free on {self.device}; offload or "
                f"evict other models first, or use a device with more memory")
            err.needed = nbytes  # type: ignore[attr-defined]
            raise err

    # ----------------------------------------------------------- load

    def load(self, name: str, loader: Callable[[], Any]) -> LoadReport:
        """Run `loader()`, move what it returns onto the device and register it.
        Raises OutOfMemory (nothing registered) when it does not fit."""
        with self._lock:
            if name in self._slots or name in self._busy:
                raise ValueError(f"model {name!r} is already loaded on {self.device}")
            self._busy.add(name)
        try:
            if self.is_cuda:
                return self._load_cuda(name, loader)
            return self._load_cpu(name, loader)
        finally:
            with self._lock:
                self._busy.discard(name)

    def _register(self, name: str, slot: _Slot) -> None:
        with self._lock:
            self._check_room(f"loading model {name!r}", slot.nbytes)
            self._slots[name] = slot

    def _load_cpu(self, name: str, loader: Callable[[], Any]) -> LoadReport:
        t0 = time.perf_counter()
        obj = loader()
        move_tensors(obj, self.device)
        seconds = time.perf_counter() - t0
        nbytes = measure_nbytes(obj)
        try:
            self._register(name, _Slot(obj, nbytes))
        except OutOfMemory:
            obj = None  # not kept alive by this frame in the traceback
            raise
        return LoadReport(name, nbytes, seconds, nbytes)

    def _load_cuda(self, name: str, loader: Callable[[], Any]) -> LoadReport:
        dev = self.device
        err: OutOfMemory | None = None
        obj: Any = None
        pool: Any = torch.cuda.MemPool()
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(dev), torch.cuda.use_mem_pool(pool, device=dev):
                obj = loader()
                move_tensors(obj, dev)
            torch.cuda.synchronize(dev)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            err = out_of_memory(exc, dev, f"loading model {name!r}")
        if err is not None:
            obj = pool = None  # what the loader built so far goes with the pool
            release_workspace(dev)
            raise err
        seconds = time.perf_counter() - t0
        reserved, allocated = _pool_bytes(pool, dev.index or 0)
        delta = torch.cuda.memory_allocated(dev) - before
        allocated = allocated or delta
        try:
            self._register(name, _Slot(obj, max(reserved, allocated), pool=pool))
        except OutOfMemory:
            obj = pool = None
            release_workspace(dev)
            raise
        return LoadReport(name, max(reserved, allocated), seconds, allocated)

    # ----------------------------------------------------------- move

    def offload(self, name: str) -> MoveReport:
        """Move every tensor of the model to host memory (page-locked on CUDA) and free
        its device memory completely. The model object stays the same."""
        with self._lock:
            slot = self._slot(name, on_device=True)
            t0 = time.perf_counter()
            if self.is_cuda:
                copied = move_tensors(slot.obj, torch.device("cpu"), pin=True)
                torch.cuda.synchronize(self.device)
                slot.pool = None  # destroying the MemPool returns its segments
                gc.collect()
                torch.cuda.empty_cache()
            else:
                copied = move_tensors(slot.obj, self.device, force=True)
            slot.on_device = False
            return MoveReport(name, copied, time.perf_counter() - t0)

    def restore(self, name: str) -> MoveReport:
        """Copy an offloaded model back to the device (one copy per storage), into a
        fresh MemPool on CUDA. Raises OutOfMemory, leaving it offloaded, if it won't fit."""
        with self._lock:
            slot = self._slot(name, on_device=False)
            self._check_room(f"restoring model {name!r}", slot.nbytes)
            t0 = time.perf_counter()
            if not self.is_cuda:
                copied = move_tensors(slot.obj, self.device, force=True)
                slot.on_device = True
                return MoveReport(name, copied, time.perf_counter() - t0)
            copied, err = self._restore_cuda(name, slot)
            if err is not None:
                raise err
            seconds = time.perf_counter() - t0
            slot.on_device = True
            _host_empty_cache()
            return MoveReport(name, copied, seconds)

    def _restore_cuda(self, name: str, slot: _Slot) -> tuple[int, OutOfMemory | None]:
        dev = self.device
        pool: Any = torch.cuda.MemPool()
        try:
            with torch.cuda.device(dev), torch.cuda.use_mem_pool(pool, device=dev):
                copied = move_tensors(slot.obj, dev)
            torch.cuda.synchronize(dev)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            err = out_of_memory(exc, dev, f"restoring model {name!r}")
        else:
            slot.pool = pool
            return copied, None
        # Part of it may have reached the device: put it all back on host.
        move_tensors(slot.obj, torch.device("cpu"), pin=True)
        torch.cuda.synchronize(dev)
        del pool
        release_workspace(dev)
        return 0, err

    def evict(self, name: str) -> int:
        """Drop the model completely (device memory and any host copy); returns the
        device bytes freed (0 if it was offloaded)."""
        with self._lock:
            slot = self._slots.pop(name, None)
            if slot is None:
                raise KeyError(f"model {name!r} is not loaded on {self.device}")
            freed = slot.nbytes if slot.on_device else 0
            slot.obj = slot.pool = None
            del slot
            gc.collect()
            if self.is_cuda:
                torch.cuda.empty_cache()
                _host_empty_cache()
            return freed

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`run_guarded` on this device, with the arena's free bytes in the message."""
        try:
            return run_guarded(self.device, fn, *args, **kwargs)
        except OutOfMemory as exc:
            if self.free is None:
                raise
            raise OutOfMemory(f"{exc} (arena: {format_bytes(self.used)} of "
                              f"{format_bytes(self.capacity or 0)} held by models)") from None
