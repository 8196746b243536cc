"""The transformers families the tensor_parallel sweep builds (tiny seeded configs), and the check each rank runs."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = 128
SEQ = 10
NEW_TOKENS = 6

# Every family: 2 layers, hidden 64, 8 heads of 8 (4 key/value heads where the family has GQA).
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class Fam:
    """One sweep entry: a model type and config overrides; what must come out of tensor_parallel."""

    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    # params (name suffix, dim) whose local size must be the full size / world on every rank
    shards: tuple[tuple[str, int], ...] = ()
    refused: str = ""  # a fragment of the InvalidSpec message when the family must be refused
    min_share: float = 0.5  # lowest share of parameters sharded when it shards
    default: bool = True  # in the default (fast) sweep; the rest run under -m slow


_ATTN = (("layers.0.self_attn.q_proj.weight", 0), ("layers.0.self_attn.k_proj.weight", 0),
         ("layers.0.self_attn.o_proj.weight", 1))
_MLP = (("layers.0.mlp.up_proj.weight", 0), ("layers.0.mlp.down_proj.weight", 1))
_EXPERTS = (("layers.0.mlp.experts.gate_up_proj", 1), ("layers.0.mlp.experts.down_proj", 2))

FAMILIES: dict[str, Fam] = {
    "gpt2": Fam("gpt2", shards=(("h.0.attn.c_attn.weight", 0), ("h.0.mlp.c_proj.weight", 1))),
    "llama": Fam("llama", shards=_ATTN + _MLP),
    "mistral": Fam("mistral", shards=_ATTN + _MLP),
    "qwen2": Fam("qwen2", shards=_ATTN + _MLP),
    "qwen3": Fam("qwen3", {"head_dim": 8}, shards=_ATTN + _MLP, default=False),
    "qwen2_moe": Fam("qwen2_moe", {**_MOE, "shared_expert_intermediate_size": 64},
                     shards=_ATTN + _EXPERTS + (("layers.0.mlp.shared_expert.down_proj.weight", 1),)),
    "qwen3_moe": Fam("qwen3_moe", {**_MOE, "head_dim": 8}, shards=_ATTN + _EXPERTS, default=False),
    "mixtral": Fam("mixtral", {"num_local_experts": 4}, shards=_ATTN + _EXPERTS),
    "phi": Fam("phi", shards=(("layers.0.self_attn.q_proj.weight", 0), ("layers.0.mlp.fc2.weight", 1))),
    "phi3": Fam("phi3", shards=(("layers.0.self_attn.qkv_proj.weight", 0), ("layers.0.mlp.down_proj.weight", 1))),
    "gemma": Fam("gemma", {"head_dim": 8}, shards=_ATTN + _MLP, min_share=0.1),  # a 256k-wide default... tiny here
    "gemma2": Fam("gemma2", {"head_dim": 8}, shards=_ATTN + _MLP, min_share=0.1),
    "gemma3_text": Fam("gemma3_text", {"head_dim": 8}, shards=_ATTN + _MLP, min_share=0.1, default=False),
    "falcon": Fam("falcon", shards=(("h.0.self_attention.dense.weight", 1), ("h.0.mlp.dense_4h_to_h.weight", 1))),
    "falcon_new_arch": Fam("falcon", {"new_decoder_architecture": True, "num_kv_heads": 4},
                           shards=(("h.0.self_attention.query_key_value.weight", 0),), default=False),
    "gpt_neox": Fam("gpt_neox", shards=(("layers.0.attention.query_key_value.weight", 0),
                                        ("layers.0.mlp.dense_4h_to_h.weight", 1))),
    "gptj": Fam("gptj", {"rotary_dim": 4}, shards=(("h.0.attn.q_proj.weight", 0), ("h.0.mlp.fc_out.weight", 1))),
    "codegen": Fam("codegen", {"rotary_dim": 4}, shards=(("h.0.attn.qkv_proj.weight", 0), ("h.0.mlp.fc_out.weight", 1))),
    "gpt_bigcode_mha": Fam("gpt_bigcode", {"multi_query": False}, shards=(("h.0.attn.c_attn.weight", 0),
                                                                          ("h.0.mlp.c_proj.weight", 1))),
    "gpt_bigcode_mqa": Fam("gpt_bigcode", {"multi_query": True}, shards=(("h.0.attn.c_proj.weight", 1),
                                                                         ("h.0.mlp.c_proj.weight", 1))),
    "opt": Fam("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64},
               shards=(("layers.0.self_attn.q_proj.weight", 0), ("layers.0.fc2.weight", 1))),
    "bloom": Fam("bloom", refused="ALiBi"),
    "mpt": Fam("mpt", refused="ALiBi", default=False),
    "stablelm": Fam("stablelm", shards=_ATTN + _MLP),
    "stablelm_qk_norm": Fam("stablelm", {"qk_layernorm": True}, refused="qk_layernorm", default=False),
    "starcoder2": Fam("starcoder2", shards=(*_ATTN, ("layers.0.mlp.c_proj.weight", 1))),
    "olmo": Fam("olmo", shards=_ATTN + _MLP),
    "olmo2": Fam("olmo2", shards=_ATTN + _MLP, default=False),
    "cohere": Fam("cohere", shards=_ATTN + _MLP),
    "granite": Fam("granite", shards=_ATTN + _MLP),
    "granitemoe": Fam("granitemoe", {"num_local_experts": 4},
                      shards=(("layers.0.block_sparse_moe.experts.down_proj", 2),), default=False),
    "olmoe": Fam("olmoe", {"num_experts": 8}, shards=_EXPERTS, default=False),
    "phimoe": Fam("phimoe", {"num_local_experts": 4}, shards=_EXPERTS, default=False),
    "persimmon": Fam("persimmon", shards=(("layers.0.self_attn.query_key_value.weight", 0),), default=False),
    "biogpt": Fam("biogpt", shards=(("layers.0.self_attn.q_proj.weight", 0), ("layers.0.fc2.weight", 1)),
                  default=False),
    "nemotron": Fam("nemotron", shards=_ATTN, default=False),
    "glm": Fam("glm", {"head_dim": 8}, shards=_ATTN, default=False),
    "gpt_neo": Fam("gpt_neo", {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
                   refused="does not recognise", default=False),
}


def build(fam: Fam) -> torch.nn.Module:
    """The family's tiny model with seed-0 weights, fp32, eval mode (nothing downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(fam.model_type, **{**COMMON, **fam.overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    # transformers leaves some 3-D expert weights as torch.empty: give them seeded values, the same on every rank
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 3:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _local_numel(param: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    return tuple((param.to_local() if isinstance(param, DTensor) else param).shape)


@torch.no_grad()
def check(name: str, world: int) -> dict[str, Any]:
    """On one rank: the single-process run and the tensor-parallel run of family `name`."""
    from gpufn.parallel import tensor_parallel

    fam = FAMILIES[name]
    ids = input_ids()
    model = build(fam)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters())
    ref_logits = model(ids).logits
    ref_tokens = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    del model
    model = build(fam)
    try:
        tensor_parallel(model)
    except Exception as exc:
        return {"outcome": "raised", "error": (type(exc).__name__, str(exc), traceback.format_exc())}
    try:
        logits = model(ids).logits
        tokens = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    except Exception as exc:
        return {"outcome": "crashed", "error": (type(exc).__name__, str(exc), traceback.format_exc())}
    local = sum(_local_numel(p) for p in model.parameters())
    return {
        "outcome": "ran", "ref_logits": ref_logits, "ref_tokens": ref_tokens, "logits": logits, "tokens": tokens,
        "full_shapes": full_shapes, "local_shapes": {n: _local_shape(p) for n, p in model.named_parameters()},
        # every sharded parameter holds 1/world on each rank: local = whole + sharded / world
        "share": (total - local) * world / ((world - 1) * total),
    }
