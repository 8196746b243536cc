"""Serving under load, one simulated device, the ~12M-parameter seeded Llama of
`gpufn.engines.testing` (the model of examples/llm_openai.py), greedy decoding.

Systems, measured in one run, interleaved:
- `ceiling`: the transformers engine stepped in this process, clients as threads (no RPC);
- `engine`: gpufn, a function whose calls share each step of that engine on a worker;
- `per_call`: gpufn's per-call streaming path of before (each call decodes alone with its
  own KV cache, `concurrency=C` of them at once): the floor;
- `ray`: Ray Serve, `@serve.batch` on a streaming generator over the same model (a static
  batch per wait window, each step off the event loop), with `--ray` where ray[serve] is
  installed, at a batch wait of 5 ms and 100 ms.

Workloads: closed loop at concurrency C (each client sends its next request when its last
ended; equal lengths), and open loop with Poisson arrivals at fractions of the ceiling's
capacity with output lengths drawn from 8..256. Reported per system: output tokens/s,
time to first token p50/p99 and inter-token latency p50/p99 (ms); and the ratios the
serving issue sets targets for.

    python bench/serving.py --quick            # C = 1, 8, 32, short
    python bench/serving.py [--concurrency 1,8,32,64] [--tokens 32] [--rates 0.4,0.6,0.8]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import gpufn
from gpufn.engines import SamplingParams
from gpufn.engines import driver as engine_driver
from gpufn.engines.testing import tiny_model_and_tokenizer

PROMPT_LEN = 16
MAX_BATCH = 64


# --------------------------------------------------------------------------- the gpufn side


@gpufn.model(memory="128MiB")
def engine_model() -> Any:
    from gpufn.engines import TransformersEngine

    model, tokenizer = tiny_model_and_tokenizer(seed=0, max_positions=512)
    return TransformersEngine(model, tokenizer, max_batch=MAX_BATCH)


@gpufn.gpu(models=[engine_model], concurrency=MAX_BATCH, memory="4MiB", timeout=3600)
def stepped(prompt: list[int], max_tokens: int) -> Iterator[int]:
    """Tokens as the shared steps make them (one small int a step)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for out in engine_driver.generate(engine_model, prompt, params):
        if out.token_ids:
            yield len(out.token_ids)


@gpufn.model(memory="128MiB")
def plain_model() -> Any:
    return tiny_model_and_tokenizer(seed=0, max_positions=512)[0]


@gpufn.gpu(models=[plain_model], concurrency=MAX_BATCH, memory="4MiB", timeout=3600)
def per_call(prompt: list[int], max_tokens: int) -> Iterator[int]:
    """Today's path: this call decodes alone with its own KV cache."""
    yield from decode_alone(plain_model.get(), prompt, max_tokens)


def decode_alone(model: Any, prompt: list[int], max_tokens: int) -> Iterator[int]:
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        for _ in range(max_tokens):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            yield 1
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)


# --------------------------------------------------------------------------- measuring


@dataclass
class Run:
    """What the clients saw: per request its first token's delay and its token gaps."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, start: float, stream: Iterator[int]) -> None:
        last, first, n, gaps = start, None, 0, []
        for k in stream:
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append((now - last) / max(k, 1))
            last, n = now, n + k
        with self.lock:
            self.ttft.append(first if first is not None else float("nan"))
            self.itl += gaps
            self.tokens += n

    def row(self) -> dict[str, float]:
        def q(xs: list[float], p: float) -> float:
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")
        return {"tok_s": self.tokens / self.seconds if self.seconds else 0.0,
                "ttft50": q(self.ttft, 0.5), "ttft99": q(self.ttft, 0.99),
                "itl50": q(self.itl, 0.5), "itl99": q(self.itl, 0.99)}


Send = Callable[[list[int], int], Iterator[int]]


def closed_loop(send: Send, concurrency: int, per_client: int, tokens: int) -> Run:
    run = Run()
    prompts = _prompts(concurrency * per_client)

    def client(i: int) -> None:
        for j in range(per_client):
            t = time.perf_counter()
            run.request(t, send(prompts[i * per_client + j], tokens))

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    run.seconds = time.perf_counter() - t0
    return run


def open_loop(send: Send, rate: float, lengths: list[int]) -> Run:
    """Poisson arrivals at `rate` requests/s, each with its own output length."""
    run = Run()
    prompts = _prompts(len(lengths))
    rng = random.Random(7)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(lengths)) as pool:
        futures, at = [], t0
        for p, n in zip(prompts, lengths, strict=True):
            at += rng.expovariate(rate)
            time.sleep(max(0.0, at - time.perf_counter()))
            futures.append(pool.submit(lambda p=p, n=n, s=at: run.request(s, send(p, n))))
        for f in futures:
            f.result()
    run.seconds = time.perf_counter() - t0
    return run


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(10, 700, (n, PROMPT_LEN), generator=g).tolist()  # the vocabulary: 712


# --------------------------------------------------------------------------- the systems


def in_process() -> Send:
    from gpufn.engines import TransformersEngine

    model, tokenizer = tiny_model_and_tokenizer(seed=0, max_positions=512)
    engine = TransformersEngine(model, tokenizer, max_batch=MAX_BATCH)
    counter = iter(range(10**9))

    def send(prompt: list[int], tokens: int) -> Iterator[int]:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        for out in engine_driver.generate(engine, prompt, params, request_id=f"r{next(counter)}"):
            if out.token_ids:
                yield len(out.token_ids)
    return send


def via_gpufn(fn: Any) -> Send:
    def send(prompt: list[int], tokens: int) -> Iterator[int]:
        return iter(fn.spawn(prompt, tokens).stream())
    return send


def via_ray(wait_s: float) -> tuple[Send, Callable[[], None]]:
    import ray
    from ray import serve

    if not ray.is_initialized():
        # Loopback only: Ray would otherwise bind this host's interface address.
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")

    @serve.deployment(max_ongoing_requests=4 * MAX_BATCH)
    class Batched:
        def __init__(self) -> None:
            self.model = tiny_model_and_tokenizer(seed=0, max_positions=512)[0]

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=wait_s)
        async def batched(self, prompts: list[list[int]], lengths: list[int]) -> Any:
            import asyncio

            from transformers import DynamicCache

            loop = asyncio.get_running_loop()
            cache = DynamicCache()
            ids = torch.tensor(prompts)
            out = await loop.run_in_executor(None, lambda: self.model(
                input_ids=ids, past_key_values=cache, use_cache=True))
            for step in range(max(lengths)):  # a static batch: until its longest member
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                yield [1 if step < n else StopIteration for n in lengths]
                out = await loop.run_in_executor(None, lambda n=nxt: self.model(
                    input_ids=n, past_key_values=cache, use_cache=True))

        async def generate(self, prompt: list[int], length: int) -> Any:
            async for token in self.batched(prompt, length):
                yield token

    handle = serve.run(Batched.bind(), name=f"bench{int(wait_s * 1000)}", route_prefix=None)

    def send(prompt: list[int], tokens: int) -> Iterator[int]:
        gen = handle.options(stream=True).generate.remote(prompt, tokens)
        for v in gen:
            if v is StopIteration:
                return
            yield v

    return send, lambda: serve.delete(f"bench{int(wait_s * 1000)}")


# --------------------------------------------------------------------------- the report


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--rates", default="0.4,0.6,0.8", help="fractions of the ceiling's capacity")
    ap.add_argument("--open-requests", type=int, default=48)
    ap.add_argument("--ray", action="store_true", help="also Ray Serve (needs ray[serve])")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.tokens, args.per_client = "1,8,32", 16, 1
        args.rates, args.open_requests = "0.8", 24
    # The ceiling steps in this process with torch's default threads, as a worker does.
    os.environ.setdefault("GPUFN_CPU_DEVICES", "1")
    os.environ.setdefault("GPUFN_PROGRESS", "0")
    systems: dict[str, Send] = {"ceiling": in_process(), "engine": via_gpufn(stepped),
                                "per_call": via_gpufn(per_call)}
    closers: list[Callable[[], None]] = []
    if args.ray:
        try:
            for wait in (0.005, 0.1):
                send, close = via_ray(wait)
                systems[f"ray_{int(wait * 1000)}ms"] = send
                closers.append(close)
        except ImportError as e:
            print(f"ray: not measured ({e}; pip install 'ray[serve]')", file=sys.stderr)
    for name in ("engine", "per_call"):  # warm: models loaded, code on the worker
        list(systems[name](_prompts(1)[0], 2))
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for c in map(int, args.concurrency.split(",")):
        for name, send in systems.items():
            rows[(f"closed C={c}", name)] = closed_loop(send, c, args.per_client,
                                                        args.tokens).row()
            _print(f"closed C={c}", name, rows[(f"closed C={c}", name)])
    capacity = max(r["tok_s"] for (w, s), r in rows.items() if s == "ceiling")
    rng = random.Random(3)
    lengths = [rng.randint(8, 256) for _ in range(args.open_requests)]
    mean_len = statistics.mean(lengths)
    for frac in map(float, args.rates.split(",")):
        rate = frac * capacity / mean_len
        for name, send in systems.items():
            if name == "per_call" and frac > 0.5 and not args.quick:
                continue  # the floor falls far behind; its queue would take minutes
            rows[(f"open {frac:g}", name)] = open_loop(send, rate, lengths).row()
            _print(f"open {frac:g}x ({rate:.2f} req/s)", name, rows[(f"open {frac:g}", name)])
    _ratios(rows, args)
    for close in closers:
        close()


def _print(workload: str, system: str, r: dict[str, float]) -> None:
    print(f"{workload:>24} {system:>10}  {r['tok_s']:8.1f} tok/s  ttft p50/p99 "
          f"{r['ttft50']:7.1f}/{r['ttft99']:7.1f} ms  itl p50/p99 {r['itl50']:6.1f}/"
          f"{r['itl99']:6.1f} ms", flush=True)


def _ratios(rows: dict[tuple[str, str], dict[str, float]], args: Any) -> None:
    cs = [int(c) for c in args.concurrency.split(",")]
    big = 32 if 32 in cs else max(cs)
    w = f"closed C={big}"
    eng, ceil, floor = rows[(w, "engine")], rows[(w, "ceiling")], rows[(w, "per_call")]
    print(f"\n{w}: engine {eng['tok_s'] / ceil['tok_s']:.2f}x the in-process ceiling "
          f"(target >= 0.7), {eng['tok_s'] / floor['tok_s']:.2f}x per-call streaming "
          "(target >= 5)")
    rays = [r for (wl, s), r in rows.items() if wl == w and s.startswith("ray")]
    if rays:
        best = max(r["tok_s"] for r in rays)
        print(f"{w}: engine {eng['tok_s'] / best:.2f}x Ray Serve at its better wait (target >= 1.2)")
    one = rows.get(("closed C=1", "engine"))
    if one:
        print(f"engine ttft p99 at C={big} / at C=1: {eng['ttft99'] / one['ttft99']:.2f}x "
              "(target <= 4)")
    print(f"engine itl p50 / the ceiling's at C={big}: {eng['itl50'] / ceil['itl50']:.2f}x "
          "(target <= 1.5)")


if __name__ == "__main__":
    main()
