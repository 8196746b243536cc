"""Mutations of issue 29's state-directory rules (a damaged state file refuses the start,
a full state disk fails its writes with the reason and keeps usage until it can be
written) and of the operator's smaller edges (serve.log, `shutdown --force`, discovery's
advice, 80 columns). Each names the tests that must fail under it."""

from __future__ import annotations

from mutation_table import Mutation

SF = "tests/integration/test_state_files.py"
FD = "tests/integration/test_full_disk.py"
OE = "tests/integration/test_operator_edges.py"
UF = "tests/unit/test_state_faults.py"

STATE: tuple[Mutation, ...] = (
    Mutation(
        "state-not-checked", "gpufn/cluster/serve.py",
        "        o.check()\n        o.check_state()\n",
        "        o.check()\n",
        (f"{SF}::test_serve_refuses_a_damaged_state_file_in_one_line",),
        why="a damaged state file starts an empty cluster, or a traceback",
    ),
    Mutation(
        "state-empty-file-is-empty", "gpufn/cluster/state_check.py",
        '        return "it is empty (0 bytes): truncated"\n',
        "        return None\n",
        (f"{SF}::test_serve_refuses_a_damaged_state_file_in_one_line",),
        why="a deployments.sqlite truncated to 0 bytes is taken for no apps",
    ),
    Mutation(
        "full-disk-deploy-unanswered", "scheduler/stores/disk.py",
        "            if isinstance(e, (OSError, sqlite3.Error)):\n"
        "                raise write_error(path, e) from None\n",
        "",
        (f"{UF}::test_a_deploy_on_a_full_disk_names_the_state_dir_and_writes_nothing",),
        why="a deploy on a full disk is never answered (its error is not a GpufnError)",
    ),
    Mutation(
        "full-disk-usage-dropped", "scheduler/desks/ops.py",
        "                self.usage.give_back(rows)\n",
        "                pass\n",
        (f"{UF}::test_usage_and_logs_wait_in_memory_and_are_said_once",),
        why="usage taken for a write that failed is never written",
    ),
    Mutation(
        "full-disk-said-every-second", "scheduler/stores/disk.py",
        "        if self.failing is None:\n",
        "        if True:\n",
        (f"{UF}::test_usage_and_logs_wait_in_memory_and_are_said_once",),
        why="a failing write is logged every second",
    ),
    Mutation(
        "serve-log-world-readable", "gpufn/cluster/serve.py",
        'with os.fdopen(open_private_append(log_file()), "ab") as log:',
        'with open(log_file(), "ab") as log:',
        (f"{OE}::test_serve_log_shutdown_force_and_columns",),
        why="serve.log is created 0644",
    ),
    Mutation(
        "gateway-prints-callers", "gpufn/cluster/gateway.py",
        '    env: dict[str, str] = {"GPUFN_PRINT_CALL_OUTPUT": "0"}\n',
        "    env: dict[str, str] = {}\n",
        (f"{OE}::test_serve_log_shutdown_force_and_columns",),
        why="every HTTP caller's prints land in serve.log",
    ),
    Mutation(
        "force-leaves-files", "gpufn/cli/ops.py",
        "        forget_dead_server()\n",
        "        pass\n",
        (f"{OE}::test_serve_log_shutdown_force_and_columns",),
        why="shutdown --force after a crash leaves serve.pid and cluster.json",
    ),
    Mutation(
        "discovery-names-others", "gpufn/net/discovery.py",
        "    mine = [s for s in others if _owned(s.home)]\n",
        "    mine = others[:1]\n",
        (f"{OE}::test_another_users_serve_is_never_named",),
        why="the advice names another user's GPUFN_HOME",
    ),
    Mutation(
        "columns-cut", "gpufn/cli/render.py",
        '    t.add_column(header, overflow="fold")\n',
        "    t.add_column(header)\n",
        (f"{OE}::test_serve_log_shutdown_force_and_columns",),
        why="key columns of status and usage are cut with an ellipsis at 80 columns",
    ),
)
