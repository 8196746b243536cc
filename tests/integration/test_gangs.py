"""Multi-device calls through real processes: gangs with gloo groups, warm reuse,
rank failures, hangs, and single-process multi-device (spmd=False)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn

from ..conftest import cluster_with, wait_ready

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def four() -> Iterator[gpufn.Client]:
    """Four simulated devices in two NVLink-like islands: {0, 1} and {2, 3}."""
    with cluster_with(GPUFN_CPU_DEVICES=4, GPUFN_CPU_ISLANDS=2) as c:
        yield c


@gpufn.gpu(count=2, timeout=60)
def allreduce_ranks() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    ctx = gpufn.context()
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "world": ctx.world_size, "pid": os.getpid(), "rank": ctx.rank}


@gpufn.gpu(count=2, gather=True, timeout=60)
def each_rank(x: int) -> tuple[int, int]:
    return gpufn.context().rank, x * 10


def pids(c: gpufn.Client) -> dict[str, int]:
    return {d["key"]: d["pid"] for d in c.status()["devices"]}


def test_gang_runs_spmd_with_a_ready_group(four: gpufn.Client) -> None:
    call = allreduce_ranks.spawn()
    out = call.get(timeout=60)
    assert out["sum"] == 3.0 and out["world"] == 2 and out["rank"] == 0
    meta = call.result_meta()
    devices = meta["devices"]
    assert len(set(devices)) == 2
    # topology: both ranks in one island ({0,1} or {2,3})
    islands = {int(k.rsplit(":", 1)[1]) // 2 for k in devices}
    assert len(islands) == 1


def test_warm_gang_reuses_its_group(four: gpufn.Client) -> None:
    first = allreduce_ranks.spawn()
    first.get(timeout=60)
    second = allreduce_ranks.spawn()
    second.get(timeout=60)
    a, b = first.result_meta(), second.result_meta()
    assert b["devices"] == a["devices"]  # the warm gang is preferred
    assert b["group_inits"] == a["group_inits"]  # ... and performs no init


def test_gather_returns_every_rank(four: gpufn.Client) -> None:
    assert each_rank.remote(4) == [(0, 40), (1, 40)]


def test_four_ranks_and_device_mesh(four: gpufn.Client) -> None:
    @gpufn.gpu(count=4, timeout=60)
    def mesh_sum() -> float:
        import torch
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = gpufn.context().mesh
        full = torch.arange(8, dtype=torch.float32)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        assert dt.to_local().numel() == 2
        return float(dt.full_tensor().sum())

    assert mesh_sum.remote() == 28.0


def test_failing_rank_fails_the_call_and_survivors_serve_on(four: gpufn.Client) -> None:
    @gpufn.gpu(count=2, timeout=60)
    def rank_one_fails() -> None:
        import torch
        import torch.distributed as dist

        if gpufn.context().rank == 1:
            raise ValueError("rank one is unhappy")
        t = torch.ones(1)
        dist.all_reduce(t)  # blocked until the failing rank's group is torn down

    before = pids(four)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"\[rank 1 of 2\] rank one is unhappy"):
        rank_one_fails.remote()
    assert time.monotonic() - t0 < 30
    assert allreduce_ranks.remote()["sum"] == 3.0  # a fresh group forms
    assert pids(four) == before  # nobody was restarted


def test_dead_rank_gives_worker_lost_and_others_recover(four: gpufn.Client) -> None:
    @gpufn.gpu(count=2, timeout=60)
    def rank_one_dies() -> None:
        import torch
        import torch.distributed as dist

        if gpufn.context().rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))

    call = rank_one_dies.spawn()
    with pytest.raises(gpufn.WorkerLost):
        call.get(timeout=60)
    wait_ready(four)
    assert allreduce_ranks.remote()["sum"] == 3.0


def test_hung_collective_ends_at_the_timeout(four: gpufn.Client) -> None:
    @gpufn.gpu(count=2, timeout=3)
    def hang() -> None:
        import torch
        import torch.distributed as dist

        if gpufn.context().rank == 0:
            dist.all_reduce(torch.ones(1))
        else:
            time.sleep(120)

    t0 = time.monotonic()
    with pytest.raises(gpufn.Timeout, match="timeout of 3s"):
        hang.remote()
    assert time.monotonic() - t0 < 15
    wait_ready(four)
    assert allreduce_ranks.remote()["sum"] == 3.0


def test_single_process_multi_device(four: gpufn.Client) -> None:
    @gpufn.gpu(count=2, spmd=False, timeout=120)
    def one_process() -> dict[str, object]:
        print("hello from the multi-device process")
        ctx = gpufn.context()
        return {"devices": len(ctx.devices), "pid": os.getpid()}

    out = one_process.remote()
    assert out["devices"] == 2
    assert out["pid"] not in pids(four).values()
    again = one_process.remote()
    assert again["pid"] == out["pid"]  # the helper stays warm for the same device set


def test_single_process_multi_device_sees_the_attempt_number(four: gpufn.Client, tmp_path: Path) -> None:
    @gpufn.gpu(count=2, spmd=False, retries=1, timeout=120)
    def attempt_of(marker: str) -> int:
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getppid(), signal.SIGKILL)  # the worker holding this helper: lost
        return gpufn.context().attempt

    for x in range(3):  # dispatch tokens are scheduler-wide: make them differ from 1
        assert [v for _, v in each_rank.remote(x)] == [x * 10, x * 10]
    assert attempt_of.remote("") == 1
    assert attempt_of.remote(str(tmp_path / "died")) == 2  # ran again after its worker died
    wait_ready(four)


def test_gang_larger_than_the_cluster_is_unschedulable(four: gpufn.Client) -> None:
    with pytest.raises(gpufn.Unschedulable, match="count=5"):
        allreduce_ranks.with_options(count=5).remote()


