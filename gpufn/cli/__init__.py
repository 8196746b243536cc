"""The `gpufn` command line: a thin typer edge over the library (parse, call, render, exit).

- `main`: the app, `serve` and `worker`; `ops`: status, logs, usage, run, shutdown;
- `apps`: deploy and app list/history/rollback/stop; `plan`: the capacity planner;
- `tokens`: users and their tokens (`gpufn token create|list|update|rotate|revoke`);
- `common`: reaching the scheduler and one-line failures; `render`: rich tables.
"""
