"""Sharded models through real processes: a TP=2 model loaded once inside the gang's
group and kept warm, equal to a single process, offloaded and restored as a whole, a
loader failing on one rank, a rank that dies."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

import gpufn
from gpufn.parallel import tensor_parallel
from gpufn.wire.units import parse_memory

from ..conftest import cluster_with
from ._sharded_models import gpt2, greedy, llama

pytestmark = pytest.mark.timeout(300)
MiB = 2**20
PROMPTS = [[1, 5, 9, 42], [7, 3], [200, 17, 88, 5, 1]]
NEW = 6


@gpufn.model(memory="4MiB", count=2)
def llama_tp() -> torch.nn.Module:
    return tensor_parallel(llama().to(gpufn.context().device))


@gpufn.model(memory="4MiB", count=2)
def gpt2_tp() -> torch.nn.Module:
    return tensor_parallel(gpt2().to(gpufn.context().device))


@gpufn.model(memory="47.5MiB", count=2)
def ballast() -> torch.Tensor:  # leaves less than a llama shard (~0.8 MiB) free
    return torch.full((95 * MiB // 8,), float(gpufn.context().rank))


@gpufn.model(memory="1MiB", count=2)
def half_broken() -> torch.Tensor:
    if gpufn.context().rank == 1:
        raise RuntimeError("rank 1 found no checkpoint slice")
    return torch.zeros(1024)


@gpufn.gpu(count=2, models=[llama_tp], timeout=240)
def gen_llama(prompt: list[int], n: int = NEW) -> list[int]:
    return greedy(llama_tp.get(), prompt, n, gpufn.context().device)


@gpufn.gpu(count=2, models=[gpt2_tp], timeout=240)
def gen_gpt2(prompt: list[int], n: int = NEW) -> list[int]:
    return greedy(gpt2_tp.get(), prompt, n, gpufn.context().device)


@gpufn.gpu(count=2, models=[ballast], timeout=240, gather=True)
def use_ballast() -> float:
    return float(ballast.get()[0])


@gpufn.gpu(count=2, models=[half_broken], timeout=240)
def use_half_broken() -> None:
    half_broken.get()


@gpufn.gpu(count=2, models=[llama_tp], timeout=240)
def gen_or_die(prompt: list[int], die: bool) -> list[int]:
    if die and gpufn.context().rank == 1:
        os._exit(17)
    return greedy(llama_tp.get(), prompt, NEW, gpufn.context().device)


@pytest.fixture(scope="module")
def gang() -> Iterator[gpufn.Client]:
    """Two simulated devices of 48 MiB: both small models, or the ballast, not all."""
    assert parse_memory("47.5MiB", "memory") == 95 * MiB // 2
    with cluster_with(GPUFN_CPU_DEVICES=2, GPUFN_DEVICE_MEMORY="48MiB") as c:
        yield c


def _record(c: gpufn.Client, name: str) -> dict[str, object]:
    return next(m for m in c.status()["models"] if m["name"] == name)


def _where(c: gpufn.Client, name: str) -> dict[str, str]:
    """Device -> residency of the model's shard there (absent ones left out)."""
    return {d["key"]: m["state"] for d in c.status()["devices"] for m in d["models"]
            if m["name"] == name}


def _wait_for(c: gpufn.Client, cond: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {c.status()['devices']}")
        time.sleep(0.05)


def test_resident_sharded_models_give_single_process_tokens(gang: gpufn.Client) -> None:
    single_llama, single_gpt2 = llama(), gpt2()
    for fn, ref, name in ((gen_llama, single_llama, "llama_tp"), (gen_gpt2, single_gpt2, "gpt2_tp")):
        metas = []
        for prompt in PROMPTS:
            call = fn.spawn(prompt)
            assert call.get(timeout=240) == greedy(ref, prompt, NEW)
            metas.append(call.result_meta()["cold_start"])
        assert metas == ["loaded", "", ""]  # loaded once, then warm
        rec = _record(gang, name)
        assert rec["loads"] == 1 and rec["count"] == 2 and len(rec["gang"]) == 2
        shards = {d["key"]: m for d in gang.status()["devices"] for m in d["models"]
                  if m["name"] == name}
        assert set(shards) == set(rec["gang"])
        # each ledger holds that rank's measured bytes: a shard, not the whole model
        from gpufn.memory_pool.allocator import measure_nbytes
        whole = measure_nbytes(ref)
        assert all(m["measured"] and 0 < m["nbytes"] < whole for m in shards.values())


def test_offload_and_restore_move_every_shard_and_keep_the_tokens(gang: gpufn.Client) -> None:
    ref = llama()
    assert gen_llama.remote(PROMPTS[0]) == greedy(ref, PROMPTS[0], NEW)
    assert use_ballast.remote() == [0.0, 1.0]  # llama must leave, whole
    states = _where(gang, "llama_tp")
    assert set(states.values()) == {"offloaded"} and len(states) == 2, states
    call = gen_llama.spawn(PROMPTS[1])
    assert call.get(timeout=240) == greedy(ref, PROMPTS[1], NEW)
    assert call.result_meta()["cold_start"] == "restored"
    assert set(_where(gang, "llama_tp").values()) == {"resident"}
    ballast_states = set(_where(gang, "ballast").values())
    assert len(ballast_states) <= 1  # never half a model: both shards share one state
    rec = _record(gang, "llama_tp")
    assert rec["restores"] >= 1 and rec["loads"] == 1
    for d in gang.status()["devices"]:
        assert d["used"] <= 48 * MiB


def test_a_loader_failing_on_one_rank_fails_the_call_and_frees_every_shard(gang: gpufn.Client) -> None:
    with pytest.raises(gpufn.ModelLoadError, match="rank 1 found no checkpoint slice"):
        use_half_broken.remote()
    # rank 0's loader succeeded; its partial shard must not stay
    _wait_for(gang, lambda: not _where(gang, "half_broken"), "the partial shard to go")
    with pytest.raises(gpufn.ModelLoadError):  # tried afresh, fails the same way
        use_half_broken.remote()


def test_a_dead_rank_invalidates_the_model_and_the_next_call_reloads(gang: gpufn.Client) -> None:
    ref = llama()
    assert gen_or_die.remote(PROMPTS[0], False) == greedy(ref, PROMPTS[0], NEW)
    loads = int(_record(gang, "llama_tp")["loads"])  # type: ignore[call-overload]
    with pytest.raises(gpufn.WorkerLost):
        gen_or_die.remote(PROMPTS[0], True)
    # the surviving rank's shard belonged to the dead group: dropped, never served
    _wait_for(gang, lambda: not _where(gang, "llama_tp"), "the surviving shard to go")
    from ..conftest import wait_ready
    wait_ready(gang, 2)
    call = gen_or_die.spawn(PROMPTS[2], False)
    assert call.get(timeout=240) == greedy(ref, PROMPTS[2], NEW)
    assert call.result_meta()["cold_start"] == "loaded"
    assert _record(gang, "llama_tp")["loads"] == loads + 1


@pytest.mark.slow
def test_tp4_sharded_models_match_a_single_process() -> None:
    with cluster_with(GPUFN_CPU_DEVICES=4, GPUFN_DEVICE_MEMORY="64MiB"):
        l4 = gen_llama.with_options(count=4, models=[llama_tp4])
        g4 = gen_gpt2.with_options(count=4, models=[gpt2_tp4])
        for fn, ref in ((l4, llama()), (g4, gpt2())):
            for prompt in PROMPTS:
                assert fn.remote(prompt) == greedy(ref, prompt, NEW)


@gpufn.model(name="llama_tp", memory="4MiB", count=4)
def llama_tp4() -> torch.nn.Module:
    return tensor_parallel(llama().to(gpufn.context().device))


@gpufn.model(name="gpt2_tp", memory="4MiB", count=4)
def gpt2_tp4() -> torch.nn.Module:
    return tensor_parallel(gpt2().to(gpufn.context().device))
