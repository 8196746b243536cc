"""tensor_parallel over transformers families (tiny seeded configs): each matches one process, or is refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the worker modules by name
import _tp_families as tf
from test_parallel import _spawn

DEFAULT = [name for name, fam in tf.FAMILIES.items() if fam.default]
EVERY = list(tf.FAMILIES)
SHARES: dict[tuple[str, int], str] = {}


def _sweep(world: int, names: list[str], tmp: Path) -> dict[str, list[Any]]:
    """family -> each rank's outcome; one process group per world size runs every family."""
    results = _spawn(world, [f"family:{name}" for name in names], tmp)
    out: dict[str, list[Any]] = {}
    for name in names:
        values = []
        for rank, outcomes in enumerate(results):
            status, value = outcomes[f"family:{name}"]
            if status != "ok":
                pytest.fail(f"{name}: the check itself raised on rank {rank}:\n{value[2]}")
            values.append(value)
        out[name] = values
    return out


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[tuple[int, bool], dict[str, list[Any]] | BaseException] = {}

    def get(world: int, every: bool) -> dict[str, list[Any]]:
        key = (world, every)
        if key not in cache:
            try:
                cache[key] = _sweep(world, EVERY if every else DEFAULT, tmp_path_factory.mktemp(f"sweep{world}"))
            except BaseException as exc:
                cache[key] = exc
                raise
        result = cache[key]
        if isinstance(result, BaseException):
            pytest.fail(f"sweep at world {world} failed earlier: {result!r}")
        return result

    return get


def _assert_family(name: str, world: int, values: list[Any]) -> None:
    fam = tf.FAMILIES[name]
    for rank, value in enumerate(values):
        outcome = value["outcome"]
        if outcome == "crashed":
            pytest.fail(f"{name} rank {rank}: the sharded model crashed:\n{value['error'][2]}")
        if outcome == "raised":
            kind, message, trace = value["error"]
            assert kind == "InvalidSpec", f"{name} rank {rank}: tensor_parallel raised {kind}, not InvalidSpec:\n{trace}"
            head_divides = world == 2  # every family's 8 heads / 4 kv heads divide by 2
            assert fam.refused or not head_divides, f"{name} rank {rank} was refused: {message}"
            if fam.refused:
                assert fam.refused in message, message
            assert "count" in message or "plan" in message, message  # says how to proceed
            SHARES[(name, world)] = f"refused: {message[:90]}"
            continue
        assert not fam.refused, f"{name} must be refused ({fam.refused}) but ran"
        where = f"{name} rank {rank} world {world}"
        torch.testing.assert_close(value["logits"], value["ref_logits"], atol=2e-5, rtol=1e-4,
                                   msg=lambda m, where=where: f"{where}: {m}")
        assert torch.equal(value["tokens"], value["ref_tokens"]), f"{name} rank {rank}: greedy tokens differ"
        for suffix, dim in fam.shards:
            hits = [n for n in value["full_shapes"] if n.endswith(suffix)]
            assert hits, f"{name}: no parameter ends with {suffix!r}"
            full, local = value["full_shapes"][hits[0]], value["local_shapes"][hits[0]]
            if len(full) == 2 and local[1 - dim] != full[1 - dim]:
                full = full[::-1]  # a transformers Conv1D (in, out), sharded as the equivalent Linear            assert local[dim] * world == full[dim], f"{name} rank {rank}: {hits[0]} local {local} full {full}"
        assert value["share"] >= fam.min_share, f"{name}: only {value['share']:.0%} of parameters are sharded"
        SHARES[(name, world)] = f"match, {value['share']:.0%} sharded"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", DEFAULT)
def test_family_at_tp2_matches_or_is_refused(sweeps, name: str) -> None:
    _assert_family(name, 2, sweeps(2, False)[name])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", EVERY)
def test_every_family_matches_or_is_refused(sweeps, world: int, name: str) -> None:
    _assert_family(name, world, sweeps(world, True)[name])


def test_default_sweep_covers_twenty_families() -> None:
    assert len({tf.FAMILIES[n].model_type for n in DEFAULT}) >= 20


def teardown_module() -> None:
    for (name, world), text in sorted(SHARES.items()):
        print(f"TP={world} {name}: {text}")
