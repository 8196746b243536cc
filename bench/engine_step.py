"""Output tokens/s of `TransformersEngine` stepping B greedy requests together (B = 1, 8, 32)
against (a) the same requests run one at a time through the engine and (b) a hand-written
minimal batched greedy loop over the same model and the library's DynamicCache (the
ceiling: equal prompt lengths, no padding, no per-request work). One process, the tiny
seeded Llama of `gpufn.engines.testing`; min and median of `--repeats`.

    python bench/engine_step.py [--batches 1,8,32] [--tokens 32] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from gpufn.engines.base import SamplingParams
from gpufn.engines.kv_rows import cache_kwarg
from gpufn.engines.testing import tiny_model_and_tokenizer
from gpufn.engines.transformers_engine import TransformersEngine

PROMPT_LEN = 16


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(10, vocab, (n, PROMPT_LEN), generator=g).tolist()


def engine_run(engine: TransformersEngine, batch: list[list[int]], tokens: int) -> int:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced


def one_at_a_time(engine: TransformersEngine, batch: list[list[int]], tokens: int) -> int:
    return sum(engine_run(engine, [p], tokens) for p in batch)


def hand_loop(model: Any, batch: list[list[int]], tokens: int) -> int:
    """Prefill all prompts as one batch, then greedy decode steps over a DynamicCache."""
    from transformers import DynamicCache

    kw = {cache_kwarg(model): DynamicCache()}
    ids = torch.tensor(batch)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(tokens - 1):
        out = model(input_ids=nxt, use_cache=True, **kw)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return len(batch) * tokens


def timed(fn: Callable[[], int], repeats: int) -> tuple[float, float]:
    """(min, median) output tokens/s over `repeats` runs."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t0))
    return min(rates), statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = tiny_model_and_tokenizer()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny Llama {n_params / 1e6:.1f}M params, fp32 CPU, {args.threads} thread(s), "
          f"prompt {PROMPT_LEN} tokens, {args.tokens} output tokens each, "
          f"min/median of {args.repeats}")
    print(f"{'batch':>5} {'engine tok/s':>18} {'one at a time':>18} {'hand loop':>18} "
          f"{'eng/alone':>9} {'eng/hand':>9}")
    with torch.inference_mode():
        for b in (int(x) for x in args.batches.split(",")):
            batch = prompts(b, len(tok))
            engine = TransformersEngine(model, tok, max_batch=max(b, 1))
            n = args.tokens
            eng = timed(partial(engine_run, engine, batch, n), args.repeats)
            solo = timed(partial(one_at_a_time, engine, batch, n), args.repeats)
            model.config._attn_implementation = "sdpa"
            hand = timed(partial(hand_loop, model, batch, n), args.repeats)
            model.config._attn_implementation = "gpufn_rows"
            print(f"{b:>5} {eng[0]:>8.0f} / {eng[1]:<7.0f} {solo[0]:>8.0f} / {solo[1]:<7.0f} "
                  f"{hand[0]:>8.0f} / {hand[1]:<7.0f} {eng[1] / solo[1]:>9.2f} "
                  f"{eng[1] / hand[1]:>9.2f}")


if __name__ == "__main__":
    main()
