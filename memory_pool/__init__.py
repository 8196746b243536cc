"""The shared per-device memory pool.

In reading order:
- `ledger`: the scheduler's per-device ledgers (capacity, workspace, models) and how a
  request fits (`Fit`), alone or across a gang;
- `residency`: where a model's weights are (the state machine and `ModelEntry`);
- `eviction`: the policies that rank idle models for eviction;
- `allocator`: the worker's side (one device's models, measured, in `torch.cuda.MemPool`);
- `probe`: what devices a host has (NVML, or simulated).
"""
