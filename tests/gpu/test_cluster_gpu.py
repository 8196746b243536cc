"""The call path on a real GPU: NVML probe, a worker pinned to its device, the model pool
on CUDA through the embedded cluster. Skipped without CUDA; run by scripts/gpu_check.sh."""

from __future__ import annotations

import os
import time

import pytest
import torch

import gpufn

from .figures import figure, reports

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(240),
]


@reports(("NVML devices", "as many as torch sees; an H200: 143771 MiB (nvidia-smi), 141 GB HBM3e"),
         ("NVML topology", "one GPU: no NVLink peers, no PCIe levels to another GPU"))
def test_nvml_probe_reports_real_devices() -> None:
    from gpufn.memory_pool.probe import nvml_devices

    devs = nvml_devices("here")
    figure("NVML devices", f"{len(devs)} (torch sees {torch.cuda.device_count()}): " + "; ".join(
        f"{d.key} {d.name} {d.memory_total / 2**20:.0f} MiB {d.uuid} pci {d.pci_bus_id}"
        for d in devs))
    figure("NVML topology", "; ".join(
        f"{d.key} numa={d.numa_node} nvlink={list(d.nvlink_peers)} levels={d.pcie_levels}"
        for d in devs))
    assert len(devs) == torch.cuda.device_count()
    for d in devs:
        assert d.kind == "cuda" and d.uuid.startswith("GPU-") and d.memory_total > 2**30
        assert d.pci_bus_id


@gpufn.model(memory="512MiB")
def big_linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8192, 8192, bias=False)  # 256 MiB fp32


@gpufn.gpu(models=[big_linear], memory="1GiB")
def matvec() -> dict[str, object]:
    m = big_linear.get()
    x = torch.ones(1, 8192, device=gpufn.context().device)
    with torch.no_grad():
        y = m(x)
    return {"device": str(y.device), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "name": torch.cuda.get_device_name(0), "sum": float(y.sum())}


@reports(("cold call on the GPU (embedded cluster)",
          "seconds: a worker's torch import, CUDA context and a 256 MiB model load"),
         ("warm call on the GPU", "~1 ms: a no-op .remote() p50 is 0.84-0.95 ms on CPU devices "
          "(docs/performance.md), plus one 8192x8192 matvec"),
         ("model bytes measured on the GPU", "256 MiB of fp32 weights (8192 x 8192 x 4 B)"))
def test_embedded_cluster_runs_on_the_gpu_with_the_model_pool() -> None:
    c = gpufn.connect()
    t0 = time.perf_counter()
    first = matvec.spawn()
    out = first.get(timeout=240)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = matvec.remote()
    warm = time.perf_counter() - t0
    figure("cold call on the GPU (embedded cluster)",
           f"{cold:.2f} s, cold start {first.result_meta()['cold_start']} on {out['name']}")
    figure("warm call on the GPU", f"{warm * 1000:.1f} ms")
    assert out["device"] == "cuda:0" and str(out["visible"]).startswith("GPU-")
    assert again["sum"] == out["sum"]
    assert first.result_meta()["cold_start"] == "loaded"
    dev = c.status()["devices"][0]
    model = next(m for m in dev["models"] if m["name"] == "big_linear")
    figure("model bytes measured on the GPU",
           f"{model['nbytes'] / 2**20:.1f} MiB (measured {model['measured']})")
    assert model["measured"] and 256 * 2**20 <= model["nbytes"] < 300 * 2**20


@reports(("gang of 2 all-reduce (NCCL, 2 GPUs)", "3.0 (ranks 1 + 2)"))
def test_gang_of_two_needs_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("multi-rank NCCL needs 2+ GPUs (two ranks on one device is an NCCL error); "
                    "this machine has 1")

    @gpufn.gpu(count=2, timeout=120)
    def allreduce() -> float:
        import torch.distributed as dist

        t = torch.ones(1, device=gpufn.context().device) * (gpufn.context().rank + 1)
        dist.all_reduce(t)
        return float(t.item())

    value = allreduce.remote()
    figure("gang of 2 all-reduce (NCCL, 2 GPUs)", value)
    assert value == 3.0
