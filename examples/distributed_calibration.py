"""Distributed int8 calibration: a tensor-parallel model calibrated across a gang, with the
activation statistics all-reduced, returning the quantised state dict.

    python examples/distributed_calibration.py [--batches 16]

A `@gpu(count=2)` function shards an MLP model over its two devices with
`gpufn.parallel.tensor_parallel` (fc1 column-wise, fc2 row-wise), runs calibration data
through it, records the largest input of every linear layer on each rank (a row-wise
layer sees only its rank's slice of the features) and all-reduces the maxima, so every
rank holds the scales of the whole model. Weight scales are per output channel, reduced
the same way. Rank 0 returns int8 weights with their scales. The caller checks that the
scales equal a single-process calibration's and that the int8 model stays within a
stated error of the float model. Seeded weights built from code; the same file runs
unchanged on GPUs (NCCL instead of gloo).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import gpufn

HIDDEN, BLOCKS, ERROR_BOUND = 128, 3, 0.03  # relative L2 error of the int8 model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)]).eval()


def calibration_data(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, HIDDEN, generator=g) for _ in range(n)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def calibrate(model: nn.Module, data: list[torch.Tensor], group: object = None) -> dict[str, torch.Tensor]:
    """Int8 weight and activation scales of every linear layer; with a group, the statistics
    of each rank's shard are all-reduced (max) so every rank ends with the global ones."""
    import torch.distributed as dist

    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    amax = {n: torch.zeros((), device=next(model.parameters()).device) for n in linears}

    def record(name: str) -> object:
        def hook(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = torch.maximum(amax[name], _local(args[0]).detach().abs().max())
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    with torch.no_grad():
        for x in data:
            model(x.to(amax[next(iter(amax))].device))
    for h in hooks:
        h.remove()
    names = sorted(linears)
    act = torch.stack([amax[n] for n in names])
    w_amax = [_local(linears[n].weight).detach().abs().amax(dim=1) for n in names]
    if group is not None:
        dist.all_reduce(act, op=dist.ReduceOp.MAX, group=group)
        for n, w in zip(names, w_amax, strict=True):
            if _local(linears[n].weight).shape[1] != linears[n].in_features:  # row-wise shard
                dist.all_reduce(w, op=dist.ReduceOp.MAX, group=group)
    out: dict[str, torch.Tensor] = {}
    for i, n in enumerate(names):
        weight, bias = linears[n].weight, linears[n].bias
        full_w = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        full_b = bias.full_tensor() if hasattr(bias, "full_tensor") else bias
        w_scale = _gathered(w_amax[i], weight) / 127
        out[f"{n}.weight_int8"] = torch.round(full_w.detach() / w_scale[:, None]).clamp(-127, 127).to(torch.int8).cpu()
        out[f"{n}.weight_scale"] = w_scale.cpu()
        out[f"{n}.input_scale"] = (act[i] / 127).cpu()
        out[f"{n}.bias"] = full_b.detach().cpu()
    return out


def _gathered(w_amax: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel maxima for the whole layer (a column-wise shard holds some rows)."""
    if not hasattr(weight, "placements") or weight.placements[0].is_replicate():
        return w_amax
    from torch.distributed.tensor import DTensor, Shard

    if weight.placements[0] == Shard(0):  # column-wise: each rank has its rows' maxima
        return DTensor.from_local(w_amax, weight.device_mesh, [Shard(0)]).full_tensor()
    return w_amax  # row-wise: already all-reduced


@gpufn.gpu(count=2, timeout=300)
def calibrate_sharded(batches: int) -> dict[str, torch.Tensor]:
    from gpufn.parallel import tensor_parallel

    ctx = gpufn.context()
    model = tensor_parallel(build_model().to(ctx.device), plan={"*.fc1": "colwise", "*.fc2": "rowwise"})
    return calibrate(model, calibration_data(batches), group=ctx.group)


def quantized_forward(model: nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Run `model` with every linear layer in int8 (static per-tensor activations, per-channel
    weights), emulated with integer-valued float matmuls."""
    def int8_linear(name: str) -> object:
        def forward(inp: torch.Tensor) -> torch.Tensor:
            s_in = state[f"{name}.input_scale"]
            q = torch.round(inp / s_in).clamp(-127, 127)
            acc = q @ state[f"{name}.weight_int8"].float().T
            return acc * (s_in * state[f"{name}.weight_scale"]) + state[f"{name}.bias"]
        return forward

    saved = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            saved[n] = m.forward
            m.forward = int8_linear(n)  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            return model(x)
    finally:
        for n, m in model.named_modules():
            if n in saved:
                m.forward = saved[n]  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=16)
    args = ap.parse_args()
    state = calibrate_sharded.remote(args.batches)
    reference = calibrate(build_model(), calibration_data(args.batches))
    same_scales = all(torch.allclose(state[k].float(), reference[k].float(), rtol=1e-5, atol=1e-6)
                      for k in reference if "scale" in k)
    same_weights = all(torch.equal(state[k], reference[k]) for k in reference if k.endswith("int8"))
    model = build_model()
    x = torch.cat(calibration_data(8, seed=99))  # held-out inputs
    with torch.no_grad():
        ref = model(x)
    out = quantized_forward(model, state, x)
    err = float((out - ref).norm() / ref.norm())
    int8_bytes = sum(v.numel() for k, v in state.items() if k.endswith("int8"))
    print(f"quantised {sum(k.endswith('int8') for k in state)} linear layers on 2 ranks: "
          f"{int8_bytes / 2**20:.2f} MiB of int8 weights")
    print(f"scales equal a single-process calibration: {same_scales and same_weights}")
    print(f"relative error of the int8 model vs float: {100 * err:.2f}% "
          f"(bound {100 * ERROR_BOUND:.0f}%): {'within' if err <= ERROR_BOUND else 'OVER'}")


if __name__ == "__main__":
    main()
