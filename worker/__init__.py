"""Workers: one process per device, the per-host supervisor that starts them, and the
spmd=False helper. Sub-rooms, bottom to top: `host` (what a host's processes share: /proc,
call children, the memory watch, what a worker holds for a restarted scheduler),
`device_set` (the helper), `supervisor` (the per-host process and its joining).

The worker process itself, in reading order:
- `core`: the sans-I/O worker core (scheduler messages in, actions out);
- `process`: the process shell that carries the actions out (one per device);
- `executor`: runs user code in threads; `streaming`: generators and coroutines;
  `output`: routes what a call prints to its invocation;
- `model_cache`: loads, offloads and evictions of the device's models;
- `groups`: process groups for gangs.
"""
