"""Mutations of issue 29's HTTP rules (the gateway's bounds, errors by user, query
parameters, HTTP-spawned calls across restarts) and of `gpufn run`'s by-value modules.
Each names the tests that must fail under it."""

from __future__ import annotations

from mutation_table import Mutation

F = "tests/integration/test_http_faults.py"
RUN = "tests/integration/test_run_sibling.py"

HTTP: tuple[Mutation, ...] = (
    Mutation(
        "http-body-read-whole", "gpufn/http/app.py",
        "        raw = await bodies.read(request, self.max_body, lease, self.read_timeout)\n",
        "        raw = await request.body()\n",
        (f"{F}::test_a_chunked_body_past_the_limit_is_413_and_never_buffered",),
        why="a chunked body is read whole, past the size limit",
    ),
    Mutation(
        "http-no-body-budget", "gpufn/http/bodies.py",
        "        if n > 0 and b.used + n > b.total:\n",
        "        if False:\n",
        (f"{F}::test_bodies_past_the_budget_together_are_503_with_retry_after",),
        why="concurrent bodies are not bounded together",
    ),
    Mutation(
        "http-no-head-timeout", "gpufn/http/server.py",
        "http=with_head_timeout(AutoHTTPProtocol, config.http_read_timeout()))",
        "http=AutoHTTPProtocol)",
        (f"{F}::test_half_open_and_slow_connections_are_closed",),
        why="a half-open connection, or a head sent a byte at a time, is kept forever",
    ),
    Mutation(
        "http-no-body-timeout", "gpufn/http/bodies.py",
        "            msg = await asyncio.wait_for(request.receive(), idle_s)\n",
        "            msg = await request.receive()\n",
        (f"{F}::test_half_open_and_slow_connections_are_closed",),
        why="a stalled body holds its request forever",
    ),
    Mutation(
        "http-nan-accepted", "gpufn/http/bodies.py",
        "json.loads(raw, parse_constant=_constant)", "json.loads(raw)",
        (f"{F}::test_json_the_gateway_cannot_take_is_the_clients_error",),
        why="NaN in a body is accepted, and its call fails 500",
    ),
    Mutation(
        "http-errors-for-everyone", "gpufn/http/app.py",
        "if admin or who == owner]", "if True]",
        (f"{F}::test_each_user_sees_only_their_own_errors",),
        why="GET /v1/status shows every user the others' errors",
    ),
    Mutation(
        "http-spawn-not-kept", "gpufn/http/app.py",
        "entry, target, sub = await self.prepare(request, keep=True)",
        "entry, target, sub = await self.prepare(request, keep=False)",
        (f"{F}::test_a_spawned_call_survives_a_kill_of_the_gateway",
         f"{F}::test_a_spawned_call_survives_a_restart_of_the_head"),
        why="an HTTP-spawned call is not kept: lost with its gateway or head",
    ),
    Mutation(
        "run-module-alone-by-value", "gpufn/cli/ops.py",
        "            with by_value(modules):", "            with by_value(modules[:1]):",
        (f"{RUN}::test_run_sends_the_files_local_modules_as_deploy_does",),
        why="gpufn run sends its file by value but not the local modules next to it",
    ),
)
