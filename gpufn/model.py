"""`@gpufn.model`: a model loaded once per device and shared by every function naming it.

The loader runs on the worker, inside the device's memory pool; `Model.get()` inside a
function returns the instance resident on that worker's device. Outside a worker (plain
calls and `.local()`), `get()` loads the model once in this process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from gpufn import serialization as ser
from gpufn.exceptions import InvalidSpec
from gpufn.spec import parse_memory

T = TypeVar("T")

_local_cache: dict[str, Any] = {}
_local_lock = threading.Lock()

# Set by the worker process: name -> instance resolver for the current device.
_resolver: Callable[[str], Any] | None = None


def set_resolver(resolver: Callable[[str], Any] | None) -> None:
    """The worker process installs how `Model.get()` finds the resident instance."""
    global _resolver
    _resolver = resolver


class Model(Generic[T]):
    """A named model: its loader, memory estimate and eviction preferences."""

    def __init__(self, loader: Callable[[], T], *, name: str | None = None,
                 memory: int | str | None = None, pin: bool = False, offload: bool = True) -> None:
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
        self.pin = pin
        self.offload = offload
        self._wire: dict[str, Any] | None = None
        self._frames: list[Any] = []

    def __repr__(self) -> str:
        return f"<gpufn.Model {self.name}>"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_wire"] = None
        state["_frames"] = []
        return state

    def get(self) -> T:
        """The instance resident on this worker's device (loaded for this call if needed)."""
        if _resolver is not None:
            return _resolver(self.name)
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
                          "offload": self.offload, "code_id": code_id, "nframes": len(frames)}
        return self._wire

    def loader_frames(self) -> list[Any]:
        self.wire_description()
        return self._frames


def model(_loader: Callable[[], Any] | None = None, *, name: str | None = None,
          memory: int | str | None = None, pin: bool = False, offload: bool = True) -> Any:
    """Declare a shared model: `@gpufn.model(memory="6GiB")` on a zero-argument loader."""
    if _loader is not None:
        if not callable(_loader):
            raise InvalidSpec("@gpufn.model options are keyword-only, e.g. @gpufn.model(memory='6GiB')")
        return Model(_loader, name=name, memory=memory, pin=pin, offload=offload)

    def wrap(loader: Callable[[], Any]) -> Model[Any]:
        return Model(loader, name=name, memory=memory, pin=pin, offload=offload)

    return wrap
