"""How `Model.get()` finds the instance resident on this worker's device: the worker
process installs a resolver; outside a worker there is none and the model loads locally."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_resolver: Callable[[str], Any] | None = None


def set_resolver(resolver: Callable[[str], Any] | None) -> None:
    """The worker process installs how `Model.get()` finds the resident instance."""
    global _resolver
    _resolver = resolver


def resolver() -> Callable[[str], Any] | None:
    """The installed resolver (name -> instance), None outside a worker."""
    return _resolver
