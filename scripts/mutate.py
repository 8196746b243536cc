"""Mutation runner: apply one known-bad edit at a time, run the tests meant to catch it, restore.

Each mutation names a file, an exact source snippet (which must occur exactly once, so a
mutation gone stale after a refactor is reported, never skipped silently), its replacement,
and the pytest node ids that must fail under it. Prints a table and exits non-zero when a
mutation survives or is stale.

    python scripts/mutate.py            # every mutation
    python scripts/mutate.py -k aging   # those whose name contains "aging"
    python scripts/mutate.py --list
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
G = "tests/integration/test_mutation_guards.py"
R = "tests/integration/test_readme_claims.py"
D = "tests/unit/test_discovery.py"
DC = "tests/integration/test_discovery_cli.py"
E = "tests/integration/test_edges_cli.py"
U = "tests/unit/test_users.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    snippet: str
    replacement: str
    tests: tuple[str, ...]
    why: str = ""


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "placement-stops-before-backfill", "scheduler/placement_pass.py",
        "        self._backfill_checked, self._backfill_possible = r, possible\n        return not possible\n",
        "        self._backfill_checked, self._backfill_possible = r, possible\n        return True\n",
        ("tests/unit/test_scheduler_gangs.py::"
         "test_head_gang_reserves_draining_devices_and_only_short_calls_backfill",),
        "a pass ends at a gang's reservation although a short call could backfill",
    ),
    Mutation(
        "header-check-skips-a-field", "gpufn/wire/protocol.py",
        "            tests.append(f\"isinstance(v{i}, k{i})\")\n",
        "            tests.append(\"True\") if i == len(checks) - 1 else tests.append(f\"isinstance(v{i}, k{i})\")\n",
        ("tests/unit/test_protocol.py::test_every_field_of_the_wrong_type_is_refused",),
        "the compiled header check lets an ill-typed last field through to the handlers",
    ),
    Mutation(
        "shm-arguments-never-released", "gpufn/client/client.py",
        "        if entry:\n            shm.release(entry[0])\n",
        "        if entry:\n            pass\n",
        ("tests/integration/test_shm.py::test_a_call_cancelled_before_it_ran_frees_its_arguments",),
        "a call cancelled before a worker read its shared-memory arguments leaks the file",
    ),
    Mutation(
        "shm-no-sweep", "worker/supervisor.py",
        "                    shm.sweep()\n",
        "                    pass\n",
        ("tests/integration/test_shm.py::test_files_of_a_caller_that_died_are_removed",),
        "the shared-memory files of a caller that died are never removed",
    ),
    Mutation(
        "shm-receiver-keeps-file", "gpufn/wire/shm.py",
        "        try:\n            os.unlink(path)\n        except FileNotFoundError:\n            pass\n    return mm\n",
        "    return mm\n",
        ("tests/integration/test_shm.py::test_big_tensors_go_through_shared_memory_and_are_freed",),
        "a received shared-memory payload's file stays after the call",
    ),
    Mutation(
        "fingerprint-ignores-list-contents", "gpufn/wire/fingerprint.py",
        "            return (list, self.ident(obj), tuple(self.value(x) for x in obj))\n",
        "            return (list, self.ident(obj))\n",
        ("tests/unit/test_fingerprint.py::test_a_global_list_mutated_in_place_is_pickled_again",
         "tests/integration/test_call_path.py::"
         "test_a_global_list_mutated_in_place_reaches_the_worker"),
        "a global list mutated in place keeps the stale pickled code",
    ),
    Mutation(
        "executor-no-interrupt", "worker/executor.py",
        "                n = ctypes.pythonapi.PyThreadState_SetAsyncExc(\n"
        "                    ctypes.c_ulong(entry[0]), ctypes.py_object(Cancelled))\n",
        "                n = 1\n",
        (f"{G}::test_a_cancelled_running_call_stops_executing",),
        "the worker never interrupts a running call",
    ),
    Mutation(
        "tensor-parallel-noop", "gpufn/parallel/tensor.py",
        "    _check_divisible(modules, rules, fused, keep, world)\n",
        "    _check_divisible(modules, rules, fused, keep, world)\n    return module\n",
        ("tests/integration/test_parallel.py::test_tensor_parallel_shards_the_weights[llama-2]",),
        "tensor_parallel returns the module unchanged after its plan checks",
    ),
    Mutation(
        "model-no-wait-for-holder", "scheduler/model_book.py",
        "                    return None  # it will be free there sooner than a copy could load here\n",
        "                    pass\n",
        (f"{G}::test_a_call_waits_for_the_device_holding_its_model",),
        "placement loads a second copy instead of waiting for the device holding the model",
    ),
    Mutation(
        "queue-no-aging", "scheduler/queues.py",
        "        return queue_key(inv.spec.priority, inv.submitted, self.aging_seconds)\n",
        "        return queue_key(inv.spec.priority, inv.submitted, math.inf)\n",
        (f"{G}::test_aging_bounds_a_low_priority_wait_under_a_stream",),
        "the queue ignores aging",
    ),
    Mutation(
        "ctrl-c-remote-no-cancel", "gpufn/client/client.py",
        '            self._send(p.Cancel(inv, "interrupted by the caller"))\n',
        "            pass\n",
        (f"{G}::test_ctrl_c_stops_the_remote_work[remote]",),
        "Ctrl-C during .remote() sends no Cancel",
    ),
    Mutation(
        "ctrl-c-map-no-cancel", "gpufn/api/map_run.py",
        "            if not self.failed:\n"
        "                self._cancel_rest(client, include_running=True)\n",
        "            pass\n",
        (f"{G}::test_ctrl_c_stops_the_remote_work[map]",),
        "Ctrl-C (or closing) a .map() leaves its calls running",
    ),
    Mutation(
        "map-cost-no-sort", "gpufn/api/map_run.py",
        "            order = sorted(range(len(listed)), key=lambda i: -costs[i])\n",
        "            order = list(range(len(listed)))\n",
        (f"{G}::test_map_cost_starts_the_longest_inputs_first",),
        "map(cost=...) no longer sends the longest inputs first",
    ),
    # ---- added: behaviour whose loss would be silent in production
    Mutation(
        "retries-one-too-few", "scheduler/transitions.py",
        "        if inv.counted_attempts <= inv.spec.retries and not inv.items:\n",
        "        if inv.counted_attempts < inv.spec.retries and not inv.items:\n",
        ("tests/integration/test_call_path.py::test_retries_run_the_call_again_elsewhere",),
        "retries=N gives N-1 retries",
    ),
    Mutation(
        "retries-one-too-many", "scheduler/transitions.py",
        "        if inv.counted_attempts <= inv.spec.retries and not inv.items:\n",
        "        if inv.counted_attempts <= inv.spec.retries + 1 and not inv.items:\n",
        (f"{G}::test_retries_stop_after_the_last_attempt",),
        "retries=N gives N+1 retries",
    ),
    Mutation(
        "gang-root-cause-inverted", "scheduler/gang_verdict.py",
        '    root = [f for f in fails if not f[1].meta.comm_error] or fails\n',
        '    root = [f for f in fails if f[1].meta.comm_error] or fails\n',
        ("tests/integration/test_gangs.py::test_failing_rank_fails_the_call_and_survivors_serve_on",),
        "a gang's caller sees a peer's communication error instead of the failing rank's",
    ),
    Mutation(
        "earlier-dispatch-releases", "scheduler/core.py",
        "            if not (earlier and running_here):  # else a later dispatch holds this device\n",
        "            if True:\n",
        ("tests/unit/test_scheduler_regressions.py::test_a_result_from_an_earlier_dispatch_never_releases_a_later_one",),
        "a late result from an earlier dispatch frees the device a later dispatch holds",
    ),
    Mutation(
        "rendezvous-no-nonce", "scheduler/gang_book.py",
        "            f.nonce = secrets.token_hex(8)\n",
        '            f.nonce = ""\n',
        (f"{R}::test_gang_store_keys_carry_a_random_per_formation_prefix",),
        "the gang rendezvous keys lose their random per-formation prefix",
    ),
    Mutation(
        "discovery-ignores-gpufn-serve", "gpufn/net/discovery.py",
        "    saved = cluster_file.load_cluster_file()\n",
        "    saved = None\n",
        (f"{D}::test_the_order_argument_environment_cluster_file_embedded",
         f"{DC}::test_a_script_without_gpufn_address_calls_the_served_cluster"),
        "clients never find the running `gpufn serve` of their GPUFN_HOME (issue 19)",
    ),
    Mutation(
        "discovery-trusts-a-stale-file", "gpufn/net/discovery.py",
        "    if isinstance(pid, int) and not alive(pid):\n",
        "    if False:\n",
        (f"{D}::test_a_stale_cluster_file_is_not_used_and_is_noticed",),
        "a cluster file whose `gpufn serve` is gone is used anyway",
    ),
    Mutation(
        "embedded-shares-the-state-dir", "gpufn/client/embedded.py",
        "            env[\"GPUFN_STATE_DIR\"] = str(self.state_dir)\n",
        "            pass\n",
        (f"{DC}::test_an_embedded_cluster_keeps_its_state_to_itself",),
        "an embedded cluster writes the served cluster's state dir (deployments, logs)",
    ),
    Mutation(
        "address-any-scheme", "gpufn/wire/config.py",
        '    elif scheme not in ("ipc", "inproc") or not rest:\n',
        "    elif False:\n",
        (f"{D}::test_malformed_addresses_are_invalid_spec_naming_the_form",
         f"{E}::test_an_http_address_from_python_is_a_gpufn_error"),
        "an http:// address reaches ZeroMQ (a raw ZMQError, a traceback in the CLI)",
    ),
    Mutation(
        "help-rich-markup", "gpufn/cli/main.py",
        "app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,\n",
        "app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode='rich',\n",
        (f"{E}::test_help_keeps_bracketed_text",),
        "rich markup eats [bracketed] help text (gpufn[metrics])",
    ),
    Mutation(
        "deploy-shows-gpufn-frames", "gpufn/api/deployment.py",
        "                          user_traceback(e)) from None\n",
        "                          traceback.format_exc()) from None\n",
        (f"{E}::test_a_broken_app_shows_only_the_users_frames",),
        "a broken app's traceback starts with gpufn's own frames and importlib's",
    ),
    Mutation(
        "retry-of-an-exception-warns", "scheduler/transitions.py",
        "            raised = not_before is not None\n",
        "            raised = False\n",
        (f"{E}::test_a_retried_exception_is_not_a_warning_and_states_its_delay_once",),
        "each retry of a raised exception is a WARNING in the user's terminal",
    ),
    Mutation(
        "killed-worker-warns-late", "worker/supervisor.py",
        "            level = logging.INFO if slot.kill_reason else logging.WARNING\n",
        "            level = logging.WARNING\n",
        (f"{E}::test_nothing_is_printed_after_the_scripts_last_line",),
        "the supervisor's note of a worker the scheduler killed trails the script's last line",
    ),
    Mutation(
        "unschedulable-no-setting-named", "scheduler/device_fit.py",
        '    simulated = all(d.info.kind == "cpu" for d in devs)\n',
        "    simulated = False\n",
        ("tests/unit/test_scheduler_core.py::test_unschedulable_fails_at_once_listing_devices",),
        "Unschedulable on simulated devices does not name GPUFN_CPU_DEVICES / GPUFN_DEVICE_MEMORY",
    ),
    Mutation(
        "tp-head-embeddings-kept-whole", "gpufn/parallel/tensor.py",
        "        _localise_head_embeddings(name, parent, sharding, kept, world, rank)\n",
        "        pass\n",
        ("tests/integration/test_parallel.py::test_tensor_parallel_dict_plan_on_t5_matches_single_process",),
        "T5's relative position bias keeps every head while the scores have the local ones",
    ),
    Mutation(
        "docs-streaming-asks-20gib", "docs/api.md",
        '@gpufn.gpu(memory="2GiB", models=[llm])\n',
        '@gpufn.gpu(memory="20GiB", models=[llm])\n',
        ("tests/integration/test_docs_blocks.py::test_python_blocks_run_as_written[docs/api.md]",),
        "the docs' streaming example asks for more memory than the simulated devices have",
    ),
    Mutation(
        "eviction-policy-env-ignored", "scheduler/settings.py",
        '        policy = c.env_str("GPUFN_EVICTION_POLICY", "cost") or "cost"\n',
        '        policy = "cost"\n',
        (f"{R}::test_lru_count_eviction_policy_from_the_environment",),
        "GPUFN_EVICTION_POLICY is ignored",
    ),
    # users (issue 19): the ownership rule, operations, revocation, limits
    Mutation(
        "users-ownership-open", "scheduler/users.py",
        "    return viewer is not None and (viewer.admin or viewer.user == owner)\n",
        "    return viewer is not None\n",
        (f"{U}::test_another_users_call_behaves_like_an_unknown_one",),
        "any user may attach to and cancel another user's call",
    ),
    Mutation(
        "users-status-rows-unfiltered", "scheduler/user_desk.py",
        '                d["running"] = [r for r in d["running"] if r.get("user") == viewer.user]\n',
        "                pass\n",
        (f"{U}::test_status_logs_and_usage_show_a_user_their_own",),
        "gpufn status shows every user's call rows",
    ),
    Mutation(
        "users-logs-unfiltered", "scheduler/logs.py",
        "                if user is not None and line.user != user:\n                    continue\n",
        "",
        (f"{U}::test_status_logs_and_usage_show_a_user_their_own",),
        "gpufn logs shows every user's output",
    ),
    Mutation(
        "users-usage-unfiltered", "scheduler/usage.py",
        "                if user is not None and k.user != user:\n                    continue\n",
        "",
        (f"{U}::test_status_logs_and_usage_show_a_user_their_own",),
        "gpufn usage counts every user's calls for anyone",
    ),
    Mutation(
        "users-claimed-identity", "scheduler/core.py",
        "        inv.user = self.peers[peer].user  # from its token, never the client's claim\n",
        "        inv.user = self.peers[peer].info.user\n",
        (f"{U}::test_the_token_decides_the_user_never_the_client",),
        "a call's user is what the client claims, not its token's",
    ),
    Mutation(
        "users-worker-with-user-token", "scheduler/handshake.py",
        "    if msg.role != p.Role.CLIENT and not who.admin:  # a worker sees every user's calls\n",
        "    if False:\n",
        (f"{U}::test_the_token_decides_the_user_never_the_client",),
        "a user's token admits a worker host (which sees every call)",
    ),
    Mutation(
        "users-operations-open", "scheduler/user_desk.py",
        "        if may_operate(peer, self.store):\n            return None\n",
        "        return None\n",
        (f"{U}::test_operations_need_the_admin_or_an_operator",),
        "any user may deploy, roll back, stop apps and shut down",
    ),
    Mutation(
        "users-revoke-keeps-connections", "scheduler/user_desk.py",
        '            self._drop(k, now, f"its token {why}")\n',
        "            pass\n",
        (f"{U}::test_a_revoked_token_is_refused_at_once_connected_or_not",),
        "a revoked user's open connections keep working",
    ),
    Mutation(
        "users-no-priority-ceiling", "scheduler/users.py",
        "    return replace(spec, priority=user.max_priority)\n",
        "    return spec\n",
        (f"{U}::test_a_call_over_the_priority_ceiling_runs_at_the_ceiling",),
        "a call over its user's priority ceiling runs at the priority it asked for",
    ),
    Mutation(
        "users-device-cap-ignored", "scheduler/placement_pass.py",
        "            if capped and self.caps is not None and not self.caps.admits(inv):\n",
        "            if False:\n",
        (f"{U}::test_calls_over_the_device_cap_wait_aside_without_blocking_others",
         "tests/integration/test_users.py::test_calls_over_the_device_cap_wait_their_turn_and_say_why"),
        "calls run over their user's device cap",
    ),
    Mutation(
        "users-device-cap-blocks-others", "scheduler/placement_pass.py",
        "                self.queue.hold(inv)  # its user is at their device cap: it waits aside\n",
        "                pass\n",
        (f"{U}::test_calls_over_the_device_cap_wait_aside_without_blocking_others",),
        "a call waiting at its user's cap blocks other users' calls of the same function",
    ),
    Mutation(
        "users-cap-never-released", "scheduler/placement_pass.py",
        "            self.queue.unhold(user, self.caps.room(user))\n",
        "            pass\n",
        (f"{U}::test_raising_the_cap_lets_waiting_calls_go_at_once",),
        "calls set aside at a cap never get their turn",
    ),
    Mutation(
        "client-drops-refused-welcome", "gpufn/client/client.py",
        "            if not msg.ok:\n                self._refused(msg)\n",
        "            if not msg.ok:\n                pass\n",
        ("tests/unit/test_connection.py::test_a_refused_rehello_fails_every_pending_call_at_once",
         "tests/integration/test_users.py::test_a_revoked_token_fails_at_once"),
        "a refused re-hello is dropped and the client's pending calls hang",
    ),
    Mutation(
        "serve-new-token-every-start", "gpufn/net/cluster_file.py",
        "    if not token and not rotate:\n",
        "    if False:\n",
        ("tests/integration/test_users.py::"
         "test_serve_keeps_its_token_and_a_refused_reconnect_fails_calls_at_once",),
        "gpufn serve makes a new token on every start",
    ),
    Mutation(
        "from-id-cancel-always-true", "gpufn/api/calls.py",
        '            return self._client.cancel_checked(self._id, "cancelled by the caller")\n',
        '            self._client.cancel(self._id, "cancelled by the caller")\n            return True\n',
        ("tests/integration/test_users.py::test_two_users_read_only_their_own_and_the_admin_reads_all",),
        "cancel() of another user's call returns True",
    ),
)


def run_one(m: Mutation, timeout: float, python: str) -> tuple[str, float, str]:
    path = ROOT / m.file
    try:
        source = path.read_text()
    except OSError as e:
        return "stale", 0.0, f"cannot read {m.file}: {e}"
    count = source.count(m.snippet)
    if count != 1:
        return "stale", 0.0, f"snippet found {count} times in {m.file}"
    t0 = time.monotonic()
    try:
        path.write_text(source.replace(m.snippet, m.replacement))
        cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider",
               *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return "killed", time.monotonic() - t0, f"tests ran past {timeout:.0f}s"
        tail = (proc.stdout.strip().splitlines() or [""])[-1]
        if proc.returncode == 0:
            return "SURVIVED", time.monotonic() - t0, tail
        if proc.returncode in (4, 5):  # usage error / no tests collected: the node ids are stale
            return "stale", time.monotonic() - t0, f"pytest exit {proc.returncode}: {tail}"
        return "killed", time.monotonic() - t0, tail
    finally:
        path.write_text(source)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="run only mutations whose name contains this")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutation's tests")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name:30} {m.file:28} {m.why}")
        return 0
    rows = []
    for m in chosen:
        print(f"... {m.name}", file=sys.stderr, flush=True)
        outcome, seconds, detail = run_one(m, args.timeout, sys.executable)
        rows.append((m, outcome, seconds, detail))
    print(f"{'mutation':30} {'outcome':9} {'s':>6}  tests / detail")
    for m, outcome, seconds, detail in rows:
        print(f"{m.name:30} {outcome:9} {seconds:6.1f}  {', '.join(t.split('::')[-1] for t in m.tests)}")
        if outcome != "killed":
            print(f"{'':48}{detail}")
    bad = [m.name for m, outcome, _, _ in rows if outcome != "killed"]
    if bad:
        print(f"\nnot killed: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
