"""The call path on a real GPU: NVML probe, a worker pinned to its device, the model pool
on CUDA through the embedded cluster. Skipped without CUDA; run by scripts/gpu_check.sh."""

from __future__ import annotations

import os
import time

import pytest
import torch

import gpufn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def test_nvml_probe_reports_real_devices() -> None:
    from gpufn.memory_pool.probe import nvml_devices

    devs = nvml_devices("here")
    assert len(devs) == torch.cuda.device_count()
    for d in devs:
        assert d.kind == "cuda" and d.uuid.startswith("GPU-") and d.memory_total > 2**30
        assert d.pci_bus_id
        print(f"{d.key} {d.name} {d.uuid} {d.memory_total / 2**30:.1f} GiB numa={d.numa_node} "
              f"nvlink={list(d.nvlink_peers)} levels={d.pcie_levels}")


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


def test_embedded_cluster_runs_on_the_gpu_with_the_model_pool() -> None:
    c = gpufn.connect()
    t0 = time.perf_counter()
    first = matvec.spawn()
    out = first.get(timeout=240)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = matvec.remote()
    warm = time.perf_counter() - t0
    assert out["device"] == "cuda:0" and str(out["visible"]).startswith("GPU-")
    assert again["sum"] == out["sum"]
    assert first.result_meta()["cold_start"] == "loaded"
    dev = c.status()["devices"][0]
    model = next(m for m in dev["models"] if m["name"] == "big_linear")
    assert model["measured"] and 256 * 2**20 <= model["nbytes"] < 300 * 2**20
    print(f"cold call {cold:.2f}s (model load), warm call {warm * 1000:.1f} ms on {out['name']}; "
          f"measured {model['nbytes'] / 2**20:.1f} MiB")


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

    assert allreduce.remote() == 3.0
