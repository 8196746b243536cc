"""What `@gpu(autocast=..., device_args=True)` does around the user's function on the worker:
tensor arguments moved to the call's device, the call run under `torch.autocast`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def to_device(obj: Any, device: Any, depth: int = 4) -> Any:
    """`obj` with every torch tensor in it (in tuples, lists and dicts, `depth` deep) on `device`."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if depth == 0:
        return obj
    if type(obj) in (tuple, list):
        return type(obj)(to_device(x, device, depth - 1) for x in obj)
    if type(obj) is dict:
        return {k: to_device(v, device, depth - 1) for k, v in obj.items()}
    return obj


class WithCallOptions:
    """The user's function with its call options; pickled in its place, so the worker runs
    the options with no change on its side. `__gpufn_target__` is the function itself (for
    source file names in remote tracebacks)."""

    def __init__(self, fn: Callable[..., Any], autocast: str, device_args: bool) -> None:
        self.__gpufn_target__ = fn
        self.autocast = autocast
        self.device_args = device_args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        from gpufn.runtime.context import current_device

        device = torch.device(current_device())
        if self.device_args:
            args, kwargs = to_device((args, kwargs), device)
        fn = self.__gpufn_target__
        if not self.autocast:
            return fn(*args, **kwargs)
        with torch.autocast(device.type, dtype=getattr(torch, _DTYPES[self.autocast])):
            return fn(*args, **kwargs)


def wrap(fn: Callable[..., Any], autocast: str, device_args: bool) -> Callable[..., Any]:
    """`fn` itself when no option is set, else `fn` with its options."""
    if not autocast and not device_args:
        return fn
    return WithCallOptions(fn, autocast, device_args)
