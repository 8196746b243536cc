"""Per-sequence KV buffers behind transformers' `Cache` interface, and the attention that
reads them one sequence at a time (the library's own SDPA attention, called per row)."""

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


@dataclass
class RowPlan:
    """What one forward computes: row i of the batch extends `rows[i]` (None for a padding
    row) by `q_len` positions."""

    rows: list[SeqKV | None]
    q_len: int


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
        n = plan.q_len
        for i, seq in enumerate(plan.rows):
            if seq is None:
                continue
            if len(seq.keys) == layer_idx:
                shape = (1, key_states.shape[1], seq.capacity, key_states.shape[3])
                seq.keys.append(key_states.new_zeros(shape))
                seq.values.append(value_states.new_zeros(
                    (1, value_states.shape[1], seq.capacity, value_states.shape[3])))
            seq.keys[layer_idx][0, :, seq.length:seq.length + n] = key_states[i, :, :n]
            seq.values[layer_idx][0, :, seq.length:seq.length + n] = value_states[i, :, :n]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of each row over its own sequence's keys and values, at that sequence's
    exact length, through transformers' SDPA attention; without a plan (the model used
    outside the engine), plain SDPA attention."""
    plan: RowPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    n = plan.q_len
    outs: list[torch.Tensor] = []
    pad: torch.Tensor | None = None
    for i, seq in enumerate(plan.rows):
        if seq is None:
            if pad is None:
                pad = query.new_zeros((1, n, query.shape[1], value.shape[-1]))
            outs.append(pad)
            continue
        end = seq.length + n
        out, _ = sdpa_attention_forward(
            module, query[i:i + 1], seq.keys[layer][:, :, :end], seq.values[layer][:, :, :end],
            None, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=0), None


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
