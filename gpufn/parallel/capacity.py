"""Capacity planning for a decoder-only transformer from its Hugging Face `config.json`:
which tensor-parallel x pipeline-parallel layouts fit on N devices of a given memory.

Per device, a layout needs its share of the weights, of the KV cache (batch x context
tokens) and an activation headroom for one prefill chunk; a reserve of the device's memory
is kept for the runtime (CUDA context, NCCL buffers, fragmentation). The estimate follows
the standard Llama-style parameter count (attention with grouped KV heads, gated MLP,
optionally untied LM head); it is a plan, not a measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 2**30
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


class PlanError(ValueError):
    """A config that cannot be planned (a field missing, a bad value)."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from a config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int
    name: str = "model"

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelShape:
        def get(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if k in cfg and cfg[k] is not None:
                    return cfg[k]
            if default is None:
                raise PlanError(f"config has none of {keys}: is it a decoder-only transformer's "
                                "config.json?")
            return default

        hidden = int(get("hidden_size", "n_embd", "d_model"))
        heads = int(get("num_attention_heads", "n_head"))
        return cls(
            hidden=hidden, layers=int(get("num_hidden_layers", "n_layer")), heads=heads,
            kv_heads=int(get("num_key_value_heads", default=heads)),
            head_dim=int(get("head_dim", default=hidden // heads)),
            intermediate=int(get("intermediate_size", "n_inner", default=4 * hidden)),
            vocab=int(get("vocab_size")), tied=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(get("max_position_embeddings", "n_positions", default=8192)),
            name=name)

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return attn + mlp + 2 * self.hidden

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.embed_params
        return self.embed_params + head + self.layers * self.layer_params + self.hidden


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    weights: float  # bytes per device (the fullest stage)
    kv_cache: float
    activations: float
    usable: float  # device memory less the reserve
    allreduce_bytes_per_token: float  # sent and received per device, per generated token
    p2p_bytes_per_token: float  # between pipeline stages, per token

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def need(self) -> float:
        return self.weights + self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.need <= self.usable

    @property
    def headroom(self) -> float:
        return self.usable - self.need


@dataclass(frozen=True)
class CapacityPlan:
    shape: ModelShape
    devices: int
    device_memory: float
    dtype: str
    kv_dtype: str
    context: int
    batch: int
    reserve: float
    layouts: list[Layout]  # every layout considered, fitting or not

    @property
    def fitting(self) -> list[Layout]:
        return [lay for lay in self.layouts if lay.fits]

    @property
    def recommended(self) -> Layout | None:
        """The fitting layout on the fewest devices that divide the devices given (whole
        replicas on the rest), then the least pipeline depth (TP has lower latency), then
        the most headroom."""
        fits = [lay for lay in self.fitting if self.devices % lay.devices == 0] or self.fitting
        if not fits:
            return None
        return min(fits, key=lambda lay: (lay.devices, lay.pp, -lay.headroom))

    @property
    def closest(self) -> Layout:
        """When nothing fits: the layout on all devices that misses by the least."""
        full = [lay for lay in self.layouts if lay.devices == max(x.devices for x in self.layouts)]
        return min(full, key=lambda lay: lay.need - lay.usable)

    @property
    def missing_bytes(self) -> float:
        """Memory missing on the closest layout, over all its devices (0 when one fits)."""
        if self.fitting:
            return 0.0
        c = self.closest
        return (c.need - c.usable) * c.devices


def _divisors_pow2(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def layout(shape: ModelShape, tp: int, pp: int, *, device_memory: float, dtype: str,
           kv_dtype: str, context: int, batch: int, reserve: float) -> Layout:
    """One TP x PP layout's memory per device and communication per token."""
    wb, kb = BYTES[dtype], BYTES[kv_dtype]
    act_b = 2.0 if dtype in ("fp8", "int8", "int4") else wb  # activations stay 16-bit
    layers_per_stage = math.ceil(shape.layers / pp)
    # The first stage holds the embedding, the last the LM head; take the fuller one.
    # (a tied embedding is needed on both; TP shards embeddings by vocabulary too).
    edge = shape.embed_params * (1 if shape.tied else 2) if pp == 1 else shape.embed_params
    stage_params = layers_per_stage * shape.layer_params + edge
    weights = stage_params * wb / tp
    kv_heads_here = max(1, shape.kv_heads // tp) if shape.kv_heads >= tp else 1  # replicated when tp > kv heads
    kv = 2 * batch * context * layers_per_stage * kv_heads_here * shape.head_dim * kb
    # One prefill chunk of `context` tokens through a layer: hidden states, q/k/v, the MLP's
    # gated intermediate, and the last-token logits of the batch in fp32.
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim / tp
    act = context * (4 * shape.hidden + qkv + 3 * shape.intermediate / tp) * act_b
    act += batch * shape.vocab / tp * 4
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    allreduce = 2 * shape.layers * shape.hidden * act_b * ring  # two all-reduces per layer
    p2p = (pp - 1) * shape.hidden * act_b
    return Layout(tp, pp, weights, kv, act, device_memory * (1 - reserve), allreduce, p2p)


def plan(cfg: dict[str, Any], *, devices: int, device_memory: float, dtype: str = "bf16",
         kv_dtype: str | None = None, context: int | None = None, batch: int = 1,
         reserve: float = 0.1, name: str = "model") -> CapacityPlan:
    """Every TP x PP layout (TP a power of two dividing the attention heads, PP up to the
    layer count, TP x PP <= devices) with its memory per device."""
    if dtype not in BYTES:
        raise PlanError(f"dtype {dtype!r} is not one of {', '.join(BYTES)}")
    kv_dtype = kv_dtype or ("bf16" if dtype in ("fp8", "int8", "int4") else dtype)
    if kv_dtype not in BYTES:
        raise PlanError(f"kv dtype {kv_dtype!r} is not one of {', '.join(BYTES)}")
    if devices < 1 or device_memory <= 0 or batch < 1 or not 0 <= reserve < 1:
        raise PlanError("devices, device memory and batch must be positive, reserve in [0, 1)")
    shape = ModelShape.from_config(cfg, name)
    context = context or min(shape.max_positions, 8192)
    layouts = []
    for tp in _divisors_pow2(devices):
        if shape.heads % tp:
            continue
        for pp in range(1, min(devices // tp, shape.layers) + 1):
            layouts.append(layout(shape, tp, pp, device_memory=device_memory, dtype=dtype,
                                  kv_dtype=kv_dtype, context=context, batch=batch,
                                  reserve=reserve))
    return CapacityPlan(shape, devices, device_memory, dtype, kv_dtype, context, batch, reserve, layouts)


def read_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """(the config, the model's name) from a config.json (a multimodal one's text part)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {p}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{p} is not a JSON object")
    if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    return cfg, p.parent.name if p.name == "config.json" and p.parent.name else p.stem

def devices_needed(cfg: dict[str, Any], *, device_memory: float, limit: int = 1024,
                   **kw: Any) -> tuple[int, Layout] | None:
    """The fewest devices (a power of two up to `limit`) of this memory on which a layout fits."""
    n = 1
    while n <= limit:
        found = plan(cfg, devices=n, device_memory=device_memory, **kw).recommended
        if found is not None:
            return n, found
        n *= 2
    return None
