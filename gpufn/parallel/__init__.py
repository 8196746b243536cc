"""Model-parallel helpers for use inside multi-device functions (`@gpu(count=N)`): tensor and
pipeline parallelism built on PyTorch's own `torch.distributed.tensor.parallel` and `pipelining`.

- `tensor`: `tensor_parallel` (with `_plans`, `_families`, `_experts`); `pipeline`:
  `pipeline_parallel`; `_mesh`: which device mesh they use; `capacity`: the TP x PP
  capacity planner behind `gpufn plan`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufn.parallel.pipeline import Pipeline, pipeline_parallel
    from gpufn.parallel.tensor import tensor_parallel

__all__ = ["Pipeline", "pipeline_parallel", "tensor_parallel"]

# Loaded on first use: `gpufn plan` (capacity) and the CLI do not pay for importing torch.
_LAZY = {"Pipeline": "pipeline", "pipeline_parallel": "pipeline", "tensor_parallel": "tensor"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"gpufn.parallel.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gpufn.parallel' has no attribute {name!r}")
