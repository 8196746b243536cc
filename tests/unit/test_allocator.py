"""The allocator boundary on CPU: byte measurement, an arena of real nn.Modules moved
between "device" and host in place, simulated capacity, and out-of-memory mapping."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gpufn.exceptions import OutOfMemory
from gpufn.memory_pool.allocator import (
    ModelArena,
    find_tensors,
    is_out_of_memory,
    measure_nbytes,
    move_tensors,
    out_of_memory,
    run_guarded,
)

CPU = torch.device("cpu")


def mlp(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width), nn.ReLU(), nn.Linear(width, 4))
    m.register_buffer("scale", torch.full((4,), 2.0))
    return m.eval()


def param_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.cache = {"rope": [torch.ones(3, 2)]}  # a tensor attribute, not a buffer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)) + self.cache["rope"][0].sum()


# ---------------------------------------------------------------------------- measuring

def test_measure_module_params_and_buffers() -> None:
    m = mlp()
    assert measure_nbytes(m) == param_bytes(m) > 0


def test_measure_dedupes_tied_weights_views_and_shared_storage() -> None:
    lm = TiedLM()
    expected = 10 * 6 * 4 + 3 * 2 * 4
    assert measure_nbytes(lm) == expected
    base = torch.zeros(100, dtype=torch.uint8)
    assert measure_nbytes([base, base[10:20], base.view(25, 4), {"again": base}]) == 100


def test_measure_walks_containers_objects_and_cycles() -> None:
    class Holder:
        def __init__(self) -> None:
            self.model = mlp()
            self.extra = (torch.zeros(10),)
            self.me = self  # cycle
            self.name = "x" * 1000

    h = Holder()
    payload = {"a": [h, {"b": torch.zeros(5, dtype=torch.float64)}], "m": torch.empty(0)}
    assert measure_nbytes(payload) == param_bytes(h.model) + 40 + 40
    assert measure_nbytes(torch.empty(1000, device="meta")) == 0
    assert measure_nbytes(None) == 0 and measure_nbytes("text") == 0


def test_recursion_is_bounded() -> None:
    deep: Any = torch.zeros(4)
    for _ in range(20):
        deep = [deep]
    assert find_tensors(deep, max_depth=30) and find_tensors(deep, max_depth=5) == []
    # submodules cost no depth, so a deep model is still fully found
    m: nn.Module = nn.Linear(2, 2)
    for _ in range(20):
        m = nn.Sequential(m)
    assert measure_nbytes(m) == (4 + 2) * 4


def test_move_keeps_identity_and_sharing() -> None:
    lm = TiedLM()
    w = lm.embed.weight
    before = w.untyped_storage().data_ptr()
    out = lm(torch.tensor([1, 2, 3]))
    copied = move_tensors(lm, CPU, force=True)
    assert copied == measure_nbytes(lm)
    assert lm.embed.weight is w and isinstance(w, nn.Parameter) and w.requires_grad
    assert w.untyped_storage().data_ptr() != before  # really copied
    assert lm.head.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    assert torch.equal(lm(torch.tensor([1, 2, 3])), out)
    assert move_tensors(lm, CPU) == 0  # already there


def test_move_inference_tensors() -> None:
    with torch.inference_mode():
        m = mlp()
        t = torch.arange(4.0)
    move_tensors([m, t], CPU, force=True)
    assert torch.equal(t, torch.arange(4.0)) and t.is_inference()


# ---------------------------------------------------------------------------- arena

def test_arena_load_offload_restore_evict() -> None:
    arena = ModelArena("cpu", capacity=10_000)
    model = mlp()
    x = torch.randn(3, 8)
    y = model(x)
    rep = arena.load("mlp", lambda: model)
    assert rep.name == "mlp" and rep.nbytes == rep.allocated == param_bytes(model)
    assert rep.seconds >= 0
    assert arena.get("mlp") is model and arena.resident() == {"mlp": rep.nbytes}
    assert (arena.used, arena.free) == (rep.nbytes, 10_000 - rep.nbytes)
    weight = model[0].weight
    ptr = weight.untyped_storage().data_ptr()

    off = arena.offload("mlp")
    assert off.nbytes == rep.nbytes and off.bytes_per_second > 0
    assert arena.resident() == {} and arena.offloaded() == {"mlp": rep.nbytes}
    assert arena.used == 0 and weight.untyped_storage().data_ptr() != ptr
    with pytest.raises(RuntimeError, match="offloaded"):
        arena.get("mlp")
    with pytest.raises(RuntimeError, match="already offloaded"):
        arena.offload("mlp")

    back = arena.restore("mlp")
    assert back.nbytes == rep.nbytes
    got = arena.get("mlp")
    assert got is model and got[0].weight is weight
    assert torch.equal(got(x), y)

    assert arena.evict("mlp") == rep.nbytes
    assert arena.resident() == {} and arena.offloaded() == {}
    with pytest.raises(KeyError):
        arena.get("mlp")
    arena.load("mlp", mlp)  # the name is free again


def test_arena_refuses_double_load_and_keeps_nothing_from_a_failed_loader() -> None:
    arena = ModelArena("cpu")
    arena.load("a", mlp)
    with pytest.raises(ValueError, match="already loaded"):
        arena.load("a", mlp)

    def broken() -> nn.Module:
        raise ValueError("no weights")

    with pytest.raises(ValueError, match="no weights"):
        arena.load("b", broken)
    assert list(arena.resident()) == ["a"]
    arena.load("b", mlp)  # not stuck half-loaded


def test_capacity_oom_leaves_other_models_intact() -> None:
    small = mlp(1)
    arena = ModelArena("cpu", capacity=param_bytes(small) + 500)
    arena.load("small", lambda: small)
    x = torch.randn(2, 8)
    y = small(x)
    with pytest.raises(OutOfMemory) as info:
        arena.load("big", lambda: mlp(2, width=256))
    msg = str(info.value)
    assert "'big'" in msg and f"{format(param_bytes(mlp(2, width=256)) / 1024, '.1f')} KiB" in msg
    assert "500 B" in msg  # what was free
    assert list(arena.resident()) == ["small"] and arena.offloaded() == {}
    assert torch.equal(arena.get("small")(x), y)
    arena.offload("small")
    arena.load("other", lambda: mlp(3))  # room once small is on host
    with pytest.raises(OutOfMemory, match="restoring model 'small'"):
        arena.restore("small")
    assert arena.offloaded() == {"small": param_bytes(small)}  # still safely on host
    arena.evict("other")
    arena.restore("small")
    assert torch.equal(arena.get("small")(x), y)


def test_dict_of_tensors_model_keeps_tensor_identity() -> None:
    table = {"emb": torch.randn(5, 3), "bias": torch.randn(3)}
    emb = table["emb"]
    snapshot = emb.clone()
    arena = ModelArena("cpu")
    assert arena.load("t", lambda: table).nbytes == (15 + 3) * 4
    arena.offload("t")
    arena.restore("t")
    assert arena.get("t")["emb"] is emb and torch.equal(emb, snapshot)


# ---------------------------------------------------------------------------- out of memory

def test_real_cpu_allocation_failure_becomes_out_of_memory() -> None:
    with pytest.raises(OutOfMemory) as info:
        run_guarded("cpu", torch.empty, 2**62, dtype=torch.uint8)
    msg = str(info.value)
    assert "empty() ran out of memory on cpu" in msg
    assert "asked for 4194304.0 TiB" in msg and "free" in msg


def test_arena_run_oom_keeps_models_serving() -> None:
    arena = ModelArena("cpu", capacity=10**6)
    model = mlp()
    arena.load("m", lambda: model)
    x = torch.randn(1, 8)
    y = model(x)

    def greedy(n: int) -> torch.Tensor:
        return arena.get("m")(x) + torch.empty(n, dtype=torch.uint8).sum()

    with pytest.raises(OutOfMemory, match=r"greedy\(\) ran out of memory.*held by models"):
        arena.run(greedy, 2**62)
    assert torch.equal(arena.run(lambda: arena.get("m")(x)), y)


def test_other_errors_pass_through_unchanged() -> None:
    def bad() -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        run_guarded("cpu", bad)
    assert not isinstance(info.value, OutOfMemory)
    assert run_guarded("cpu", lambda a, device=None: (a, device), 1, device="x") == (1, "x")


def test_oom_classification_and_cuda_message_parsing() -> None:
    cuda_msg = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
                "capacity of 79.15 GiB of which 3.50 MiB is free.")
    exc = torch.OutOfMemoryError(cuda_msg)
    assert is_out_of_memory(exc) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("not enough memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("index out of range"))
    err = out_of_memory(exc, torch.device("cuda", 0), "f()")
    assert isinstance(err, OutOfMemory)
    assert "asked for 20.0 MiB with 3.5 MiB free" in str(err) and "cuda:0" in str(err)
    with pytest.raises(OutOfMemory, match=r"asked for 2\.0 KiB"):
        run_guarded("cpu", _raise, MemoryError("you tried to allocate 2048 bytes"))


def _raise(exc: BaseException) -> None:
    raise exc
