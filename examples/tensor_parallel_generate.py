"""Tensor-parallel generation on two devices with `gpufn.parallel.tensor_parallel`.

    python examples/tensor_parallel_generate.py

A `@gpu(count=2)` function builds a small Llama-architecture model from a config with
seeded weights (no download), shards it across its gang with PyTorch's own tensor
parallelism, and generates greedily. Every rank runs the same code (SPMD); rank 0's
return value is the call's result. On the embedded cluster without GPUs this runs on two
simulated CPU devices over gloo; on GPUs the same code runs over NCCL.
"""

from __future__ import annotations

import torch

import gpufn
from gpufn.parallel import tensor_parallel


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


@gpufn.gpu(count=2, timeout=300)
def generate(prompt: list[int], new_tokens: int = 20) -> list[int]:
    ctx = gpufn.context()
    model = tensor_parallel(build_model().to(ctx.device))  # shards over the gang's mesh
    ids = torch.tensor([prompt], device=ctx.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0].tolist()


def main() -> None:
    prompt = [1, 5, 9, 42, 7]
    sharded = generate.remote(prompt)
    with torch.no_grad():
        single = build_model().generate(torch.tensor([prompt]), max_new_tokens=20,
                                        do_sample=False)[0].tolist()
    print("tensor parallel (TP=2):", sharded)
    print("single process:       ", single)
    print("identical:", sharded == single)


if __name__ == "__main__":
    main()
