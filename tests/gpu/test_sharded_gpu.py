"""Sharded models on real GPUs: a tensor-parallel shard's MemPool bytes, its offload and
restore bandwidth, and NCCL collectives on the resident (and restored) shard.

One GPU: a world-size-1 NCCL gang in a fresh subprocess (as a worker would run it) loads
a DTensor shard through `ModelArena`, the path a sharded model's loader takes on each
rank. Two or more GPUs: the whole path through the embedded cluster at TP=2 (skipped on
one GPU: two NCCL ranks on one device is an error).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import gpufn

from .figures import figure, reports
from .test_groups_gpu import run_child

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
        reason="needs torch built with NCCL",
    ),
]

MiB = 2**20

SHARD_SCRIPT = r"""
import gc, json, time
import torch
import torch.distributed as dist
from gpufn.runtime import context as ctxmod
from gpufn.runtime.context import CallContext
from gpufn.memory_pool.allocator import ModelArena, find_tensors, measure_nbytes
from gpufn.parallel import tensor_parallel
from gpufn.worker.groups import GangSpec, GroupManager, host_store
from transformers import LlamaConfig, LlamaForCausalLM

out = {}
store, port = host_store()
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
mgr = GroupManager()
pg = mgr.ensure(GangSpec("shard-test", 1, 0, 1, "127.0.0.1", port, "nccl", 60.0, ("local:0",)), dev)
ctxmod._set(CallContext("inv", "f", rank=0, world_size=1, device=dev, group=pg))

def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()

def loader():
    return tensor_parallel(build().to(dev))

def alloc():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(dev)

arena = ModelArena(dev)
base = alloc()
rep = arena.load("llama", loader)
model = arena.get("llama")
out["dtensor_params"] = sum(type(p).__name__ == "DTensor" for p in model.parameters())
out["mempool_bytes"] = rep.nbytes
out["local_bytes"] = measure_nbytes(model)
out["alloc_delta"] = alloc() - base
ids = torch.tensor([[3, 14, 15, 92, 65, 35]], device=dev)
with torch.no_grad():
    before = model(ids).logits.float().cpu()
off = arena.offload("llama")
gc.collect()
out["after_offload_delta"] = alloc() - base
out["offload_bytes"] = off.nbytes
out["offload_gbps"] = off.bytes_per_second / 1e9
out["on_host"] = all(t.device.type == "cpu" for t in find_tensors(model))
res = arena.restore("llama")
out["restore_gbps"] = res.bytes_per_second / 1e9
out["after_restore_delta"] = alloc() - base
with torch.no_grad():
    after = model(ids).logits.float().cpu()
out["logits_equal_after_restore"] = bool(torch.equal(before, after))
t = torch.full((4,), 2.0, device=dev)
dist.all_reduce(t)  # NCCL on the gang that holds the restored shard
torch.cuda.synchronize()
out["all_reduce"] = t.tolist()
arena.evict("llama")
out["after_evict_delta"] = alloc() - base
mgr.leave()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(240)
@reports(("DTensor shard MemPool bytes (world size 1)",
          "its local tensors' bytes, within MemPool rounding (<= 1.1x + 64 MiB)"),
         ("DTensor shard offload / restore", "PCIe Gen5 x16: 52-56 GB/s each way; device memory "
          "back after offload and evict; logits equal after restore"))
def test_dtensor_shard_mempool_bytes_offload_restore_bandwidth_and_nccl() -> None:
    pytest.importorskip("transformers", reason="the Llama shard is built with transformers")
    r = run_child(SHARD_SCRIPT)
    figure("DTensor shard MemPool bytes (world size 1)",
           f"MemPool {r['mempool_bytes'] / MiB:.1f} MiB, local tensors "
           f"{r['local_bytes'] / MiB:.1f} MiB, allocator delta {r['alloc_delta'] / MiB:.1f} MiB, "
           f"{r['dtensor_params']} DTensor parameters")
    figure("DTensor shard offload / restore",
           f"offload {r['offload_gbps']:.1f} GB/s, restore {r['restore_gbps']:.1f} GB/s; left "
           f"after offload {r['after_offload_delta'] / MiB:.1f} MiB, after evict "
           f"{r['after_evict_delta'] / MiB:.1f} MiB; logits equal "
           f"{r['logits_equal_after_restore']}; all_reduce {r['all_reduce'][0]}")
    assert r["dtensor_params"] > 0  # the shard path, not a plain module
    # the ledger's bytes are the shard's own (local tensors), within MemPool rounding
    assert r["local_bytes"] <= r["mempool_bytes"] <= r["local_bytes"] * 1.1 + 64 * MiB
    assert r["offload_bytes"] >= r["local_bytes"] and r["on_host"]
    assert r["after_offload_delta"] < 8 * MiB  # the device memory really came back
    assert r["logits_equal_after_restore"] and r["all_reduce"] == [2.0] * 4
    assert r["after_evict_delta"] < 8 * MiB
    assert r["restore_gbps"] > 1.0  # pinned host -> device copies, far above a reload


@pytest.mark.timeout(300)
@reports(("TP=2 gang on 2 GPUs: cold / warm call",
          "the world-size-1 figures per rank; greedy tokens equal to one device's"),
         ("TP=2 shard restore per rank", "PCIe Gen5 x16: 52-56 GB/s"))
def test_sharded_model_on_a_gpu_gang_per_rank_bytes_bandwidth_and_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("TP=2 needs 2+ GPUs (two NCCL ranks on one device is an error); this "
                    "machine has 1: the world-size-1 shard test covers one device")
    pytest.importorskip("transformers", reason="the Llama shards are built with transformers")
    from gpufn.memory_pool.allocator import measure_nbytes
    from gpufn.parallel import tensor_parallel

    def build() -> torch.nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816,
                          num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
        return LlamaForCausalLM(cfg).eval()

    @gpufn.model(memory="256MiB", count=2)
    def llama_gpu() -> torch.nn.Module:
        return tensor_parallel(build().to(gpufn.context().device))

    @gpufn.gpu(count=2, models=[llama_gpu], timeout=300, gather=True)
    def probe(prompt: list[int]) -> dict[str, object]:
        m = llama_gpu.get()
        ids = torch.tensor([prompt], device=gpufn.context().device)
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        return {"tokens": out[0].tolist(), "local": measure_nbytes(m), "rank": gpufn.context().rank}

    c = gpufn.connect()
    prompt = [3, 14, 15, 92, 65, 35]
    t0 = time.perf_counter()
    first = probe.remote(prompt)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = probe.remote(prompt)
    warm = time.perf_counter() - t0
    figure("TP=2 gang on 2 GPUs: cold / warm call", f"{cold:.2f} s / {warm * 1e3:.1f} ms, "
           f"visible {os.environ.get('CUDA_VISIBLE_DEVICES')}")
    ref = build().to("cuda").generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8,
                                      do_sample=False, pad_token_id=0)[0].tolist()
    assert [r["tokens"] for r in first] == [ref, ref] and again == first  # NCCL, resident
    shards = {d["key"]: m for d in c.status()["devices"] for m in d["models"]
              if m["name"] == "llama_gpu"}
    assert len(shards) == 2
    for r, (key, m) in zip(first, sorted(shards.items(), key=lambda kv: kv[1]["shards"].index(kv[0])),
                           strict=True):
        assert r["local"] <= m["nbytes"] <= r["local"] * 1.1 + 64 * MiB, (key, m, r["local"])
    # force it to host (a ballast that leaves less than one shard free), then back
    cap = min(d["capacity"] - d["used"] for d in c.status()["devices"] if d["key"] in shards)
    size = cap - min(m["nbytes"] for m in shards.values()) // 2

    @gpufn.model(memory=size, count=2)
    def ballast() -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=gpufn.context().device)

    @gpufn.gpu(count=2, models=[ballast], timeout=300)
    def hold() -> int:
        return int(ballast.get().numel())

    hold.remote()
    states = {d["key"]: m["state"] for d in c.status()["devices"] for m in d["models"]
              if m["name"] == "llama_gpu"}
    assert set(states.values()) == {"offloaded"}, states
    call = probe.spawn(prompt)
    assert [r["tokens"] for r in call.get(timeout=300)] == [ref, ref]
    assert call.result_meta()["cold_start"] == "restored"
    restored = {d["key"]: m for d in c.status()["devices"] for m in d["models"]
                if m["name"] == "llama_gpu"}
    figure("TP=2 shard restore per rank", "; ".join(
        f"{key}: shard {m['nbytes'] / MiB:.1f} MiB, load {m['load_s']:.2f} s, restore "
        f"{m['reload_s'] * 1e3:.1f} ms = {m['nbytes'] / m['reload_s'] / 1e9:.1f} GB/s"
        for key, m in sorted(restored.items())))
