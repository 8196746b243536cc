"""The shared per-device memory pool: ledgers, residency, eviction, allocator, probes."""
