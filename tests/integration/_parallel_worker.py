"""Rank processes for test_parallel: small seeded models, and checks of gpufn.parallel on gloo."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 128
NEW_TOKENS = 20


def input_ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def build_llama(heads: int = 8, kv_heads: int = 4) -> nn.Module:
    """A 2-layer Llama (hidden 64, GQA) with seeded weights, fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )
    return LlamaForCausalLM(config).eval()


def build_gpt2(heads: int = 4, embd: int = 64) -> nn.Module:
    """A 2-layer GPT-2 (fused qkv in Conv1D) with seeded weights, fp32, eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=embd, n_layer=2, n_head=heads,
        bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )
    return GPT2LMHeadModel(config).eval()


def build_t5(heads: int = 4) -> nn.Module:
    """A 2-layer T5 (relative position bias per head, no head_dim attribute), seeded, fp32."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=heads, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1, attn_implementation="eager")
    return T5ForConditionalGeneration(config).eval()


def t5_logits(model: nn.Module) -> torch.Tensor:
    ids = input_ids()
    return model(input_ids=ids, decoder_input_ids=ids[:, :5]).logits


def build_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16)
    ).eval()


def mlp_input() -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(2))


BUILDERS: dict[str, Callable[[], nn.Module]] = {"llama": build_llama, "gpt2": build_gpt2}


@torch.no_grad()
def reference() -> dict[str, Any]:
    """Single-process outputs the sharded runs must reproduce."""
    ids = input_ids()
    out: dict[str, Any] = {}
    for name, build in BUILDERS.items():
        model = build()
        out[f"{name}_logits"] = model(ids).logits
        out[f"{name}_tokens"] = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
        out[f"{name}_pp_logits"] = model(input_ids(batch=4)).logits
        out[f"{name}_pp_short"] = model(input_ids(batch=4)[:, :7]).logits
    out["mlp"] = build_mlp()(mlp_input())
    out["t5_logits"] = t5_logits(build_t5())
    return out


# -- checks: each returns a value the test compares, or raises (the error is what the test checks)


# Declarative plans equivalent to what plan="auto" finds for these models.
DICT_PLANS: dict[str, dict[str, str]] = {
    "llama": {
        "*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise", "*.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise", "embed_tokens": "replicate",
    },
    "gpt2": {"*.c_attn": "colwise", "*.c_fc": "colwise", "*.c_proj": "rowwise", "lm_head": "replicate"},
    # issue 19: a user's plan for T5 (whose attention has a per-head relative position bias)
    "t5": {"*.q": "colwise", "*.k": "colwise", "*.v": "colwise", "*.o": "rowwise",
           "*.wi": "colwise", "*.wo": "rowwise"},
}


@torch.no_grad()
def _tp(name: str) -> dict[str, torch.Tensor]:
    from gpufn.parallel import tensor_parallel

    model = tensor_parallel(BUILDERS[name]())
    ids = input_ids()
    return {
        "logits": model(ids).logits,
        "tokens": model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS),
        "shapes": local_shapes(model),
    }


def local_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each parameter's (shape held by this rank, full shape)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        out[name] = (tuple(local.shape), tuple(param.shape))
    return out


@torch.no_grad()
def _tp_dict(name: str) -> torch.Tensor:
    from gpufn.parallel import tensor_parallel

    model = tensor_parallel(BUILDERS[name](), DICT_PLANS[name])
    return model(input_ids()).logits


@torch.no_grad()
def _tp_plan(model: nn.Module, plan: dict[str, str]) -> nn.Module:
    from gpufn.parallel import tensor_parallel

    return tensor_parallel(model, plan)


@torch.no_grad()
def _pp(name: str) -> dict[str, torch.Tensor]:
    from gpufn.parallel import pipeline_parallel

    pipe = pipeline_parallel(BUILDERS[name](), stages=2, microbatches=2)
    ids = input_ids(batch=4)
    return {"full": pipe(ids), "short": pipe(ids[:, :7])}  # a new shape gets its own schedule


@torch.no_grad()
def _tp_mlp() -> torch.Tensor:
    from gpufn.parallel import tensor_parallel

    return tensor_parallel(build_mlp())(mlp_input())


@torch.no_grad()
def _pp_mlp_split_points() -> torch.Tensor:
    from gpufn.parallel import pipeline_parallel

    pipe = pipeline_parallel(build_mlp(), ["4"], microbatches=4, example_input=mlp_input())
    return pipe(mlp_input())


def _err_heads() -> None:
    from gpufn.parallel import tensor_parallel

    tensor_parallel(build_gpt2(heads=3, embd=48))


def _err_kv_heads() -> None:
    from gpufn.parallel import tensor_parallel

    tensor_parallel(build_llama(heads=4, kv_heads=2))


def _err_strategy() -> None:
    from gpufn.parallel import tensor_parallel

    tensor_parallel(build_llama(), {"*.q_proj": "colwise", "*.o_proj": "diagonal"})


def _err_pattern() -> None:
    from gpufn.parallel import tensor_parallel

    tensor_parallel(build_llama(), {"*.qkv": "colwise"})


def _err_stages() -> None:
    from gpufn.parallel import pipeline_parallel

    pipeline_parallel(build_llama(), stages=3)


CHECKS: dict[str, Callable[[], Any]] = {
    "tp_llama": lambda: _tp("llama"),
    "tp_gpt2": lambda: _tp("gpt2"),
    "tp_llama_dict": lambda: _tp_dict("llama"),
    "tp_gpt2_dict": lambda: _tp_dict("gpt2"),
    "tp_mlp": _tp_mlp,
    "tp_t5_dict": lambda: t5_logits(_tp_plan(build_t5(), DICT_PLANS["t5"])),
    "pp_llama": lambda: _pp("llama"),
    "pp_gpt2": lambda: _pp("gpt2"),
    "pp_mlp_split_points": _pp_mlp_split_points,
    "err_heads": _err_heads,
    "err_kv_heads": _err_kv_heads,
    "err_strategy": _err_strategy,
    "err_pattern": _err_pattern,
    "err_stages": _err_stages,
}


def _check(name: str, world: int) -> Any:
    if name.startswith("family:"):  # test_tp_families: one transformers family, see _tp_families
        import _tp_families

        return _tp_families.check(name.partition(":")[2], world)
    return CHECKS[name]()


def run_rank(rank: int, world: int, store: str, out_dir: str, checks: list[str]) -> None:
    """Entry point of one spawned rank: run `checks` in order, save each outcome to out_dir."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # world size processes share 2 cores
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    results: dict[str, tuple[str, Any]] = {}
    try:
        for name in checks:
            try:
                results[name] = ("ok", _check(name, world))
            except Exception as exc:
                results[name] = ("raised", (type(exc).__name__, str(exc), traceback.format_exc()))
            dist.barrier()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
