"""Model-parallel helpers for use inside multi-device functions (`@gpu(count=N)`): tensor and
pipeline parallelism built on PyTorch's own `torch.distributed.tensor.parallel` and `pipelining`.

- `tensor`: `tensor_parallel` (with `_plans`, `_families`, `_experts`); `pipeline`:
  `pipeline_parallel`; `_mesh`: which device mesh they use; `capacity`: the TP x PP
  capacity planner behind `gpufn plan`.
"""

from __future__ import annotations

from gpufn.parallel.pipeline import Pipeline, pipeline_parallel
from gpufn.parallel.tensor import tensor_parallel

__all__ = ["Pipeline", "pipeline_parallel", "tensor_parallel"]
