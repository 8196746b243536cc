"""The Hugging Face model types `tensor_parallel(plan="auto")` knows, and how each one's fused layers shard."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from gpufn.exceptions import InvalidSpec

# rows(attention module, fused layer, world) -> the global output rows each rank holds, in its local
# order (a row may go to several ranks), or None when rank r's contiguous 1/world of the rows is
# already its own heads in the order its attention code expects.
FusedLayout = Callable[[nn.Module, nn.Module, int], "list[torch.Tensor] | None"]
Refusal = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Family:
    """How one model type shards; `plan` entries are relative to its base model (like transformers')."""

    plan: Mapping[str, str] | None = None  # replaces transformers' base_model_tp_plan (None: use theirs)
    extra: Mapping[str, str] = field(default_factory=dict)  # added to transformers' plan
    fused: Mapping[str, FusedLayout] = field(default_factory=dict)  # child name of a fused colwise layer
    keep: Callable[[Any], tuple[str, ...]] = lambda config: ()  # attention attributes that stay global
    localise: Callable[[nn.Module, Any, int], None] | None = None  # attention attributes to fix per rank
    refuse: Refusal = lambda config: None  # why this configuration is not supported, if it is not


def _out_features(layer: nn.Module) -> int:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    # transformers' Conv1D stores (in, out); everything else (out, in)
    return int(weight.shape[1] if type(layer).__name__ == "Conv1D" else weight.shape[0])


def _int_attr(module: nn.Module, name: str) -> int:
    value = getattr(module, name, getattr(getattr(module, "config", None), name, None))
    if not isinstance(value, int):
        raise InvalidSpec(f"tensor_parallel: {type(module).__name__} has no integer {name!r} to split its fused projection by")
    return value


def _divides(module: nn.Module, count: int, what: str, world: int) -> None:
    if count % world:
        raise InvalidSpec(
            f"tensor_parallel: {type(module).__name__} has {count} {what}, which do not divide by the "
            f"world size {world}: use a device count that divides {count} (@gpu(count=...))"
        )


def heads_outer(count_attr: str, what: str = "attention heads") -> FusedLayout:
    """[h0: q k v | h1: q k v | ...] (GPT-NeoX, Bloom-style, Falcon's grouped layouts): contiguous."""

    def rows(attn: nn.Module, layer: nn.Module, world: int) -> list[torch.Tensor] | None:
        count = _int_attr(attn, count_attr)
        _divides(attn, count, what, world)
        if _out_features(layer) % count:
            raise InvalidSpec(f"tensor_parallel: {type(attn).__name__}'s fused projection does not split into {count} {what}")
        return None

    return rows


def parts_outer(parts: int, count_attr: str) -> FusedLayout:
    """[q (all heads) | k | v] with equal parts (GPT-2's c_attn): rank r takes its heads of each part."""

    def rows(attn: nn.Module, layer: nn.Module, world: int) -> list[torch.Tensor] | None:
        count = _int_attr(attn, count_attr)
        _divides(attn, count, "attention heads", world)
        out = _out_features(layer)
        if out % (parts * count):
            raise InvalidSpec(f"tensor_parallel: {type(attn).__name__}'s fused projection is not {parts} equal parts")
        width = out // parts
        chunk = width // world
        return [
            torch.cat([torch.arange(p * width + r * chunk, p * width + (r + 1) * chunk) for p in range(parts)])
            for r in range(world)
        ]

    return rows


def multi_query(count_attr: str, head_dim_attr: str = "head_dim") -> FusedLayout:
    """[q (all heads) | k (one head) | v (one head)]: rank r takes its query heads and the shared k, v."""

    def rows(attn: nn.Module, layer: nn.Module, world: int) -> list[torch.Tensor] | None:
        heads = _int_attr(attn, count_attr)
        head_dim = _int_attr(attn, head_dim_attr)
        _divides(attn, heads, "attention heads", world)
        q_width = heads * head_dim
        if _out_features(layer) != q_width + 2 * head_dim:
            raise InvalidSpec(
                f"tensor_parallel: {type(attn).__name__}'s fused projection is not multi-query "
                f"[q ({heads} heads) | k | v]"
            )
        chunk = q_width // world
        kv = torch.arange(q_width, q_width + 2 * head_dim)
        return [torch.cat([torch.arange(r * chunk, (r + 1) * chunk), kv]) for r in range(world)]

    return rows


def _codegen_qkv(attn: nn.Module, layer: nn.Module, world: int) -> list[torch.Tensor] | None:
    # [mp0: q v k | mp1: q v k | ...] over the 4 shards CodeGen was trained with: rank r takes 4/world
    # whole shards, and its attention code then splits its rows into 4/world shards (see _codegen_local).
    mp_num = _int_attr(attn, "mp_num")
    if mp_num % world:
        raise InvalidSpec(
            f"tensor_parallel: CodeGen's fused qkv_proj is laid out for {mp_num} model-parallel shards, which "
            f"do not divide by the world size {world}: use a device count that divides {mp_num}"
        )
    return None


def _codegen_local(attn: nn.Module, config: Any, world: int) -> None:
    setattr(attn, "mp_num", _int_attr(attn, "mp_num") // world)  # noqa: B010 (nn.Module typing)


def _bigcode_local(attn: nn.Module, config: Any, world: int) -> None:
    if getattr(attn, "multi_query", False):
        setattr(attn, "num_key_value_groups", _int_attr(attn, "num_key_value_groups") // world)  # noqa: B010
    else:
        for attr in ("kv_heads", "kv_dim"):
            setattr(attn, attr, _int_attr(attn, attr) // world)


def _bigcode_qkv(attn: nn.Module, layer: nn.Module, world: int) -> list[torch.Tensor] | None:
    if getattr(attn, "multi_query", False):
        return multi_query("num_heads")(attn, layer, world)
    return heads_outer("num_heads")(attn, layer, world)


def _falcon_qkv(attn: nn.Module, layer: nn.Module, world: int) -> list[torch.Tensor] | None:
    if getattr(attn, "new_decoder_architecture", False):
        return heads_outer("num_kv_heads", "key/value head groups")(attn, layer, world)
    if getattr(attn, "multi_query", False):
        return multi_query("num_heads")(attn, layer, world)
    return heads_outer("num_heads")(attn, layer, world)


def _falcon_keep(config: Any) -> tuple[str, ...]:
    multi_query = getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False)
    return ("num_kv_heads",) if multi_query else ()


def _falcon_refuse(config: Any) -> str | None:
    if getattr(config, "alibi", False):
        return "its ALiBi biases are built for all heads at once (alibi=True)"
    return None


def _alibi(config: Any) -> str:
    return "its ALiBi position biases are built for all heads at once, outside the attention layers"


def _stablelm_refuse(config: Any) -> str | None:
    if getattr(config, "qk_layernorm", False):
        return "its per-head q/k layer norms (qk_layernorm=True) hold one norm per head"
    return None


def _cross_attention(config: Any) -> str | None:
    if getattr(config, "add_cross_attention", False):
        return "its cross-attention layers (add_cross_attention=True) are not recognised"
    return None


_LLAMA_PLAN = MappingProxyType({
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
})

# Model types whose `base_model_tp_plan` (plain colwise/rowwise entries and, for mixtures of experts,
# packed_colwise/rowwise expert weights under moe_tp_experts) was checked against one process.
_THEIR_PLAN = (
    "llama", "mistral", "ministral", "qwen2", "qwen3", "phi", "phi3", "gemma", "gemma2", "gemma3_text",
    "starcoder2", "olmo", "olmo2", "cohere", "granite", "glm", "glm4", "nemotron", "helium", "gptj",
    "mixtral", "qwen3_moe", "granitemoe", "olmoe", "phimoe", "smollm3", "ernie4_5", "arcee", "seed_oss",
)

FAMILIES: Mapping[str, Family] = MappingProxyType({
    **{model_type: Family() for model_type in _THEIR_PLAN},
    "qwen2_moe": Family(extra={
        "layers.*.mlp.shared_expert.gate_proj": "colwise", "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    }),
    "gpt2": Family(
        plan={"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
        fused={"c_attn": parts_outer(3, "num_heads")},
        refuse=_cross_attention,
    ),
    "gpt_bigcode": Family(
        plan={"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
        fused={"c_attn": _bigcode_qkv},
        localise=_bigcode_local,
        refuse=_cross_attention,
    ),
    "codegen": Family(fused={"qkv_proj": _codegen_qkv}, localise=_codegen_local),
    "gpt_neox": Family(fused={"query_key_value": heads_outer("num_attention_heads")}),
    "persimmon": Family(
        plan={
            "layers.*.self_attn.query_key_value": "colwise", "layers.*.self_attn.dense": "rowwise",
            "layers.*.mlp.dense_h_to_4h": "colwise", "layers.*.mlp.dense_4h_to_h": "rowwise",
        },
        fused={"query_key_value": heads_outer("num_heads")},
    ),
    "falcon": Family(
        plan={
            "h.*.self_attention.query_key_value": "colwise", "h.*.self_attention.dense": "rowwise",
            "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise",
        },
        fused={"query_key_value": _falcon_qkv},
        keep=_falcon_keep,
        refuse=_falcon_refuse,
    ),
    "opt": Family(plan={
        "decoder.layers.*.self_attn.q_proj": "colwise", "decoder.layers.*.self_attn.k_proj": "colwise",
        "decoder.layers.*.self_attn.v_proj": "colwise", "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise",
    }),
    "biogpt": Family(plan={
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.out_proj": "rowwise",
        "layers.*.fc1": "colwise", "layers.*.fc2": "rowwise",
    }),
    "stablelm": Family(plan=_LLAMA_PLAN, refuse=_stablelm_refuse),
    "bloom": Family(refuse=_alibi),
    "mpt": Family(refuse=_alibi),
})


def family_of(model: nn.Module, world: int | None = None) -> tuple[str, Family]:
    """(model type, Family) of a Hugging Face base model; InvalidSpec when it is not recognised."""
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", ""))
    family = FAMILIES.get(model_type)
    advice = (
        "pass an explicit plan, e.g. tensor_parallel(model, {'*.q_proj': 'colwise', ...}), after checking "
        "it against one process, or run the model on one device (count=1)"
    )
    if family is None:
        raise InvalidSpec(
            f"tensor_parallel(plan='auto') does not recognise model type {model_type!r} "
            f"({type(model).__name__}): its layers' layouts have not been checked, and a wrong split gives "
            f"wrong outputs silently; {advice}"
        )
    reason = family.refuse(config)
    if reason is not None:
        raise InvalidSpec(
            f"tensor_parallel(plan='auto') cannot shard model type {model_type!r} ({type(model).__name__}): "
            f"{reason}; {advice}"
        )
    return model_type, family
