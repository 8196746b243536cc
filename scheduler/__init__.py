"""The scheduler: a sans-I/O core composed of small books, and the ZeroMQ shell around it.

In reading order:
- `core`: `SchedulerCore.handle(event, now) -> sends`, the one brain; `events`: what it
  consumes and produces; `server`: the process shell (sockets, clock, rendezvous store);
- `records`: functions, invocations, devices, peers; `states`: their state machines;
  `transitions`: every invocation move with all of its effects (`TABLE`);
- `intake`: whether a call is accepted; `queues`: ready queues with priority and aging;
  `placement_pass`: one scheduling pass, yielding decisions; `device_fit`: where a call may
  run; `shapes`: how a call occupies its devices; `batches`: dynamic batching;
- gangs: `gang_choice` (which devices), `gang_book` (formations kept warm),
  `gang_verdict` (how a multi-device call ends);
- `model_book`: shared models across devices' ledgers;
- the desks, over the `surface` they may use: `app_book` (deployments, with the
  `deployments` store), `ops` (logs, usage, drain; `logs`, `usage`, kept on disk by
  `ops_store`), `streams` (items,
  attached callers), `user_desk` (`gpufn token ...`, over `users`: the token store, who a
  token is, ownership and per-user limits); `handshake`: Hello checks and the one role
  table; `report`: the status report; `fencing`, `recovery`: generations and restarts;
  `wire_checks`, `settings`, `metrics`.
"""
