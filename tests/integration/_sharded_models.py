"""Seeded GPT-2 and Llama models from configs (no download) for the sharded-model tests,
the example and the bench: built the same way in a worker and in a single process."""

from __future__ import annotations

from typing import Any

import torch


def llama(layers: int = 2, hidden: int = 128, heads: int = 8, kv_heads: int = 4,
          vocab: int = 256, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


def gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256,
         seed: int = 1) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                     n_positions=256, bos_token_id=None, eos_token_id=None,
                     initializer_range=0.2)
    return GPT2LMHeadModel(cfg).eval()


def greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int, device: Any = "cpu") -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0].tolist()]
