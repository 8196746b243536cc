"""Mixture-of-experts blocks under tensor parallelism: every rank holds a 1/world slice of every expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gpufn.exceptions import InvalidSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# transformers' fused expert weights (moe_tp_experts with packed_colwise gate_up_proj and rowwise
# down_proj in its plans): gate_up_proj (experts, 2 * inter, hidden) holds [gate | up] along dim 1,
# down_proj (experts, hidden, inter).
_EXPERT_PARAMS = {"gate_up_proj", "down_proj"}


def check_experts(name: str, experts: nn.Module, world: int) -> None:
    """InvalidSpec unless `experts` has the fused layout `shard_experts` splits, divisible by `world`."""
    params = {n: p for n, p in experts.named_parameters(recurse=False)}
    advice = "keep the experts replicated with a dict plan, or run the model on one device (count=1)"
    if set(params) != _EXPERT_PARAMS or any(True for _ in experts.children() if not _is_activation(_)):
        raise InvalidSpec(
            f"tensor_parallel: {name!r} ({type(experts).__name__}) holds {sorted(params)}, not the fused "
            f"gate_up_proj/down_proj expert weights it knows how to split; {advice}"
        )
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        raise InvalidSpec(f"tensor_parallel: {name!r}: expert weights are not 3-D (experts, out, in); {advice}")
    experts_n, packed, hidden = gate_up.shape
    inter = down.shape[2]
    if down.shape[:2] != (experts_n, hidden) or packed != 2 * inter:
        raise InvalidSpec(
            f"tensor_parallel: {name!r}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
            f"are not (experts, 2*inter, hidden) and (experts, hidden, inter); {advice}"
        )
    if inter % world:
        raise InvalidSpec(
            f"tensor_parallel: {name!r}: the experts' intermediate size {inter} does not divide by the world "
            f"size {world}: use a device count that divides {inter}"
        )


def _is_activation(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is None


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's slice of every expert (of its own weights) and sum the ranks' partial outputs.

    Each expert computes down(act(gate(x)) * up(x)); rank r keeps rows r of gate and up and the
    matching columns of down, so its output is a partial sum over the intermediate features.
    """
    import torch.distributed as dist

    group = mesh.get_group()
    world = mesh.size()
    gate_up, down = experts.gate_up_proj, experts.down_proj
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    inter = int(down.shape[2])
    chunk = inter // world
    # [gate | up] -> [gate_0 up_0 | gate_1 up_1 | ...], so that a contiguous split gives rank r both halves
    order = torch.cat([
        torch.arange(part * inter + r * chunk, part * inter + (r + 1) * chunk) for r in range(world) for part in (0, 1)
    ]).to(gate_up.device)
    rank = mesh.get_local_rank()
    with torch.no_grad():  # this rank's own weights (like the replicated layers' weights)
        local_gate_up = gate_up.detach()[:, order].chunk(world, dim=1)[rank]
        local_down = down.detach().chunk(world, dim=2)[rank]
    experts.gate_up_proj = nn.Parameter(local_gate_up.contiguous(), requires_grad=gate_up.requires_grad)
    experts.down_proj = nn.Parameter(local_down.contiguous(), requires_grad=down.requires_grad)
    if hasattr(experts, "intermediate_dim"):
        setattr(experts, "intermediate_dim", chunk)  # noqa: B010 (nn.Module typing)

    def sum_partials(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        summed = output.clone()
        dist.all_reduce(summed, group=group)
        return summed

    experts.register_forward_hook(sum_partials)
