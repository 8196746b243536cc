"""Tensor-parallel forward time of a small Llama-architecture model at TP=1/2/4 on CPU with gloo.

For the record, not a speed claim: on a few CPU cores the all-reduces and DTensor dispatch cost
more than the sharded matmuls save. Run: python bench/tp_forward.py [--runs 20] [--tp 1 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, attn_implementation="eager",
    )
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def timed_forward(model: torch.nn.Module, args: argparse.Namespace, distributed: bool) -> list[float]:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    times = []
    for i in range(args.warmup + args.runs):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        model(ids)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if distributed:  # a step takes as long as its slowest rank
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(elapsed.item())
    return times


def rank_main(rank: int, world: int, store: str, out: str, args: argparse.Namespace, threads: int) -> None:
    from gpufn.parallel import tensor_parallel

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = tensor_parallel(build(args))
        times = timed_forward(model, args, distributed=True)
        if rank == 0:
            torch.save(times, out)
    finally:
        dist.destroy_process_group()


def run_tp(tp: int, args: argparse.Namespace, threads: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.pt")
        mp.start_processes(
            rank_main, args=(tp, str(Path(tmp) / "store"), out, args, threads),
            nprocs=tp, start_method="spawn",
        )
        times: list[float] = torch.load(out)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(
        f"Llama-arch: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; "
        f"batch {args.batch} x seq {args.seq}; fp32, CPU, gloo, {cores} cores; "
        f"{args.runs} runs after {args.warmup} warm-up"
    )
    print(f"{'TP':>3} {'threads/rank':>12} {'min ms':>9} {'median ms':>10} {'median vs TP=1':>15}")
    base: float | None = None
    for tp in args.tp:
        threads = max(1, cores // tp)
        if tp == 1:  # the plain model: no process group, no DTensor
            torch.set_num_threads(threads)
            times = timed_forward(build(args), args, distributed=False)
        else:
            times = run_tp(tp, args, threads)
        median = statistics.median(times)
        base = median if base is None else base
        print(
            f"{tp:>3} {threads:>12} {min(times) * 1e3:>9.1f} {median * 1e3:>10.1f} "
            f"{median / base:>14.2f}x"
        )


if __name__ == "__main__":
    main()
