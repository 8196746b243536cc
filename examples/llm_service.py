"""An LLM service on the embedded cluster: a TP=2 sharded Llama, loaded once, kept warm.

    python examples/llm_service.py

`@gpufn.model(count=2)` declares a model sharded over a gang of two devices: its loader
runs on both ranks inside the gang's process group and returns that rank's shard
(`tensor_parallel(build())`). Functions with `@gpu(count=2, models=[llama])` get the
local shard from `llama.get()`; the first call loads it, later calls find it resident on
the same two devices (no load), and the pool may offload it to host memory and bring it
back as a whole. The model is a small Llama built from a config with seeded weights (no
download); on the embedded cluster without GPUs it runs on two simulated CPU devices over
gloo, on GPUs the same code runs over NCCL.

`generate_stream` yields tokens as they are produced; it is used through
`generate_stream.remote_gen(...)`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

import gpufn
from gpufn.parallel import tensor_parallel


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


@gpufn.model(memory="8MiB", count=2)  # memory is per device
def llama() -> torch.nn.Module:
    return tensor_parallel(build_model().to(gpufn.context().device))  # this rank's shard


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):].tolist()]


def stream_tokens(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Iterator[int]:
    """Greedy decoding one token at a time with the KV cache (the same on every rank)."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids = out.logits[:, -1:].argmax(-1)
            yield int(ids[0, 0])


@gpufn.gpu(count=2, models=[llama], timeout=600)
def generate(prompt: list[int], max_new_tokens: int = 16) -> list[int]:
    return greedy(llama.get(), prompt, max_new_tokens)  # every rank runs it; rank 0's value returns


@gpufn.gpu(count=2, models=[llama], timeout=600)
def generate_stream(prompt: list[int], max_new_tokens: int = 16) -> Iterator[int]:
    yield from stream_tokens(llama.get(), prompt, max_new_tokens)  # rank 0's tokens stream


def main() -> None:
    prompts = [[1, 5, 9, 42, 7], [300, 2, 77], [11, 12, 13, 14, 15, 16]]
    single = build_model()
    for i, prompt in enumerate(prompts):
        t = time.perf_counter()
        call = generate.spawn(prompt, 16)
        tokens = call.get(timeout=600)
        cold = call.result_meta()["cold_start"] or "no load (resident)"
        print(f"call {i + 1}: {time.perf_counter() - t:6.2f}s  {cold:<20} {tokens}")
        assert tokens == greedy(single, prompt, 16), "differs from a single-process greedy run"
    print("tokens equal a single-process greedy run: True")
    for prompt in prompts:
        t = time.perf_counter()
        streamed = []
        for tok in generate_stream.remote_gen(prompt, 16):
            if not streamed:
                print(f"first token after {time.perf_counter() - t:.3f}s: ", end="", flush=True)
            streamed.append(tok)
            print(tok, end=" ", flush=True)
        print(f"(all {len(streamed)} in {time.perf_counter() - t:.3f}s)")
        assert streamed == list(stream_tokens(single, prompt, 16))
    print("streamed tokens equal a single-process run: True")
    rec = next(m for m in gpufn.connect().status()["models"] if m["name"] == "llama")
    print(f"llama: loaded {rec['loads']} time(s), sharded over {rec['gang']}, "
          f"bytes per device {rec['shard_bytes']}")


if __name__ == "__main__":
    main()
