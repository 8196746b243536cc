"""Where `gpufn.parallel` finds its device mesh: the caller's, the gang's, or the default group's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gpufn.exceptions import GpufnError, InvalidSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer (CPU for a module with neither)."""
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


def resolve_mesh(module: nn.Module, mesh: DeviceMesh | None, *, what: str) -> DeviceMesh:
    """The 1-D mesh `what` (e.g. "tensor_parallel") shards `module` over.

    `mesh` if given; else the mesh of the gpufn call running in this thread; else a 1-D mesh over
    torch.distributed's default process group.
    """
    device_type = module_device(module).type
    if mesh is None:
        mesh = _context_mesh()
    if mesh is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise GpufnError(
                f"{what}() needs a process group with one rank per device: run it inside a "
                "multi-device function (@gpu(count=N), N > 1), or call "
                "torch.distributed.init_process_group() first"
            )
        from torch.distributed.device_mesh import DeviceMesh

        # Wrap the default group as it is: init_device_mesh would make a new group per call
        # (a collective) on CUDA hosts whose default group is gloo.
        world = dist.group.WORLD
        assert world is not None  # initialised above
        mesh = DeviceMesh.from_group(world, device_type)
    if mesh.ndim != 1:
        raise InvalidSpec(
            f"{what}() takes a 1-D device mesh, got {mesh.ndim} dimensions "
            f"{mesh.mesh_dim_names or ''}: pass one dimension, e.g. mesh['tp']"
        )
    if mesh.device_type != device_type:
        raise InvalidSpec(
            f"{what}(): the model is on {device_type} but the mesh is on {mesh.device_type}: "
            f"move the model to the call's device first (model.to(gpufn.current_device()))"
        )
    return mesh


def _context_mesh() -> DeviceMesh | None:
    """The mesh of the gpufn call running in this thread, or None outside a call."""
    from gpufn.runtime.context import context

    try:
        ctx = context()
    except GpufnError:
        return None
    mesh: DeviceMesh = ctx.mesh  # raises GpufnError with advice for a one-device call
    return mesh
