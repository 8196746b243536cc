"""The `@gpu(count=N, spmd=False)` helper: one process that sees all N granted devices
(`helper`)."""
