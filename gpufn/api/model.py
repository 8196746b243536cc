"""`@gpufn.model`: a model loaded once per device and shared by every function naming it.

The loader runs on the worker, inside the device's memory pool; `Model.get()` inside a
function returns the instance resident on that worker's device. Outside a worker (plain
calls and `.local()`), `get()` loads the model once in this process.

A sharded model (`count=N`) spans a gang of N devices: its loader runs on every rank
inside the gang's process group and returns that rank's shard; `memory` is per device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from gpufn.exceptions import InvalidSpec
from gpufn.runtime import models
from gpufn.wire import serialization as ser
from gpufn.wire.units import parse_memory

T = TypeVar("T")

_local_cache: dict[str, Any] = {}
_local_lock = threading.Lock()

class Model(Generic[T]):
    """A named model: its loader, memory estimate and eviction preferences."""

    def __init__(self, loader: Callable[[], T], *, name: str | None = None,
                 memory: int | str | None = None, pin: bool = False, offload: bool = True,
                 count: int = 1) -> None:
        if not callable(loader):
            raise InvalidSpec(f"@gpufn.model decorates a loader function, not {loader!r}")
        self.loader = loader
        chosen = name if name is not None else getattr(loader, "__name__", None)
        if not isinstance(chosen, str) or not chosen.strip():
            raise InvalidSpec(f"@gpufn.model(name={name!r}): the name must be a non-empty string")
        self.name: str = chosen
        self.memory = 0 if memory is None else parse_memory(memory, "memory")
        if not isinstance(pin, bool):
            raise InvalidSpec(f"@gpufn.model(pin={pin!r}) must be True or False")
        if not isinstance(offload, bool):
            raise InvalidSpec(f"@gpufn.model(offload={offload!r}) must be True or False")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidSpec(f"@gpufn.model(count={count!r}) must be a positive integer: the "
                              "number of devices (gang ranks) the model is sharded over")
        self.pin = pin
        self.offload = offload
        self.count = count
        self._wire: dict[str, Any] | None = None
        self._frames: list[Any] = []

    def __repr__(self) -> str:
        return f"<gpufn.Model {self.name}>"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_wire"] = None
        state["_frames"] = []
        return state

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def get(self) -> T:
        """The instance resident on this worker's device (loaded for this call if needed);
        for a sharded model, this rank's shard."""
        resolver = models.resolver()
        if resolver is not None:
            return resolver(self.name)
        with _local_lock:
            if self.name not in _local_cache:
                _local_cache[self.name] = self.loader()
            return _local_cache[self.name]

    def wire_description(self) -> dict[str, Any]:
        """What the scheduler needs: name, estimate, flags and the loader's code id."""
        if self._wire is None:
            code_id, frames = ser.dump_code(self.loader, f"model {self.name}")
            self._frames = frames
            self._wire = {"name": self.name, "memory": self.memory, "pin": self.pin,
                          "offload": self.offload, "code_id": code_id, "nframes": len(frames),
                          "count": self.count}
        return self._wire

    def loader_frames(self) -> list[Any]:
        self.wire_description()
        return self._frames


def model(_loader: Callable[[], Any] | None = None, *, name: str | None = None,
          memory: int | str | None = None, pin: bool = False, offload: bool = True,
          count: int = 1) -> Any:
    """Declare a shared model: `@gpufn.model(memory="6GiB")` on a zero-argument loader.

    `count=N` shards it over a gang of N devices (`memory` is then per device): the loader
    runs on every rank inside the gang's process group (`gpufn.context()` gives rank,
    world size, device, group and mesh) and returns that rank's shard."""
    if _loader is not None:
        if not callable(_loader):
            raise InvalidSpec("@gpufn.model options are keyword-only, e.g. @gpufn.model(memory='6GiB')")
        return Model(_loader, name=name, memory=memory, pin=pin, offload=offload, count=count)

    def wrap(loader: Callable[[], Any]) -> Model[Any]:
        return Model(loader, name=name, memory=memory, pin=pin, offload=offload, count=count)

    return wrap


def check_gang(models: tuple[Model[Any], ...], count: int, spmd: bool, function: str = "") -> None:
    """A sharded model is used only by functions running on a gang of its own size."""
    for m in models:
        if m.count == 1:
            continue
        if m.count != count:
            raise InvalidSpec(
                f"{function or 'the function'} names model {m.name!r}, which is sharded over "
                f"count={m.count} devices, but runs with count={count}; a sharded model is used "
                f"by functions with the same count: @gpu(count={m.count}, models=[{m.name}])")
        if not spmd:
            raise InvalidSpec(
                f"sharded model {m.name!r} needs one process per device: use spmd=True "
                f"(the default) with @gpu(count={m.count})")
