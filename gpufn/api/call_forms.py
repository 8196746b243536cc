"""The call forms beyond `.remote()`/`.map()`/`.spawn()`: `f.remote_gen` (and `.aio`), and
the decoration-time checks for generator and async functions."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, overload

from gpufn.api.calls import CallStream
from gpufn.exceptions import InvalidSpec
from gpufn.wire.spec import GpuSpec


class Streams(Protocol):
    """What `f.remote_gen` needs of its function (a `Function`)."""

    def _remote_gen(self, *args: Any, **kwargs: Any) -> CallStream[Any]: ...


class RemoteGen:
    """`for v in f.remote_gen(*args, **kwargs)`: run a generator function on a worker and
    iterate its values as they are produced; `async for v in f.remote_gen.aio(...)`."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Streams) -> None:
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> CallStream[Any]:
        return self._fn._remote_gen(*args, **kwargs)

    def aio(self, *args: Any, **kwargs: Any) -> CallStream[Any]:
        return self._fn._remote_gen(*args, **kwargs)  # a CallStream is async-iterable too


class RemoteGenAttr:
    @overload
    def __get__(self, obj: None, cls: Any = None) -> RemoteGenAttr: ...
    @overload
    def __get__(self, obj: Streams, cls: Any = None) -> RemoteGen: ...
    def __get__(self, obj: Streams | None, cls: Any = None) -> Any:
        return self if obj is None else RemoteGen(obj)


def check_kind(fn: Callable[..., Any], spec: GpuSpec) -> None:
    """Refuse the combinations a generator or async function cannot run in."""
    gen = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
    name = getattr(fn, "__qualname__", "function")
    if not spec.spmd and (gen or inspect.iscoroutinefunction(fn)):
        raise InvalidSpec(f"{name}: generator and async functions need spmd=True "
                          "(with spmd=False the call runs in a helper process that cannot stream)")
    if gen and spec.batch_size is not None:
        raise InvalidSpec(f"{name}: a generator function cannot be batched (batch_size=)")
    if gen and spec.gather:
        raise InvalidSpec(f"{name}: a generator function streams rank 0's values; gather=True "
                          "is for functions that return")
