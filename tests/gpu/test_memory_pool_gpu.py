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


def test_mempool_accounting_matches_allocator_deltas() -> None:
    arena = ModelArena("cuda")
    base = allocated()
    a = arena.load("a", lambda: mlp(1024, 4))  # built on host, moved inside its pool
    after_a = allocated()
    b = arena.load("b", lambda: mlp(512, 3, device="cuda"))  # built on the device
    after_b = allocated()
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
    assert off.nbytes == measure_nbytes(model)
    assert (allocated(), reserved()) == (base_alloc, base_res)
    assert not weight.is_cuda and weight.is_pinned()

    arena.restore("m")
    assert allocated() == base_alloc + rep.allocated
    assert arena.get("m") is model and model[0].weight is weight and weight.is_cuda
    torch.testing.assert_close(model(x.to(dev())).cpu(), y, rtol=1e-4, atol=1e-4)

    assert arena.evict("m") == rep.nbytes
    model = weight = None  # the test's own references would keep the bytes alive
    gc.collect()
    torch.cuda.empty_cache()
    assert (allocated(), reserved()) == (base_alloc, base_res)


def test_oom_in_one_invocation_leaves_other_models_serving() -> None:
    arena = ModelArena("cuda")
    arena.load("m", lambda: mlp(1024, 2))
    x = torch.randn(4, 1024, device=dev())
    y = arena.get("m")(x).clone()
    before = allocated()

    def hog() -> None:
        chunks = []
        while True:  # fill the device until it refuses
            chunks.append(torch.empty(2**30, dtype=torch.uint8, device=dev()))

    with pytest.raises(OutOfMemory, match=r"hog\(\) ran out of memory on cuda.*asked for"):
        arena.run(hog)
    assert allocated() == before  # the failed call's memory is back
    assert torch.equal(arena.run(lambda: arena.get("m")(x)), y)
    torch.empty(2**30, dtype=torch.uint8, device=dev())  # and the device is usable


def test_failed_load_leaves_nothing_behind() -> None:
    arena = ModelArena("cuda")
    base_alloc, base_res = allocated(), reserved()
    free = torch.cuda.mem_get_info(dev())[0]

    def too_big() -> torch.Tensor:
        return torch.empty(free + 2**30, dtype=torch.uint8, device="cuda")

    with pytest.raises(OutOfMemory, match="loading model 'huge'"):
        arena.load("huge", too_big)
    assert arena.resident() == {} and arena.offloaded() == {}
    assert (allocated(), reserved()) == (base_alloc, base_res)


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
    print(f"\nhost-tier restore of {nbytes / MiB:.0f} MiB: {best_restore / 1e9:.1f} GB/s; "
          f"one pinned copy_ of the same bytes: {best_copy / 1e9:.1f} GB/s; ratio {ratio:.2f}")
    assert ratio >= 0.8
