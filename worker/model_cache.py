"""The worker's model cache: loads, offloads, restores and evictions on one ordered
model thread, inside the device's memory pool (`ModelArena`), reported to the scheduler.

Calls that need a model wait until it is resident (or fail with the loader's error);
`Model.get()` inside a call returns the instance resident on this device.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

from gpufn import protocol as p
from gpufn import serialization as ser
from gpufn.exceptions import GpufnError, ModelLoadError, OutOfMemory, kind_of
from gpufn.protocol import ModelState

log = logging.getLogger("gpufn.worker")

_call_models = threading.local()  # name -> model key, for the call running in this thread
# The same for an async call, set inside its task on the worker's event loop.
_async_models: ContextVar[dict[str, str] | None] = ContextVar("gpufn_call_models", default=None)


def set_async_models(mapping: dict[str, str]) -> None:
    _async_models.set(dict(mapping))


class ModelManager:
    def __init__(self, device: Any, capacity: int | None, emit: Callable[[p.Message], None]) -> None:
        from gpufn.memory_pool.allocator import ModelArena

        self.arena = ModelArena(device, capacity)
        self.emit = emit
        self.ops = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufn-models")
        self._lock = threading.Lock()
        self._ready: dict[str, threading.Event] = {}
        self._errors: dict[str, GpufnError] = {}

    # ------------------------------------------------------------------ orders

    def load(self, key: str, spec: dict[str, Any], frames: tuple[Any, ...]) -> None:
        """Make a model resident, in order on the model thread; calls needing it wait."""
        with self._lock:
            self._ready[key] = threading.Event()
            self._errors.pop(key, None)
        self.ops.submit(self._load, key, spec, frames)

    def evict(self, key: str, offload: bool) -> None:
        self.ops.submit(self._evict, key, offload)

    def _event(self, key: str) -> threading.Event:
        with self._lock:
            return self._ready.setdefault(key, threading.Event())

    def _load(self, key: str, spec: dict[str, Any], frames: tuple[Any, ...]) -> None:
        restore = bool(spec.get("restore"))
        name = spec.get("name", key)
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
            if isinstance(e, OutOfMemory):
                err: GpufnError = e
            else:
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
            self.emit(p.ModelEvent(key, ModelState.LOAD_FAILED, needed, 0.0, kind_of(err), str(err)))
            self._event(key).set()
            return
        self.emit(p.ModelEvent(key, ModelState.RESIDENT, nbytes, seconds, "", "restored" if restore else ""))
        self._event(key).set()

    def _evict(self, key: str, offload: bool) -> None:
        with self._lock:
            self._ready.pop(key, None)
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

    def prepare(self, models: dict[str, str]) -> None:
        """In the call's thread: wait until its models are resident; map names for get().

        The wait is in short slices so a cancel (an async exception) lands at once, and
        it is not bounded by the call's timeout: the scheduler starts that clock only
        once the models are resident."""
        for key in models.values():
            ev = self._event(key)
            while not ev.wait(0.05):
                pass
            with self._lock:
                err = self._errors.get(key)
            if err is not None:
                raise type(err)(str(err))
        _call_models.mapping = dict(models)

    def forget_all(self) -> None:
        """The scheduler lost track of this worker (it restarted): drop every model, so
        the ledger it starts afresh is true."""
        for key in [*self.arena.resident(), *self.arena.offloaded()]:
            self.ops.submit(self._evict, key, False)

    def resolve(self, name: str) -> Any:
        """`Model.get()` inside a call."""
        mapping = _async_models.get() or getattr(_call_models, "mapping", None) or {}
        key = mapping.get(name)
        if key is None:
            raise GpufnError(
                f"model {name!r} is not listed in this function's @gpu(models=[...]); add it "
                "there so the scheduler places the call where the model is resident")
        return self.arena.get(key)
