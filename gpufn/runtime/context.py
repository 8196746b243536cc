"""`gpufn.context()`: where the current call runs (rank, world size, device, group, mesh)."""

from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from gpufn.exceptions import GpufnError


@dataclass
class CallContext:
    """What a running function may ask about its own execution."""

    invocation_id: str
    function: str
    rank: int = 0
    world_size: int = 1
    device: Any = "cpu"  # torch.device inside workers
    devices: list[Any] = field(default_factory=list)  # all devices this process sees (spmd=False)
    group: Any = None  # torch.distributed ProcessGroup for gangs
    attempt: int = 1
    app: str = ""  # a deployed function's app and version ("", 0 otherwise): calls it
    version: int = 0  # makes to functions of the same app stay on this version
    priority: int = 0  # the call's priority (`@gpu(priority=)` or its options)
    _mesh: Any = None

    @property
    def mesh(self) -> Any:
        """A 1-D DeviceMesh over the gang (built on first use)."""
        if self._mesh is None:
            if self.world_size == 1 and self.group is None:
                raise GpufnError("a DeviceMesh needs a multi-device call: use @gpu(count=N)")
            self._mesh = mesh_for(self)
        return self._mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_local = threading.local()
# Set inside an async call's task on the worker's event loop (a thread shared by calls).
_async_ctx: ContextVar[CallContext | None] = ContextVar("gpufn_call_context", default=None)


def context() -> CallContext:
    """The context of the gpufn call running in this thread.

    Raises outside a call (e.g. when the function runs with `.local()`, where there is no
    device assignment); use `gpufn.current_device()` for code that runs both ways.
    """
    ctx = _async_ctx.get() or getattr(_local, "ctx", None)
    if ctx is None:
        raise GpufnError(
            "gpufn.context() is only available inside a function running on a gpufn worker "
            "(called with .remote(), .map() or .spawn()); use gpufn.current_device() in code "
            "that also runs locally"
        )
    return ctx


def current_device() -> Any:
    """The torch device of the current call, or the best local device outside a call."""
    ctx = _async_ctx.get() or getattr(_local, "ctx", None)
    if ctx is not None:
        return ctx.device
    import torch

    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def current() -> CallContext | None:
    """The running call's context in this thread, or None outside a call."""
    return getattr(_local, "ctx", None)


def _set(ctx: CallContext | None) -> None:
    _local.ctx = ctx


def _set_async(ctx: CallContext) -> None:
    """The context of the async call whose task runs this (call inside that task)."""
    _async_ctx.set(ctx)


def mesh_for(ctx: Any) -> Any:
    """A 1-D DeviceMesh over the call's gang, built on the existing group (no new groups).

    `DeviceMesh.from_group` wraps the group as it is; `init_device_mesh` or the
    `DeviceMesh(...)` constructor would create a second gloo group on CUDA hosts.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = ctx.group if ctx.group is not None else dist.group.WORLD
    if group is None or not dist.is_initialized():
        raise GpufnError(
            "this call has no process group: a DeviceMesh needs a gang, use @gpu(count=N)"
        )
    device_type = torch.device(ctx.device).type
    return DeviceMesh.from_group(group, device_type)
