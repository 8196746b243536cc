"""A four-device gang with a ready process group: all-reduce, a DeviceMesh, and gather.

    GPUFN_CPU_DEVICES=4 python examples/multi_gpu_allreduce.py

`@gpu(count=4)` is granted four devices at once (close together), each rank joins the
gang's process group before the function starts (NCCL on GPUs, gloo on CPU), and the
group stays warm: the second call performs no group setup.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import gpufn

os.environ.setdefault("GPUFN_CPU_DEVICES", "4")


@gpufn.gpu(count=4, gather=True, timeout=120)
def allreduce(n: int) -> dict[str, object]:
    ctx = gpufn.context()
    t = torch.full((n,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(t)  # the default group is the gang's
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.arange(8.0, device=ctx.device), ctx.mesh, [Shard(0)])
    return {"rank": ctx.rank, "sum": t[0].item(), "my_shard": sharded.to_local().tolist()}


def main() -> None:
    for attempt in ("cold", "warm"):
        call = allreduce.spawn(1024)
        t0 = time.perf_counter()
        ranks = call.get(timeout=120)
        ms = (time.perf_counter() - t0) * 1000
        print(f"{attempt} call: {ms:.0f} ms on {call.result_meta()['devices']}")
    for r in ranks:
        print(r)


if __name__ == "__main__":
    main()
