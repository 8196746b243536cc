"""The scheduler: a sans-I/O core composed of small books, and the ZeroMQ shell around it.

Sub-rooms, bottom to top (each imports only those below it):
- `nouns`: records, state machines, shapes, the core's events and sends, settings;
- `stores`: what is kept on disk (deployments, ops, kept results);
- `books`: queues and batches, the model book, gangs, users, logs and usage;
- `placement`: device fit, the open index, gang choice, one scheduling pass;
- `calls`: intake, transitions, timers, and after a restart recovery and adoption;
- `peers`: the handshake, membership (who is connected and what their leaving means),
  fencing;
- `desks`: apps, operations, streams and users over the core's `surface`; the report.
On top: `core` (`SchedulerCore.start(restored, now)`, then `handle(event, now) -> sends`)
and `server`, the process shell.
"""
