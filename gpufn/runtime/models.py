"""How `Model.get()` finds the instance resident on this worker's device: the worker
process installs a resolver (outside a worker there is none and the model loads locally),
and each running call names the models it may use (model name -> the cache's key).

A synchronous call sets its names for its thread; an async call inside its own task on the
worker's event loop (a context variable), so concurrent coroutines do not see each other's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

_resolver: Callable[[str], Any] | None = None
_thread = threading.local()
_task: ContextVar[dict[str, str] | None] = ContextVar("gpufn_call_models", default=None)


def set_resolver(resolver: Callable[[str], Any] | None) -> None:
    """The worker process installs how `Model.get()` finds the resident instance."""
    global _resolver
    _resolver = resolver


def resolver() -> Callable[[str], Any] | None:
    """The installed resolver (name -> instance), None outside a worker."""
    return _resolver


def set_call_models(mapping: Mapping[str, str]) -> None:
    """The models the call running in this thread names."""
    _thread.mapping = dict(mapping)


def set_async_call_models(mapping: Mapping[str, str]) -> None:
    """The models the async call running in this task names."""
    _task.set(dict(mapping))


def call_models() -> dict[str, str]:
    """The models the running call names: its task's if async, else its thread's."""
    return _task.get() or getattr(_thread, "mapping", None) or {}
