"""Measures the exactness rule of `TransformersEngine`: random batches of greedy requests
(random prompts of 1-40 tokens, 1-24 output tokens, joining at random steps, some with
stop strings) against each request run alone, comparing every token and the bits of its
log-probability (a bitwise check of each step's logits). Run with padding (the default
`min_rows`) and without (`--min-rows 1`) to see what the padding buys. `--gemm` prints
the rule underneath: for which row counts M a GEMM row differs from the same row at M=96.

    python bench/engine_exactness.py [--trials 20] [--requests 16] [--threads 1,2]
                                     [--model-seeds 0,1] [--min-rows 16]
    python bench/engine_exactness.py --gemm [--threads 1,2,4,8]
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from gpufn.engines.base import SamplingParams
from gpufn.engines.testing import tiny_model_and_tokenizer
from gpufn.engines.transformers_engine import TransformersEngine

Trace = list[tuple[int, float]]


def run(engine: TransformersEngine, reqs: list[tuple[str, list[int], SamplingParams, int]]
        ) -> dict[str, Trace]:
    """(token, its logprob) per request; requests added before their join step."""
    trace: dict[str, Trace] = {r[0]: [] for r in reqs}
    pending = sorted(reqs, key=lambda r: r[3])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            for lp in out.logprobs or ():
                trace[out.request_id].append((lp.chosen.token_id, lp.chosen.logprob))
        step += 1
    return trace


def trial(engine: TransformersEngine, rng: random.Random, n: int, vocab: int) -> tuple[int, int, int]:
    """(requests, tokens compared, requests that differ from their alone run)."""
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 41))]
        stop = (rng.choice(["e", "at", "o"]),) if rng.random() < 0.3 else ()
        params = SamplingParams(max_tokens=rng.randrange(1, 25), stop=stop, logprobs=0)
        reqs.append((f"r{i}", prompt, params, rng.randrange(0, 12)))
    batched = run(engine, reqs)
    bad = tokens = 0
    for r in reqs:
        alone = run(engine, [(r[0], r[1], r[2], 0)])[r[0]]
        tokens += len(alone)
        bad += alone != batched[r[0]]
    return n, tokens, bad


def gemm_sweep(threads: int) -> list[int]:
    """Row counts M (1..96) at which some row of `linear(x[:M], W)` differs in any bit from
    the same row computed at M = 96, over the shapes of a small transformer."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    bad: set[int] = set()
    for k, n in [(384, 384), (384, 128), (384, 1280), (1280, 384), (384, 712), (256, 4096)]:
        w, x = torch.randn(n, k, generator=g), torch.randn(96, k, generator=g)
        ref = torch.nn.functional.linear(x, w)
        bad.update(m for m in range(1, 97)
                   if not torch.equal(torch.nn.functional.linear(x[:m], w), ref[:m]))
    return sorted(bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--model-seeds", default="0,1")
    ap.add_argument("--min-rows", type=int, default=16)
    ap.add_argument("--gemm", action="store_true")
    args = ap.parse_args()
    if args.gemm:
        for threads in (int(t) for t in args.threads.split(",")):
            print(f"threads={threads}: GEMM rows differ at M = {gemm_sweep(threads)}")
        return
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for mseed in (int(s) for s in args.model_seeds.split(",")):
            model, tok = tiny_model_and_tokenizer(seed=mseed)
            engine = TransformersEngine(model, tok, max_batch=args.requests,
                                        min_rows=args.min_rows)
            rng = random.Random(1000 * mseed + threads)
            totals: Any = [0, 0, 0]
            with torch.inference_mode():
                for _ in range(args.trials):
                    for k, v in enumerate(trial(engine, rng, args.requests, len(tok))):
                        totals[k] += v
            print(f"threads={threads} model_seed={mseed} min_rows={args.min_rows}: "
                  f"{args.trials} batches, {totals[0]} requests, {totals[1]} tokens compared "
                  f"(token and logprob bits): {totals[2]} requests differ from alone",
                  flush=True)


if __name__ == "__main__":
    main()
