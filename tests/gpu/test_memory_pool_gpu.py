"""The allocator boundary on a real CUDA device: per-model MemPool accounting, complete
release on offload and eviction, OOM isolation, and host-tier reload bandwidth."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from gpufn.exceptions import OutOfMemory
from gpufn.memory_pool.allocator import ModelArena, measure_nbytes

from .figures import figure, reports

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 2**20


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def mlp(width: int, layers: int, device: str | None = None) -> nn.Module:
    torch.manual_seed(width + layers)
    return nn.Sequential(*[nn.Linear(width, width, device=device) for _ in range(layers)]).eval()


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(dev())


def reserved() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved(dev())


@pytest.fixture(autouse=True)
def clean_device() -> Iterator[None]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


@reports(("MemPool bytes vs allocator delta",
          "equal to the byte: a model's pool counts what torch.cuda.memory_allocated gained"),
         ("MemPool reserved vs tensor bytes", "tensors <= allocated <= tensors + 512 B each "
          "(block rounding) <= the pool's reserved segments"))
def test_mempool_accounting_matches_allocator_deltas() -> None:
    arena = ModelArena("cuda")
    base = allocated()
    a = arena.load("a", lambda: mlp(1024, 4))  # built on host, moved inside its pool
    after_a = allocated()
    b = arena.load("b", lambda: mlp(512, 3, device="cuda"))  # built on the device
    after_b = allocated()
    figure("MemPool bytes vs allocator delta",
           f"a (built on host): {a.allocated} B vs {after_a - base} B; "
           f"b (built on the device): {b.allocated} B vs {after_b - after_a} B")
    figure("MemPool reserved vs tensor bytes", "; ".join(
        f"{name}: tensors {measure_nbytes(arena.get(name))} B, allocated {r.allocated} B, "
        f"reserved {r.nbytes} B" for r, name in ((a, "a"), (b, "b"))))
    assert a.allocated == after_a - base
    assert b.allocated == after_b - after_a
    for rep, name in ((a, "a"), (b, "b")):
        model = arena.get(name)
        assert all(p.is_cuda for p in model.parameters())
        tensor_bytes = measure_nbytes(model)
        n_tensors = len(list(model.parameters()))
        assert tensor_bytes <= rep.allocated <= tensor_bytes + 512 * n_tensors  # block rounding
        assert rep.nbytes >= rep.allocated  # the pool's reserved segments
    assert arena.resident() == {"a": a.nbytes, "b": b.nbytes}


@reports(("model offloaded and restored", "device memory back to the byte on offload; "
          "the same tensors, same outputs after restore"),
         ("model evicted", "the pool's bytes freed; allocated and reserved back to the byte"))
def test_offload_and_evict_release_device_memory_completely() -> None:
    arena = ModelArena("cuda")
    base_alloc, base_res = allocated(), reserved()
    model = mlp(2048, 4)
    x = torch.randn(8, 2048)
    y = model(x)
    weight = model[0].weight
    rep = arena.load("m", lambda: model)
    assert reserved() > base_res

    off = arena.offload("m")
    off_delta = (allocated() - base_alloc, reserved() - base_res)
    pinned = not weight.is_cuda and weight.is_pinned()
    back = arena.restore("m")
    restored_delta = allocated() - base_alloc
    same = bool(torch.allclose(model(x.to(dev())).cpu(), y, rtol=1e-4, atol=1e-4))
    figure("model offloaded and restored",
           f"{off.nbytes / MiB:.0f} MiB to pinned host ({pinned}); after offload allocated/reserved "
           f"{off_delta[0]:+d}/{off_delta[1]:+d} B; restored {back.nbytes / MiB:.0f} MiB at "
           f"{back.bytes_per_second / 1e9:.1f} GB/s, allocated {restored_delta - rep.allocated:+d} B "
           f"vs loaded, outputs equal {same}")
    assert off.nbytes == measure_nbytes(model)
    assert off_delta == (0, 0)
    assert pinned
    assert restored_delta == rep.allocated
    assert arena.get("m") is model and model[0].weight is weight and weight.is_cuda
    assert same

    freed = arena.evict("m")
    model = weight = None  # the test's own references would keep the bytes alive
    gc.collect()
    torch.cuda.empty_cache()
    left = (allocated() - base_alloc, reserved() - base_res)
    figure("model evicted", f"{freed / MiB:.0f} MiB freed (pool {rep.nbytes / MiB:.0f} MiB); "
           f"allocated/reserved {left[0]:+d}/{left[1]:+d} B")
    assert freed == rep.nbytes
    assert left == (0, 0)


@reports(("OOM in one call, another model serving", "OutOfMemory naming hog(); the call's "
          "memory back to the byte; the other model's output identical; the device usable"))
def test_oom_in_one_invocation_leaves_other_models_serving() -> None:
    arena = ModelArena("cuda")
    arena.load("m", lambda: mlp(1024, 2))
    x = torch.randn(4, 1024, device=dev())
    y = arena.get("m")(x).clone()
    before = allocated()

    filled = [0]

    def hog() -> None:
        chunks = []
        while True:  # fill the device until it refuses
            chunks.append(torch.empty(2**30, dtype=torch.uint8, device=dev()))
            filled[0] = len(chunks)

    with pytest.raises(OutOfMemory, match=r"hog\(\) ran out of memory on cuda.*asked for") as err:
        arena.run(hog)
    leaked = allocated() - before
    same = torch.equal(arena.run(lambda: arena.get("m")(x)), y)
    torch.empty(2**30, dtype=torch.uint8, device=dev())  # and the device is usable
    figure("OOM in one call, another model serving",
           f"hog() held {filled[0]} GiB, then {type(err.value).__name__}; memory back "
           f"{leaked:+d} B; other model identical {same}; device usable after")
    assert leaked == 0  # the failed call's memory is back
    assert same


@reports(("failed load leaves nothing", "OutOfMemory naming the model; allocated and reserved "
          "back to the byte, nothing resident or offloaded"))
def test_failed_load_leaves_nothing_behind() -> None:
    arena = ModelArena("cuda")
    base_alloc, base_res = allocated(), reserved()
    free = torch.cuda.mem_get_info(dev())[0]

    def too_big() -> torch.Tensor:
        return torch.empty(free + 2**30, dtype=torch.uint8, device="cuda")

    with pytest.raises(OutOfMemory, match="loading model 'huge'"):
        arena.load("huge", too_big)
    left = (allocated() - base_alloc, reserved() - base_res)
    figure("failed load leaves nothing", f"asked {(free + 2**30) / 2**30:.1f} GiB of "
           f"{free / 2**30:.1f} free; allocated/reserved {left[0]:+d}/{left[1]:+d} B")
    assert arena.resident() == {} and arena.offloaded() == {}
    assert left == (0, 0)


@reports(("host->device restore from pinned memory", "PCIe Gen5 x16: 52-56 GB/s"),
         ("plain pinned copy_, same bytes", "PCIe Gen5 x16: 52-56 GB/s"),
         ("restore / plain pinned copy", ">= 0.8 (the test's bound)"))
def test_host_reload_bandwidth_vs_plain_pinned_copy() -> None:
    """A host-tier restore moves the bytes at >= 0.8x of one pinned `copy_` of the same
    size into preallocated device memory, measured alternately in this test."""
    arena = ModelArena("cuda")
    arena.load("m", lambda: mlp(4096, 8))  # 8 x 64 MiB
    arena.offload("m")
    arena.restore("m")  # warm-up: the first restore pays one-time costs
    best_restore = best_copy = 0.0
    nbytes = 0
    host: torch.Tensor | None = None
    target: torch.Tensor | None = None
    for _ in range(5):
        arena.offload("m")
        rep = arena.restore("m")
        best_restore = max(best_restore, rep.bytes_per_second)
        nbytes = rep.nbytes
        if host is None:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            target = torch.empty(nbytes, dtype=torch.uint8, device=dev())
            target.copy_(host, non_blocking=True)  # warm-up
        assert target is not None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best_copy = max(best_copy, nbytes / (time.perf_counter() - t0))
    ratio = best_restore / best_copy
    figure("host->device restore from pinned memory",
           f"{best_restore / 1e9:.1f} GB/s ({nbytes / MiB:.0f} MiB, best of 5)")
    figure("plain pinned copy_, same bytes", f"{best_copy / 1e9:.1f} GB/s (best of 5)")
    figure("restore / plain pinned copy", f"{ratio:.2f}")
    assert ratio >= 0.8
