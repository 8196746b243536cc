"""Workers: one process per device (executor, model cache, process groups) and the per-host supervisor."""
