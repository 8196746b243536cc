"""Workers: one process per device, and the per-host supervisor that starts them.

In reading order:
- `core`: the sans-I/O worker core (scheduler messages in, actions out);
- `process`: the process shell that carries the actions out (one per device);
- `executor`: runs user code in threads; `streaming`: generators and coroutines;
  `output`: routes what a call prints to its invocation;
- `model_cache`: loads, offloads and evictions of the device's models;
- `groups`: process groups for gangs; `multidevice`: the spmd=False device-set helper;
- `held`: what a worker keeps for a restarted scheduler (its latest Results, a journal of
  the calls it started);
- `supervisor`: per host, starts and restarts workers; `joining`: its attempts to join.
"""
