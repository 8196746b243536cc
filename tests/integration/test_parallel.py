"""gpufn.parallel on real rank processes (spawned, gloo over a FileStore) against single-process models."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from gpufn.exceptions import GpufnError, InvalidSpec

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the worker module by name
import _parallel_worker as pw

SPAWN_DEADLINE_S = 110.0

# One spawn per world size runs every check for it (process start-up dominates on 2 cores).
WORLD_CHECKS: dict[int, list[str]] = {
    2: [
        "tp_llama", "tp_gpt2", "tp_llama_dict", "tp_gpt2_dict", "tp_t5_dict", "tp_mlp", "pp_llama", "pp_gpt2",
        "pp_mlp_split_points",
        "err_heads", "err_strategy", "err_pattern", "err_stages",
    ],
    4: ["tp_llama", "tp_gpt2", "tp_mlp", "err_kv_heads"],
}

Outcome = tuple[str, Any]


def _spawn(world: int, checks: list[str], tmp: Path) -> list[dict[str, Outcome]]:
    """Run `checks` on `world` spawned ranks; kill every rank left when it fails or overruns."""
    out = tmp / "out"
    out.mkdir()
    ctx = mp.start_processes(
        pw.run_rank, args=(world, str(tmp / "store"), str(out), checks),
        nprocs=world, join=False, start_method="spawn",
    )
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"world {world}: ranks still running after {SPAWN_DEADLINE_S:.0f}s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
        for proc in ctx.processes:
            proc.join(10)
        assert not any(proc.is_alive() for proc in ctx.processes)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], list[dict[str, Outcome]]]]:
    """ranks(world) -> each rank's outcomes, spawning that world size once per module."""
    cache: dict[int, list[dict[str, Outcome]] | BaseException] = {}

    def get(world: int) -> list[dict[str, Outcome]]:
        if world not in cache:
            try:
                cache[world] = _spawn(world, WORLD_CHECKS[world], tmp_path_factory.mktemp(f"world{world}"))
            except BaseException as exc:  # a failed spawn fails every test of that world, once
                cache[world] = exc
                raise
        result = cache[world]
        if isinstance(result, BaseException):
            pytest.fail(f"world {world} ranks failed earlier: {result!r}")
        return result

    yield get


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return pw.reference()


def _values(results: list[dict[str, Outcome]], check: str) -> list[Any]:
    """The value `check` returned on every rank; fails with the rank's traceback if it raised."""
    values = []
    for rank, outcomes in enumerate(results):
        status, value = outcomes[check]
        if status != "ok":
            pytest.fail(f"{check} raised on rank {rank}:\n{value[2]}")
        values.append(value)
    return values


def _errors(results: list[dict[str, Outcome]], check: str) -> list[tuple[str, str]]:
    """(exception type name, message) `check` raised on every rank."""
    errors = []
    for rank, outcomes in enumerate(results):
        status, value = outcomes[check]
        assert status == "raised", f"{check} did not raise on rank {rank}"
        errors.append((value[0], value[1]))
    return errors


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_tensor_parallel_logits_match_single_process(ranks, reference, world: int, model: str) -> None:
    for value in _values(ranks(world), f"tp_{model}"):
        assert value["logits"].shape == (2, 12, pw.VOCAB)
        torch.testing.assert_close(value["logits"], reference[f"{model}_logits"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_tensor_parallel_greedy_generation_matches(ranks, reference, world: int, model: str) -> None:
    expected = reference[f"{model}_tokens"]
    assert expected.shape == (2, 12 + pw.NEW_TOKENS)
    for value in _values(ranks(world), f"tp_{model}"):
        assert torch.equal(value["tokens"], expected)


# (parameter name suffix, dim split by the world size) of the layers each plan shards
SHARDED: dict[str, list[tuple[str, int]]] = {
    "llama": [("q_proj.weight", 0), ("k_proj.weight", 0), ("v_proj.weight", 0), ("o_proj.weight", 1),
              ("gate_proj.weight", 0), ("up_proj.weight", 0), ("down_proj.weight", 1)],
    # GPT-2's Conv1D layers become nn.Linear (out, in) before sharding
    "gpt2": [("attn.c_attn.weight", 0), ("attn.c_attn.bias", 0), ("attn.c_proj.weight", 1),
             ("mlp.c_fc.weight", 0), ("mlp.c_fc.bias", 0), ("mlp.c_proj.weight", 1)],
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_tensor_parallel_shards_the_weights(ranks, world: int, model: str) -> None:
    """Each rank holds 1/world of every sharded layer (not a full copy), and the sharded
    layers are most of the model's transformer-block parameters."""
    for shapes in (v["shapes"] for v in _values(ranks(world), f"tp_{model}")):
        total = local_total = 0
        for name, (local, full) in shapes.items():
            total += math.prod(full)
            local_total += math.prod(local)
            rule = next((dim for suffix, dim in SHARDED[model] if name.endswith(suffix)), None)
            if rule is None:
                continue
            expected = list(full)
            expected[rule] = full[rule] // world
            assert list(local) == expected, f"{name}: local {local}, full {full}, world {world}"
        blocks = [n for n in shapes if ".h." in n or ".layers." in n]
        sharded = [n for n in blocks if any(n.endswith(s) for s, _ in SHARDED[model])]
        share = sum(math.prod(shapes[n][1]) for n in sharded) / sum(math.prod(shapes[n][1]) for n in blocks)
        assert share > 0.9, f"only {share:.0%} of the block parameters are sharded"
        saved = sum(math.prod(shapes[n][1]) - math.prod(shapes[n][0]) for n in sharded)
        assert total - local_total == saved > 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_tensor_parallel_dict_plan_matches_single_process(ranks, reference, model: str) -> None:
    for value in _values(ranks(2), f"tp_{model}_dict"):
        torch.testing.assert_close(value, reference[f"{model}_logits"])


@pytest.mark.timeout(150)
def test_tensor_parallel_dict_plan_on_t5_matches_single_process(ranks, reference) -> None:
    """T5's attention has no head_dim and a relative position bias with one column per head:
    a user's colwise q/k/v + rowwise o plan gives each rank its heads of that bias too."""
    for value in _values(ranks(2), "tp_t5_dict"):
        torch.testing.assert_close(value, reference["t5_logits"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_auto_plan_for_sequential_mlp(ranks, reference, world: int) -> None:
    for value in _values(ranks(world), "tp_mlp"):
        torch.testing.assert_close(value, reference["mlp"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_pipeline_two_stages_match_single_process(ranks, reference, model: str) -> None:
    for value in _values(ranks(2), f"pp_{model}"):  # every rank gets the last stage's output
        assert value["full"].shape == (4, 12, pw.VOCAB)
        torch.testing.assert_close(value["full"], reference[f"{model}_pp_logits"])
        torch.testing.assert_close(value["short"], reference[f"{model}_pp_short"])


@pytest.mark.timeout(150)
def test_pipeline_split_points_on_sequential(ranks, reference) -> None:
    for value in _values(ranks(2), "pp_mlp_split_points"):
        torch.testing.assert_close(value, reference["mlp"])


@pytest.mark.timeout(150)
def test_attention_heads_not_divisible_raise_invalid_spec(ranks) -> None:
    for kind, message in _errors(ranks(2), "err_heads"):
        assert kind == "InvalidSpec"
        assert "transformer.h.0.attn.c_attn" in message
        assert "3 attention heads" in message and "world size 2" in message


@pytest.mark.timeout(150)
def test_kv_heads_not_divisible_raise_invalid_spec(ranks) -> None:
    for kind, message in _errors(ranks(4), "err_kv_heads"):
        assert kind == "InvalidSpec"
        assert "model.layers.0.self_attn.k_proj" in message
        assert "2 key/value heads" in message and "world size 4" in message


@pytest.mark.timeout(150)
def test_plan_errors_name_the_problem(ranks) -> None:
    results = ranks(2)
    for kind, message in _errors(results, "err_strategy"):
        assert kind == "InvalidSpec"
        assert "'*.o_proj'" in message and "'diagonal'" in message and "'rowwise'" in message
    for kind, message in _errors(results, "err_pattern"):
        assert kind == "InvalidSpec"
        assert "'*.qkv'" in message and "matches no module" in message
    for kind, message in _errors(results, "err_stages"):
        assert kind == "InvalidSpec"
        assert "stages=3" in message and "2 ranks" in message


@pytest.mark.timeout(60)
def test_outside_a_process_group_says_to_use_gpu_count() -> None:
    from gpufn.parallel import pipeline_parallel, tensor_parallel

    assert not torch.distributed.is_initialized()
    with pytest.raises(GpufnError, match=r"@gpu\(count=N\)"):
        tensor_parallel(pw.build_mlp())
    with pytest.raises(GpufnError, match=r"@gpu\(count=N\)"):
        pipeline_parallel(pw.build_mlp(), stages=2)


@pytest.mark.timeout(60)
def test_plan_is_checked_before_any_group() -> None:
    from gpufn.parallel import tensor_parallel

    with pytest.raises(InvalidSpec, match="'sideways' is not a sharding strategy"):
        tensor_parallel(pw.build_mlp(), {"0": "sideways"})
    with pytest.raises(InvalidSpec, match="cannot be sharded colwise"):
        tensor_parallel(pw.build_mlp(), {"1": "colwise"})  # a GELU
    with pytest.raises(InvalidSpec, match="plan is 'auto' or a dict"):
        tensor_parallel(pw.build_mlp(), "colwise")  # type: ignore[arg-type]
