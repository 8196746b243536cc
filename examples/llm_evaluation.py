"""LLM evaluation with a shared result cache: 200 prompts x 3 tasks on a tiny seeded model.

    python examples/llm_evaluation.py [--prompts 200] [--cache DIR]

Like lm-evaluation-harness, the requests are spread over the devices by estimated cost
(`f.map(..., cost=...)`: the longest go first, so none straggles at the end) and every
result goes to a cache that all callers share (`@gpu(cache=...)`): keyed by the
function's code and its arguments, on a directory that may sit on a shared filesystem,
with identical concurrent calls computed once across the cluster. A re-run reads what
is there and computes only what is missing. The model is a small Llama built from a
config with seeded weights (nothing is downloaded), shared by every call on a device
through `@gpufn.model`; the same file runs unchanged on GPUs.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time

import torch

import gpufn

TASKS = {"loglikelihood": 1.0, "perplexity": 1.0, "greedy_continuation": 3.0}  # relative cost


@gpufn.model(memory="256MiB")
def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    return LlamaForCausalLM(config).eval()


@gpufn.gpu(models=[tiny_llama], memory="256MiB")
def score(task: str, prompt: list[int]) -> float:
    """One request: the log-likelihood of the prompt's last 4 tokens, the prompt's
    perplexity, or the share of its last 4 tokens that greedy decoding reproduces."""
    model = tiny_llama.get()
    ids = torch.tensor([prompt], device=gpufn.current_device())
    with torch.no_grad():
        if task == "greedy_continuation":
            out = model.generate(ids[:, :-4], max_new_tokens=4, do_sample=False)
            return float((out[0, -4:] == ids[0, -4:]).float().mean())
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        token_lp = logp.gather(1, ids[0, 1:, None])[:, 0]
        if task == "loglikelihood":
            return float(token_lp[-4:].sum())
        return float(torch.exp(-token_lp.mean()))


def make_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(8, 96, (n,), generator=g)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in lengths]


def run(fn: gpufn.Function, prompts: list[list[int]]) -> tuple[dict[str, list[float]], dict, float]:
    tasks = [t for t in TASKS for _ in prompts]
    inputs = [p for _ in TASKS for p in prompts]
    before = fn.cache_info()
    t0 = time.perf_counter()
    scores = list(fn.map(tasks, inputs, cost=lambda task, prompt: len(prompt) * TASKS[task]))
    elapsed = time.perf_counter() - t0
    after = fn.cache_info()
    delta = {k: after[k] - before[k] for k in ("hits", "computed", "waited")}
    by_task = {t: scores[i * len(prompts):(i + 1) * len(prompts)] for i, t in enumerate(TASKS)}
    return by_task, delta, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--cache", default=None, help="cache directory (default: a new temporary one)")
    args = ap.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="gpufn-eval-cache-")
    evaluate = score.with_options(cache=cache)
    prompts = make_prompts(args.prompts + args.prompts // 5)
    base = prompts[:args.prompts]
    n = len(base) * len(TASKS)

    score.remote("perplexity", [1, 2, 3])  # start the cluster first: run 1 times the work only
    first, c1, t1 = run(evaluate, base)
    print(f"run 1: {n} requests, {c1['computed']} computed, {c1['hits']} from cache, {t1:.2f} s")
    second, c2, t2 = run(evaluate, base)
    print(f"run 2: {n} requests, {c2['computed']} computed, {c2['hits']} from cache, {t2:.2f} s "
          f"(cache hit saving {100 * (1 - t2 / t1):.1f}%, {t1 / max(t2, 1e-9):.0f}x faster)")
    third, c3, _ = run(evaluate, prompts)
    print(f"run 3 (+{len(prompts) - len(base)} prompts): {len(prompts) * len(TASKS)} requests, "
          f"{c3['computed']} computed, {c3['hits']} from cache")
    same = first == second and all(third[t][:len(base)] == first[t] for t in TASKS)
    for task, values in first.items():
        print(f"  {task}: mean {sum(values) / len(values):.4f}")
    assert all(math.isfinite(v) for vs in first.values() for v in vs)
    print(f"identical results from cache: {same}")
    if args.cache is None:
        shutil.rmtree(cache, ignore_errors=True)
    else:
        print(f"cache directory: {cache}")


if __name__ == "__main__":
    main()
