"""Sharded models kept resident across a gang vs rebuilding them per call.

    python bench/sharded.py            # defaults fit the CPU simulation (2 simulated devices)
    python bench/sharded.py --quick    # a short smoke run

A Llama-architecture model built from a config with seeded weights (no download) is
sharded at TP=2 with `gpufn.parallel.tensor_parallel`. Rows:

1. a warm call of a resident sharded model (`@gpufn.model(count=2)`) vs today's pattern,
   a `@gpu(count=2)` function that builds and shards the model on every call
   (examples/tensor_parallel_generate.py), same model and prompt, alternating, one run;
2. restoring the offloaded model (host -> device on both ranks in parallel) vs running
   its loader again: the worker-measured seconds of each (the model book's means);
3. two sharded models that do not fit on the gang together, under a seeded 70/30
   alternating trace, with the pool (host offload) vs reloading on every switch
   (`GPUFN_EVICTION_POLICY=cost:no-host`): loader runs, restores and OOMs;
4. first streamed token vs the full generation: needs `f.remote_gen` (streaming); without
   it a note is printed and the row skipped.

Every call's tokens are checked against the same model greedy in this process.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import connect_ready

MiB = 2**20


def build(cfg: dict[str, int], seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                       intermediate_size=cfg["inter"], num_hidden_layers=cfg["layers"],
                       num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                       max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, initializer_range=0.2)
    return LlamaForCausalLM(conf).eval()


def greedy(model: Any, prompt: list[int], new_tokens: int, device: Any = "cpu") -> list[int]:
    import torch

    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0].tolist()]


def shard_bytes(cfg: dict[str, int]) -> int:
    """Bytes of one TP=2 rank's shard (fp32): embeddings, LM head and norms stay whole."""
    h, v, i, n = cfg["hidden"], cfg["vocab"], cfg["inter"], cfg["layers"]
    kv = h * cfg["kv_heads"] // cfg["heads"]
    replicated = 2 * v * h + (2 * n + 1) * h
    split = n * (2 * h * h + 2 * h * kv + 3 * h * i)
    return 4 * (replicated + split // 2)


def make_functions(cfg: dict[str, int], memory: int) -> dict[str, Any]:
    """The models and functions, as closures (cloudpickle ships them by value)."""
    import gpufn
    from gpufn.parallel import tensor_parallel

    def sharded_loader(seed: int) -> Any:
        def load() -> Any:
            return tensor_parallel(build(cfg, seed).to(gpufn.context().device))
        load.__name__ = f"llama_seed{seed}"
        return load

    model_a = gpufn.model(memory=memory, count=2, name="llama_a")(sharded_loader(0))
    model_b = gpufn.model(memory=memory, count=2, name="llama_b")(sharded_loader(1))

    @gpufn.gpu(count=2, models=[model_a], timeout=600)
    def gen_a(prompt: list[int], n: int) -> list[int]:
        return greedy(model_a.get(), prompt, n, gpufn.context().device)

    @gpufn.gpu(count=2, models=[model_b], timeout=600)
    def gen_b(prompt: list[int], n: int) -> list[int]:
        return greedy(model_b.get(), prompt, n, gpufn.context().device)

    @gpufn.gpu(count=2, timeout=600)
    def rebuild(prompt: list[int], n: int) -> list[int]:
        model = tensor_parallel(build(cfg, 0).to(gpufn.context().device))
        return greedy(model, prompt, n, gpufn.context().device)

    return {"gen_a": gen_a, "gen_b": gen_b, "rebuild": rebuild}


def connect() -> Any:
    return connect_ready(180)


def record(client: Any, name: str) -> dict[str, Any]:
    return next(m for m in client.status()["models"] if m["name"] == name)


def timed(fn: Any, *args: Any) -> tuple[float, Any, Any]:
    t = time.perf_counter()
    call = fn.spawn(*args)
    value = call.get(timeout=600)
    return time.perf_counter() - t, value, call.result_meta()


def trace_run(fns: dict[str, Any], trace: list[str], prompt: list[int], n: int,
              expect: dict[str, list[int]]) -> dict[str, Any]:
    import gpufn

    cold: dict[str, int] = {}
    ooms = wrong = 0
    t0 = time.perf_counter()
    for which in trace:
        fn = fns["gen_a" if which == "a" else "gen_b"]
        try:
            _, value, meta = timed(fn, prompt, n)
        except gpufn.OutOfMemory:
            ooms += 1
            continue
        wrong += value != expect[which]
        kind = meta.get("cold_start") or "warm"
        cold[kind] = cold.get(kind, 0) + 1
    return {"cold": cold, "ooms": ooms, "wrong": wrong, "seconds": time.perf_counter() - t0}


def run_trace_child(a: argparse.Namespace, policy: str) -> dict[str, Any]:
    """Row 3 in a fresh cluster (its own eviction policy): run this script as a child."""
    env = {**os.environ, "GPUFN_EVICTION_POLICY": policy}
    args = [sys.executable, __file__, "--trace-child", "--trace", str(a.trace),
            "--new-tokens", str(a.new_tokens), *size_args(a)]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    import json

    return dict(json.loads(out.strip().splitlines()[-1]))


def size_args(a: argparse.Namespace) -> list[str]:
    return ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
            "--kv-heads", str(a.kv_heads), "--vocab", str(a.vocab), "--inter", str(a.inter)]


def make_trace(n: int, seed: int = 7) -> list[str]:
    """70% of the calls to model a, 30% to b, in a seeded random order."""
    b = round(0.3 * n)
    trace = ["a"] * (n - b) + ["b"] * b
    random.Random(seed).shuffle(trace)
    return trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a short smoke run (smaller model)")
    ap.add_argument("--trace-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.layers, a.hidden, a.heads, a.kv_heads, a.inter = 4, 512, 8, 4, 1376
        a.repeats, a.trace = 3, 10
    cfg = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
           "vocab": a.vocab, "inter": a.inter}
    shard = shard_bytes(cfg)
    # Room for one model's shard (plus slack for measurement), not two: the pool must swap.
    os.environ.setdefault("GPUFN_CPU_DEVICES", "2")
    os.environ.setdefault("GPUFN_DEVICE_MEMORY", str(int(shard * 1.6)))
    os.environ.setdefault("GPUFN_PROGRESS", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prompt = [3, 14, 15, 92, 65, 35]
    fns = make_functions(cfg, int(shard * 1.05))
    expect = {"a": greedy(build(cfg, 0), prompt, a.new_tokens),
              "b": greedy(build(cfg, 1), prompt, a.new_tokens)}
    if a.trace_child:
        import json

        connect()
        fns["gen_a"].remote(prompt, a.new_tokens)  # the trace starts with a resident
        print(json.dumps(trace_run(fns, make_trace(a.trace), prompt, a.new_tokens, expect)))
        return

    client = connect()
    print(f"model: Llama {cfg}, TP=2 shard ~{shard / MiB:.0f} MiB per rank, devices of "
          f"{int(os.environ['GPUFN_DEVICE_MEMORY']) / MiB:.0f} MiB (one model fits, not two)",
          file=sys.stderr)
    # 1. warm resident vs rebuild per call
    first, value, meta = timed(fns["gen_a"], prompt, a.new_tokens)
    assert value == expect["a"] and meta["cold_start"] == "loaded", (value, meta)
    warm: list[float] = []
    rebuilt: list[float] = []
    for r in range(a.repeats):
        pair = [("warm", fns["gen_a"]), ("rebuild", fns["rebuild"])]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            dt, value, meta = timed(fn, prompt, a.new_tokens)
            assert value == expect["a"], (name, value)
            if name == "warm":
                assert not meta["cold_start"], meta
            (warm if name == "warm" else rebuilt).append(dt)
        print(f"round {r + 1}/{a.repeats} done", file=sys.stderr)
    # 2. restore vs loader: b displaces a (whole), then a comes back from host
    restore_calls: list[float] = []
    for _ in range(max(2, a.repeats // 2)):
        dt, value, _ = timed(fns["gen_b"], prompt, a.new_tokens)
        assert value == expect["b"]
        dt, value, meta = timed(fns["gen_a"], prompt, a.new_tokens)
        assert value == expect["a"] and meta["cold_start"] == "restored", meta
        restore_calls.append(dt)
    rec_a, rec_b = record(client, "llama_a"), record(client, "llama_b")
    assert rec_a["loads"] == 1 and rec_b["loads"] == 1, (rec_a, rec_b)
    load_s = rec_b["mean_load_s"]  # b loads after the workers imported transformers (a did that)
    restore_s = rec_a["mean_restore_s"]
    from gpufn.client import default as gclient

    gclient._shutdown_default()
    # 3. the 70/30 trace, pool vs reload on every switch (fresh clusters)
    pool = run_trace_child(a, "cost")
    reload = run_trace_child(a, "cost:no-host")
    trace = make_trace(a.trace)
    switches = sum(1 for x, y in zip(["a", *trace], trace, strict=False) if x != y)
    # 4. streaming
    stream_note = ("skipped: streaming (f.remote_gen) is not in this build"
                   if not hasattr(fns["gen_a"], "remote_gen") else "")

    from rich.console import Console
    from rich.table import Table

    med_w, med_r = statistics.median(warm), statistics.median(rebuilt)
    tab = Table(title=f"sharded Llama at TP=2 ({a.repeats} alternating runs, medians; "
                      f"{a.new_tokens} new tokens; {os.cpu_count()} cores, gloo on simulated devices)")
    for col in ("measure", "this", "against", "ratio", "target"):
        tab.add_column(col, justify="left" if col == "measure" else "right")
    tab.add_row("warm resident TP=2 call vs rebuild per call", f"{med_w * 1e3:,.0f} ms",
                f"{med_r * 1e3:,.0f} ms", f"{med_r / med_w:,.1f}x", ">= 20x")
    tab.add_row("restore offloaded shards vs loader again (worker-measured)",
                f"{restore_s * 1e3:,.0f} ms", f"{load_s * 1e3:,.0f} ms",
                f"{load_s / restore_s:,.1f}x", ">= 5x")
    tab.add_row("  (whole call: restore + generate vs first call: load + generate)",
                f"{statistics.median(restore_calls) * 1e3:,.0f} ms", f"{first * 1e3:,.0f} ms",
                f"{first / statistics.median(restore_calls):,.1f}x", "")
    tab.add_row(f"70/30 trace of {a.trace} calls ({switches} switches): loader runs",
                str(pool["cold"].get("loaded", 0) + 1), str(reload["cold"].get("loaded", 0) + 1),
                "", "fewer")
    tab.add_row("  restores / warm / OOMs / wrong tokens",
                f"{pool['cold'].get('restored', 0)} / {pool['cold'].get('warm', 0)} / "
                f"{pool['ooms']} / {pool['wrong']}",
                f"{reload['cold'].get('restored', 0)} / {reload['cold'].get('warm', 0)} / "
                f"{reload['ooms']} / {reload['wrong']}", "", "0 OOMs")
    tab.add_row("  trace wall time", f"{pool['seconds']:,.1f} s", f"{reload['seconds']:,.1f} s",
                f"{reload['seconds'] / pool['seconds']:,.1f}x", "")
    tab.add_row("first streamed token vs full generation", "-", "-", "", stream_note or "earlier")
    Console(width=None if sys.stdout.isatty() else 140).print(tab)
    print("loader runs count the first load before the trace; 'against' for the trace is "
          "GPUFN_EVICTION_POLICY=cost:no-host (an evicted model reloads on its next call)")
    if stream_note:
        print(f"note: first streamed token row {stream_note}")


if __name__ == "__main__":
    main()
