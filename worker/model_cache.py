"""The worker's model cache: loads, offloads, restores and evictions on one ordered
model thread, inside the device's memory pool (`ModelArena`), reported to the scheduler.

Calls that need a model wait until it is resident (or fail with the loader's error);
`Model.get()` inside a call returns the instance resident on this device.

A sharded model's loader needs the gang's process group: its load order is kept until
the call that needs it has joined the group, then runs on the model thread with that
call's `gpufn.context()` (rank, world size, device, group, mesh).
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpufn.exceptions import GpufnError, ModelLoadError, OutOfMemory, kind_of
from gpufn.runtime import context as ctxmod
from gpufn.runtime import models as runtime_models
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.wire.protocol import ModelState
from gpufn.worker.groups import is_comm_error

log = logging.getLogger("gpufn.worker")

class ModelManager:
    def __init__(self, device: Any, capacity: int | None, emit: Callable[[p.Message], None],
                 host_bytes: Callable[[int], None] | None = None) -> None:
        from gpufn.memory_pool.allocator import ModelArena

        self.arena = ModelArena(device, capacity)
        self.emit = emit
        # Told the bytes of models in host memory after each model order (the supervisor's
        # memory watch adds them to the worker's limit): offloaded ones, and on a CPU
        # device the resident ones too.
        self.host_bytes = host_bytes
        self._on_cpu = getattr(device, "type", str(device)) == "cpu"
        self.ops = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufn-models")
        self._lock = threading.Lock()
        self._ready: dict[str, threading.Event] = {}
        self._errors: dict[str, GpufnError] = {}
        self._comm: set[str] = set()  # keys whose loader failed because a peer rank went away
        # sharded loads waiting for their call to join the gang: key -> (spec, frames)
        self._pending: dict[str, tuple[dict[str, Any], tuple[Any, ...]]] = {}
        self._sharded: set[str] = set()  # keys loaded as one rank's shard of a gang

    # ------------------------------------------------------------------ orders

    def load(self, key: str, spec: dict[str, Any], frames: tuple[Any, ...]) -> None:
        """Make a model resident, in order on the model thread; calls needing it wait."""
        with self._lock:
            self._ready[key] = threading.Event()
            self._errors.pop(key, None)
            self._comm.discard(key)
            fresh = key not in self.arena.resident() and key not in self.arena.offloaded()
            if spec.get("sharded"):
                self._sharded.add(key)
            if spec.get("sharded") and not spec.get("restore") and fresh:
                self._pending[key] = (spec, frames)  # run by `prepare`, inside the group
                return
        self.ops.submit(self._load, key, spec, frames)

    def evict(self, key: str, offload: bool) -> None:
        self.ops.submit(self._evict, key, offload)

    def _event(self, key: str) -> threading.Event:
        with self._lock:
            return self._ready.setdefault(key, threading.Event())

    def _load(self, key: str, spec: dict[str, Any], frames: tuple[Any, ...],
              context: ctxmod.CallContext | None = None) -> None:
        restore = bool(spec.get("restore"))
        name = spec.get("name", key)
        # A loader may build its model in host memory first: its estimate counts meanwhile.
        self._report_host_bytes(int(spec.get("memory") or 0))
        ctxmod._set(context)  # a shard's loader asks gpufn.context() for its rank and group
        try:
            if key in self.arena.resident():  # already here (the ledger was reset): adopt it
                nbytes, seconds = self.arena.resident()[key], 0.0
            elif restore or key in self.arena.offloaded():
                report = self.arena.restore(key)
                nbytes, seconds = report.nbytes, report.seconds
                restore = True
            else:
                loader = ser.load_code(frames)
                rep = self.arena.load(key, loader)
                nbytes, seconds = rep.nbytes, rep.seconds
        except BaseException as e:
            ctxmod._set(None)
            if isinstance(e, OutOfMemory):
                err: GpufnError = e
            else:
                if context is not None and is_comm_error(e):
                    with self._lock:
                        self._comm.add(key)
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                what = "bringing model {!r} back from host memory" if restore else "the loader of model {!r}"
                err = ModelLoadError(f"{what.format(name)} raised {type(e).__name__}: {e}\n{tb}")
            if restore:  # leave nothing behind: the host copy is dropped too
                try:
                    self.arena.evict(key)
                except KeyError:
                    pass
            with self._lock:
                self._errors[key] = err
            needed = int(getattr(err, "needed", 0) or 0)  # an under-estimated model's real size
            self._report_host_bytes()
            self.emit(p.ModelEvent(key, ModelState.LOAD_FAILED, needed, 0.0, kind_of(err), str(err)))
            self._event(key).set()
            return
        ctxmod._set(None)
        self._report_host_bytes()
        self.emit(p.ModelEvent(key, ModelState.RESIDENT, nbytes, seconds, "", "restored" if restore else ""))
        self._event(key).set()

    def _report_host_bytes(self, loading: int = 0) -> None:
        if self.host_bytes is not None:
            held = sum(self.arena.offloaded().values()) + loading
            if self._on_cpu:
                held += sum(self.arena.resident().values())
            self.host_bytes(held)

    def _evict(self, key: str, offload: bool) -> None:
        with self._lock:
            self._ready.pop(key, None)
            self._pending.pop(key, None)
        try:
            self._evict_or_offload(key, offload)
        finally:
            self._report_host_bytes()

    def _evict_or_offload(self, key: str, offload: bool) -> None:
        try:
            if offload:
                report = self.arena.offload(key)
                self.emit(p.ModelEvent(key, ModelState.OFFLOADED, report.nbytes, report.seconds))
            else:
                freed = self.arena.evict(key)
                self.emit(p.ModelEvent(key, ModelState.EVICTED, freed, 0.0))
        except KeyError:
            self.emit(p.ModelEvent(key, ModelState.EVICTED, 0, 0.0))
        except Exception as e:
            log.exception("could not %s model %s", "offload" if offload else "evict", key)
            try:
                self.arena.evict(key)
            except KeyError:
                pass
            self.emit(p.ModelEvent(key, ModelState.OFFLOAD_FAILED if offload else ModelState.EVICTED, 0, 0.0,
                                   type(e).__name__, str(e)))

    # ------------------------------------------------------------------ calls

    def prepare(self, models: dict[str, str], join: Callable[[], None] | None = None,
                context: ctxmod.CallContext | None = None) -> None:
        """In the call's thread: wait until its models are resident; map names for get().

        `join` (a gang rank joining its group) runs once the whole models are in and
        before any sharded load this call starts (that loader needs the group).
        The wait is in short slices so a cancel (an async exception) lands at once, and
        it is not bounded by the call's timeout: the scheduler starts that clock only
        once the models are resident."""
        with self._lock:
            shards = {k: self._pending.pop(k) for k in models.values() if k in self._pending}
        for key in models.values():
            if key not in shards:
                self._wait(key)
        if join is not None:
            join()
        for key, (spec, frames) in shards.items():
            self.ops.submit(self._load, key, spec, frames, context)
        for key in shards:
            self._wait(key)
        runtime_models.set_call_models(models)

    def _wait(self, key: str) -> None:
        ev = self._event(key)
        while not ev.wait(0.05):
            pass
        with self._lock:
            err = self._errors.get(key)
            comm = key in self._comm
        if err is not None:
            if comm:  # a consequence of a peer failing: the peer's error is the call's
                from gpufn.worker.groups import GangAborted

                raise GangAborted(str(err))
            raise type(err)(str(err))

    def keep_for_restart(self) -> list[list[Any]]:
        """The scheduler restarted: the whole models resident here stay, reported as
        [[key, bytes], ...] so its new ledger starts true. Host copies and shards (whose
        gang's group went with the old scheduler) are dropped."""
        with self._lock:
            self._pending.clear()
            sharded, self._sharded = self._sharded, set()
        resident = self.arena.resident()
        for key in [*self.arena.offloaded(), *(k for k in resident if k in sharded)]:
            self.ops.submit(self._evict, key, False)
        return [[key, nbytes] for key, nbytes in resident.items() if key not in sharded]

    def resolve(self, name: str) -> Any:
        """`Model.get()` inside a call."""
        mapping = runtime_models.call_models()
        key = mapping.get(name)
        if key is None:
            raise GpufnError(
                f"model {name!r} is not listed in this function's @gpu(models=[...]); add it "
                "there so the scheduler places the call where the model is resident")
        return self.arena.get(key)
