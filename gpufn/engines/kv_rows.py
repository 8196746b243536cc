"""Per-sequence KV buffers behind transformers' `Cache` interface, and the attention that
reads them one sequence at a time (the library's own SDPA attention, called per segment
of a packed forward)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "gpufn_rows"
PLAN_KWARG = "gpufn_rows"


@dataclass
class SeqKV:
    """One sequence's keys and values: per layer a [1, kv_heads, capacity, head_dim] buffer
    each, allocated on the sequence's first forward; `length` positions are filled."""

    capacity: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True)
class Segment:
    """Positions `offset .. offset+n` of a packed forward extend `kv` by n tokens."""

    kv: SeqKV
    offset: int
    n: int


@dataclass
class RowPlan:
    """What one packed forward ([1, total] tokens) computes: its segments, one per
    sequence, and padding after them up to `total`."""

    segments: list[Segment]
    total: int


class RowCache(Cache):
    """A `Cache` whose `update` writes each row's new keys and values into that row's own
    `SeqKV` and hands them back unchanged; the attention reads the row buffers."""

    def __init__(self) -> None:
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers < 4.56: Cache() takes no layers
            super().__init__()
        self.plan: RowPlan | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        assert plan is not None, "RowCache.update outside a planned forward"
        for seg in plan.segments:
            seq, a, n = seg.kv, seg.offset, seg.n
            if len(seq.keys) == layer_idx:
                shape = (1, key_states.shape[1], seq.capacity, key_states.shape[3])
                seq.keys.append(key_states.new_zeros(shape))
                seq.values.append(value_states.new_zeros(
                    (1, value_states.shape[1], seq.capacity, value_states.shape[3])))
            seq.keys[layer_idx][0, :, seq.length:seq.length + n] = key_states[0, :, a:a + n]
            seq.values[layer_idx][0, :, seq.length:seq.length + n] = value_states[0, :, a:a + n]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of each segment over its own sequence's keys and values, at that
    sequence's exact length (causal within a prompt), through transformers' SDPA attention,
    with the segment's queries copied out so their layout never depends on the batch.
    Without a plan (the model used outside the engine), plain SDPA attention."""
    plan: RowPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    outs: list[torch.Tensor] = []
    used = 0
    for seg in plan.segments:
        end = seg.kv.length + seg.n
        q = query[:, :, seg.offset:seg.offset + seg.n].contiguous()
        out, _ = sdpa_attention_forward(
            module, q, seg.kv.keys[layer][:, :, :end], seg.kv.values[layer][:, :, :end],
            None, **kwargs)
        outs.append(out)
        used += seg.n
    if used < plan.total:
        outs.append(query.new_zeros((1, plan.total - used, query.shape[1], value.shape[-1])))
    return torch.cat(outs, dim=1), None


_registered = False


def use_row_attention(model: Any) -> None:
    """Register `row_attention` with transformers (once) and switch `model` to it."""
    global _registered
    from transformers import AttentionInterface

    if not _registered:
        AttentionInterface.register(ATTENTION, row_attention)
        _registered = True
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION)
    else:
        model.config._attn_implementation = ATTENTION


def cache_kwarg(model: Any) -> str:
    """The name the model's forward takes its cache by (`cache` from transformers 5.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def row_invariant_from(model: Any, max_rows: int = 256) -> int | None:
    """The smallest row count m such that each of `model`'s linear layers computes every
    row bit-identically at every measured row count M >= m (1..64, then up to `max_rows`),
    as the rows of an M = `max_rows` product; None when even the largest M differ."""
    sizes = [*range(1, 65), *range(96, max_rows + 1, 32)]
    shapes = {(m.in_features, m.out_features): m for m in model.modules()
              if isinstance(m, torch.nn.Linear)}
    worst = 0
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (fan_in, _), layer in shapes.items():
            w = layer.weight
            x = torch.randn(max_rows, fan_in, generator=g).to(w.device, w.dtype)
            ref = torch.nn.functional.linear(x, w)
            for m in sizes:
                if m > worst and not torch.equal(torch.nn.functional.linear(x[:m], w), ref[:m]):
                    worst = m
    return worst + 1 if worst < sizes[-1] else None
