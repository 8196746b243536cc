"""Gang groups on a real GPU: NCCL init with device_id, abort from a thread, UUID pinning.

Each scenario runs in a fresh Python subprocess, as a gpufn worker would (its own CUDA
context and environment), and reports a JSON line the test checks. World size 1: a
second rank would need a second GPU (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from .figures import figure, reports

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
        reason="needs torch built with NCCL",
    ),
]

NCCL_SCRIPT = r"""
import json, os, threading, time
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from gpufn.runtime.context import CallContext
from gpufn.worker.groups import GangSpec, GroupManager, host_store, mesh_for

out = {}
store, port = host_store()
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
keep = torch.arange(1 << 22, device=dev, dtype=torch.float32)  # allocated before any group
keep_cpu = keep.cpu()

mgr = GroupManager()
spec = GangSpec("gpu-test", 1, 0, 1, "127.0.0.1", port, "nccl", 60.0, ("local:0",))
t0 = time.perf_counter()
pg = mgr.ensure(spec, dev)
out["init_s"] = time.perf_counter() - t0
out["bound_device"] = str(pg.bound_device_id)
out["async_error_handling"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
t = torch.full((4,), 3.0, device=dev)
dist.all_reduce(t)
torch.cuda.synchronize()
out["ar1"] = t.tolist()

t0 = time.perf_counter()
out["warm_same"] = mgr.ensure(spec, dev) is pg
out["warm_s"] = time.perf_counter() - t0
out["inits_after_warm"] = mgr.inits

ctx = CallContext("inv", "f", rank=0, world_size=1, device=dev, group=pg)
mesh = mesh_for(ctx)
dt = distribute_tensor(torch.arange(8.0, device=dev), mesh, [Shard(0)])
out["mesh_type"] = mesh.device_type
out["dt_full"] = dt.full_tensor().cpu().tolist()

# Abort from another thread while this process keeps collectives in flight.
big = torch.randn(8192, 8192, device=dev)
stop = threading.Event()
errors = []
started = threading.Event()

def spin():
    try:
        while not stop.is_set():
            dist.all_reduce(big)
            started.set()
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}"[:200])
    finally:
        started.set()

th = threading.Thread(target=spin, daemon=True)
th.start()
started.wait(30)
time.sleep(0.5)
t0 = time.perf_counter()
mgr.abort("gpu test: abort from another thread")
out["abort_s"] = time.perf_counter() - t0
stop.set()
th.join(30)
out["spinner_alive"] = th.is_alive()
out["spinner_error"] = errors[:1]
try:
    torch.cuda.synchronize()
    out["sync_after_abort"] = "ok"
except Exception as e:
    out["sync_after_abort"] = f"{type(e).__name__}: {e}"[:200]
out["current_after_abort"] = mgr.current
out["initialized_after_abort"] = dist.is_initialized()

# The worker's CUDA allocations survive, and the device still computes.
out["keep_intact"] = bool(torch.equal(keep.cpu(), keep_cpu))
x = torch.randn(1024, 1024, device=dev)
out["matmul_ok"] = bool(torch.isfinite((x @ x).sum()).item())

# Back in service: a new generation joins afresh.
spec2 = GangSpec("gpu-test", 2, 0, 1, "127.0.0.1", port, "nccl", 60.0, ("local:0",))
t0 = time.perf_counter()
mgr.ensure(spec2, dev)
out["reinit_s"] = time.perf_counter() - t0
t = torch.full((4,), 5.0, device=dev)
dist.all_reduce(t)
torch.cuda.synchronize()
out["ar2"] = t.tolist()
out["inits"] = mgr.inits
mgr.leave()
out["left"] = not dist.is_initialized()
print("RESULT " + json.dumps(out), flush=True)
"""

VISIBLE_SCRIPT = r"""
import json
import torch
p = torch.cuda.get_device_properties(0)
print("RESULT " + json.dumps({"count": torch.cuda.device_count(), "uuid": str(p.uuid),
                              "name": p.name}), flush=True)
"""


def run_child(script: str, env: dict[str, str] | None = None, timeout: float = 240) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    print(proc.stdout[-4000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    assert proc.returncode == 0, f"child failed with {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child printed no RESULT line:\n{proc.stdout[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


def _norm_uuid(u: str) -> str:
    u = u.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            u = u[len(prefix):]
    return u


@pytest.mark.timeout(180)
@reports(("NCCL group set-up (world size 1)",
          "under a second: init_process_group with device_id and the first all_reduce"),
         ("NCCL warm ensure", "microseconds: the same group again, no second init"),
         ("NCCL abort from another thread",
          "well under 10 s (the test's bound); the spinning collective ends, the device computes"),
         ("NCCL re-init after abort", "about the first set-up: a new generation joins afresh"))
def test_nccl_init_abort_from_thread_and_rejoin() -> None:
    env = dict(os.environ)
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # see that gpufn sets its default
    r = run_child(NCCL_SCRIPT, env=env)
    figure("NCCL group set-up (world size 1)",
           f"{r['init_s']:.3f} s, bound to {r['bound_device']}, NCCL "
           f"{torch.cuda.nccl.version()}")
    figure("NCCL warm ensure", f"{r['warm_s'] * 1e6:.0f} us, same group {r['warm_same']}, "
           f"inits {r['inits_after_warm']}")
    figure("NCCL abort from another thread",
           f"{r['abort_s'] * 1e3:.1f} ms; spinner saw {r['spinner_error'] or 'no error'}; "
           f"sync after {r['sync_after_abort']}, allocations intact {r['keep_intact']}")
    figure("NCCL re-init after abort", f"{r['reinit_s']:.3f} s, all_reduce {r['ar2'][0]}")
    assert r["bound_device"] == "cuda:0"
    assert r["async_error_handling"] == "2"
    assert r["ar1"] == [3.0] * 4
    assert r["warm_same"] is True and r["inits_after_warm"] == 1
    assert r["mesh_type"] == "cuda" and r["dt_full"] == [float(i) for i in range(8)]
    assert r["abort_s"] < 10.0
    assert r["spinner_alive"] is False
    assert r["sync_after_abort"] == "ok"
    assert r["current_after_abort"] is None and r["initialized_after_abort"] is False
    assert r["keep_intact"] is True and r["matmul_ok"] is True
    assert r["ar2"] == [5.0] * 4 and r["inits"] == 2
    assert r["left"] is True


@pytest.mark.timeout(120)
@reports(("pinning by CUDA_VISIBLE_DEVICES=<uuid>", "1 device, the same UUID (the last GPU's)"))
def test_cuda_visible_devices_pins_by_uuid() -> None:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        n = pynvml.nvmlDeviceGetCount()
        handle = pynvml.nvmlDeviceGetHandleByIndex(n - 1)  # the last: not the default one
        raw = pynvml.nvmlDeviceGetUUID(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    finally:
        pynvml.nvmlShutdown()
    uuid = raw.decode() if isinstance(raw, bytes) else str(raw)
    name = name.decode() if isinstance(name, bytes) else str(name)
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = uuid
    r = run_child(VISIBLE_SCRIPT, env=env, timeout=100)
    figure("pinning by CUDA_VISIBLE_DEVICES=<uuid>",
           f"{r['count']} device, {r['name']}, uuid matches "
           f"{_norm_uuid(r['uuid']) == _norm_uuid(uuid)}")
    assert r["count"] == 1
    assert _norm_uuid(r["uuid"]) == _norm_uuid(uuid), (r, name)
