#!/usr/bin/env bash
# Run every GPU-only check (NVML, CUDA MemPool, NCCL) on a machine with a CUDA device.
#   scripts/gpu_check.sh            # from the repo root, with gpufn installed (CUDA torch)
# Prints what the device is, then runs the @pytest.mark.gpu tests verbosely with their
# printed measurements (NCCL init time, MemPool bytes vs allocator deltas, host reload
# bandwidth vs a plain pinned copy, cold/warm call times on the GPU, a sharded model's
# MemPool bytes and offload/restore bandwidth per rank, NCCL on the resident gang).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
echo "== device"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv 2>/dev/null \
  || echo "nvidia-smi not found"
"$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version())
    if torch.cuda.device_count() < 2:
        print("note: one GPU: multi-rank NCCL cannot run here (two ranks on one device is an "
              "NCCL error); world-size-1 NCCL, abort and pinning are checked instead")
PYEOF
echo "== gpu tests"
GPUFN_PROGRESS=0 "$PY" -m pytest -m gpu -v -s -rs -p no:cacheprovider tests/gpu
status=$?
echo "== exit $status"
exit $status
