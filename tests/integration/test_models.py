"""The shared memory pool through real processes: models loaded once per device and
shared, offloaded to host and restored, evicted by policy, isolated on OOM."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

import gpufn

from ..conftest import cluster_with

pytestmark = pytest.mark.timeout(180)
MiB = 2**20


def linear_of(mib: int, seed: int) -> torch.nn.Module:
    """A Linear layer of about `mib` MiB of fp32 weights, seeded."""
    n = int((mib * MiB / 4) ** 0.5)
    torch.manual_seed(seed)
    return torch.nn.Linear(n, n, bias=False)


@gpufn.model(memory="40MiB")
def small_a() -> torch.nn.Module:
    return linear_of(40, 1)


@gpufn.model(memory="40MiB")
def small_b() -> torch.nn.Module:
    return linear_of(40, 2)


@gpufn.model(memory="40MiB")
def small_c() -> torch.nn.Module:
    return linear_of(40, 3)


@gpufn.model(memory="30MiB", pin=True)
def pinned() -> torch.nn.Module:
    return linear_of(30, 4)


@gpufn.model(memory="10MiB")
def broken() -> torch.nn.Module:
    raise RuntimeError("the weights are missing")


@gpufn.model(memory="1MiB")
def underestimated() -> torch.nn.Module:
    return linear_of(20, 5)


def _probe(m: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(m(torch.ones(1, m.in_features)).sum())


@gpufn.gpu(models=[small_a])
def use_a() -> float:
    return _probe(small_a.get())


@gpufn.gpu(models=[small_a])
def also_a() -> int:
    return id(small_a.get())


@gpufn.gpu(models=[small_b])
def use_b() -> float:
    return _probe(small_b.get())


@gpufn.gpu(models=[small_c])
def use_c() -> float:
    return _probe(small_c.get())


@gpufn.gpu(models=[pinned])
def use_pinned() -> float:
    return _probe(pinned.get())


@gpufn.gpu(models=[broken])
def use_broken() -> None:
    broken.get()


@gpufn.gpu(models=[underestimated])
def use_under() -> float:
    return _probe(underestimated.get())


@gpufn.gpu(models=[small_a])
def oom() -> None:
    torch.empty(2**62, dtype=torch.uint8)


@gpufn.gpu
def not_listed() -> None:
    small_a.get()


@pytest.fixture(scope="module")
def pool() -> Iterator[gpufn.Client]:
    """One simulated device of 128 MiB: room for three 40 MiB models, not four."""
    with cluster_with(GPUFN_CPU_DEVICES=1, GPUFN_DEVICE_MEMORY="128MiB") as c:
        yield c


def models_on(c: gpufn.Client) -> dict[str, dict[str, object]]:
    return {m["name"]: m for m in c.status()["devices"][0]["models"]}


def record(c: gpufn.Client, name: str) -> dict[str, object]:
    return next(m for m in c.status()["models"] if m["name"] == name)


def test_model_is_loaded_once_and_shared_by_functions(pool: gpufn.Client) -> None:
    expected = _probe(small_a.loader())
    calls = [use_a.spawn() for _ in range(4)]  # arrive together: still one load
    assert [c.get(timeout=60) for c in calls] == [expected] * 4
    assert also_a.remote() == also_a.remote()  # the same object serves both functions
    m = models_on(pool)["small_a"]
    assert m["state"] == "resident" and m["measured"] and set(m["users"]) == {"use_a", "also_a"}
    assert record(pool, "small_a")["loads"] == 1
    metas = [c.result_meta()["cold_start"] for c in calls]
    assert metas.count("loaded") == 1 and set(metas) <= {"loaded", "waited", ""}


def test_offload_to_host_and_restore_when_the_pool_is_full(pool: gpufn.Client) -> None:
    use_a.remote()
    use_b.remote()
    assert use_pinned.remote() == _probe(pinned.loader())  # 40 + 40 + 30 of 128 MiB
    # c needs 40 MiB: an idle unpinned model goes to host memory (never the pinned one)
    assert use_c.remote() == _probe(small_c.loader())
    states = {k: v["state"] for k, v in models_on(pool).items()}
    assert states["pinned"] == "resident" and states["small_c"] == "resident"
    assert sorted(s for k, s in states.items() if k in ("small_a", "small_b")) == ["offloaded", "resident"]
    gone = "small_a" if states["small_a"] == "offloaded" else "small_b"
    fn = use_a if gone == "small_a" else use_b
    call = fn.spawn()
    call.get(timeout=60)
    assert call.result_meta()["cold_start"] == "restored"
    rec = record(pool, gone)
    assert rec["restores"] >= 1 and rec["offloads"] >= 1
    assert pool.status()["devices"][0]["used"] <= 128 * MiB


def test_loader_failure_fails_its_calls_with_the_traceback(pool: gpufn.Client) -> None:
    with pytest.raises(gpufn.ModelLoadError, match="the weights are missing") as e:
        use_broken.remote()
    assert "in broken" in str(e.value)  # the loader's traceback
    assert "broken" not in models_on(pool)  # nothing half-registered
    with pytest.raises(gpufn.ModelLoadError):  # tried again on the next call, fails again
        use_broken.remote()
    assert record(pool, "broken")["failures"] == 2


def test_measured_size_replaces_the_estimate(pool: gpufn.Client) -> None:
    use_under.remote()
    m = models_on(pool)["underestimated"]
    assert m["measured"] and m["nbytes"] > 15 * MiB


def test_out_of_memory_fails_the_call_alone(pool: gpufn.Client) -> None:
    before = use_a.remote()
    with pytest.raises(gpufn.OutOfMemory, match="ran out of memory"):
        oom.remote()
    assert use_a.remote() == before  # the model kept serving, unchanged
    assert models_on(pool)["small_a"]["state"] == "resident"


def test_models_plus_workspace_larger_than_the_device_are_unschedulable(pool: gpufn.Client) -> None:
    t0 = time.monotonic()
    with pytest.raises(gpufn.Unschedulable, match=r"too little|short by"):
        use_a.with_options(memory="100MiB").remote()
    assert time.monotonic() - t0 < 5


def test_get_of_an_unlisted_model_says_how_to_fix(pool: gpufn.Client) -> None:
    with pytest.raises(gpufn.GpufnError, match=r"add it there|@gpu\(models="):
        not_listed.remote()


def test_local_calls_load_the_model_in_process() -> None:
    assert use_b.local() == _probe(small_b.loader())
