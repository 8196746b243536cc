"""Mutation runner: apply one known-bad edit at a time, run the tests meant to catch it, restore.

Each mutation names a file, an exact source snippet (which must occur exactly once, so a
mutation gone stale after a refactor is reported, never skipped silently), its replacement,
and the pytest node ids that must fail under it. Prints a table and exits non-zero when a
mutation survives or is stale. A mutation no test can tell from the original says why in
`equivalent` (it is checked for staleness only), so the audit of a rule is kept.

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
CG = "tests/unit/test_core_guards.py"
PG = "tests/unit/test_piece_guards.py"
IG = "tests/integration/test_release_guards.py"
SEC = "tests/integration/test_security.py"
BAD = "tests/integration/test_bad_input.py"
UF, USR, UOPS = "tests/unit/test_faults.py", "tests/unit/test_streams_retries.py", "tests/unit/test_ops.py"
UDEP, UCACHE, USEC = ("tests/unit/test_deployments.py", "tests/unit/test_cache.py",
                      "tests/unit/test_security.py")
USH, UHOSTS, USUP = "tests/unit/test_sharded.py", "tests/unit/test_hosts.py", "tests/unit/test_supervisor.py"
UCORE = "tests/unit/test_scheduler_core.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    snippet: str
    replacement: str
    tests: tuple[str, ...]
    why: str = ""
    # Why no test can tell this edit from the original (then it is only checked for being
    # stale, and reported as "equivalent", never as a survivor).
    equivalent: str = ""


MUTATIONS: tuple[Mutation, ...] = (
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
    # ---- issue 23: the rules of the last release that no test held
    Mutation(
        "fencing-stale-by-fenced", "scheduler/fencing.py",
        "    stale = (msg.incarnation < d.incarnation if msg.incarnation\n",
        "    stale = (msg.incarnation <= d.fenced if msg.incarnation\n",
        (f"{CG}::test_late_exit_notices_of_restarts_that_never_said_hello_spare_the_serving_worker",),
        "a late exit notice of a restart that never said Hello takes down the serving worker",
    ),
    Mutation(
        "fencing-stale-unless-current", "scheduler/fencing.py",
        "    stale = (msg.incarnation < d.incarnation if msg.incarnation\n",
        "    stale = (msg.incarnation != d.incarnation if msg.incarnation\n",
        (f"{CG}::test_in_order_exit_notices_of_restarts_that_never_said_hello_are_applied",),
        "exit notices of generations newer than the last Hello (the supervisor gave up) are ignored",
    ),
    Mutation(
        "recovery-charges-twice", "scheduler/transitions.py",
        "        if inv.state is not InvState.QUEUED or inv.attempts:\n",
        "        if inv.state is not InvState.QUEUED:\n",
        (f"{CG}::test_a_call_lost_here_is_not_charged_again_when_its_worker_re_registers_listing_it",),
        "a call lost and requeued here is charged again when its worker re-registers listing it",
    ),
    Mutation(
        "unstarted-loss-uses-retry", "scheduler/transitions.py",
        "                inv.unstarted_losses += 1  # it never ran: queue it again, no retry used\n",
        "                pass\n",
        (f"{CG}::test_a_call_lost_while_its_model_loads_runs_again_without_a_retry",),
        "a call lost while its model loads spends a retry",
    ),
    Mutation(
        "clock-starts-while-model-loads", "scheduler/transitions.py",
        "            if any(d.ledger.state(k) is not Residency.RESIDENT for k in inv.function.model_keys):\n",
        "            if any(d.ledger.state(k) is Residency.ABSENT for k in inv.function.model_keys):\n",
        (f"{CG}::test_a_call_lost_while_its_model_loads_runs_again_without_a_retry",),
        "a call counts as started (timeout clock, retries) while its model still loads",
    ),
    Mutation(
        "rollback-to-the-first", "scheduler/app_book.py",
        "            target_n = older[-1].version\n",
        "            target_n = older[0].version\n",
        (f"{CG}::test_rollback_without_a_version_goes_to_the_version_before_the_current_one",),
        "a rollback without a version goes to v1, not the version before the current one",
    ),
    Mutation(
        "deploy-unchanged-leaves-stopped", "scheduler/app_book.py",
        '                    self.store.set_state(msg.app, "active")\n',
        "                    pass\n",
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-unchanged-code]",),
        "deploying unchanged code to a stopped app leaves it stopped",
    ),
    Mutation(
        "deploy-changed-leaves-stopped", "scheduler/deployments.py",
        "DO UPDATE SET current=excluded.current, state='active'\",",
        "DO UPDATE SET current=excluded.current\",",
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-changed-code]",),
        "deploying changed code to a stopped app adds a version but leaves the app stopped",
    ),
    Mutation(
        "restart-keeps-releasing-models", "scheduler/app_book.py",
        "                    self._keep_models(self.store.functions(msg.app, current.current))\n",
        "                    pass\n",
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[while-running-unchanged-code]",),
        "a stopped app started again by an unchanged deploy still has its models evicted",
    ),
    Mutation(
        "usage-gang-counts-one-device", "scheduler/ops.py",
        "            held = len(inv.devices)\n",
        "            held = 1\n",
        (f"{CG}::test_a_gang_call_is_metered_as_its_devices_times_its_run_time",
         f"{IG}::test_a_gang_call_is_metered_as_its_devices_times_its_run_time"),
        "a gang call on N devices is metered as one device",
    ),
    Mutation(
        "usage-counts-requeued-runs", "scheduler/ops.py",
        "        if state is not InvState.QUEUED and not inv.members:\n",
        "        if not inv.members:\n",
        (f"{CG}::test_a_retried_call_counts_once_as_succeeded_with_both_runs_device_time",
         f"{CG}::test_a_preempted_call_counts_once_as_succeeded_with_both_runs_device_time"),
        "a retried or preempted call counts as two calls, one of them 'queued'",
    ),
    Mutation(
        "usage-drops-lost-runs", "scheduler/ops.py",
        "        if inv.started is not None and inv.devices:\n",
        "        if inv.started is not None and inv.devices and state is not InvState.QUEUED:\n",
        (f"{CG}::test_a_retried_call_counts_once_as_succeeded_with_both_runs_device_time",
         f"{CG}::test_a_preempted_call_counts_once_as_succeeded_with_both_runs_device_time"),
        "the device time of a run that was lost or preempted is not metered",
    ),
    Mutation(
        "cache-release-any-claim", "gpufn/api/cache.py",
        '        if token is not None and self._owner(self._path(key, ".claim")).get("token") == token:\n',
        "        if token is not None:\n",
        (f"{PG}::test_an_owner_whose_claim_was_taken_over_leaves_the_new_owners_claim",),
        "an owner whose claim was taken over deletes the new owner's claim",
    ),
    Mutation(
        "cache-owner-never-touches", "gpufn/api/cache.py",
        "                self.store.touch_owned()\n",
        "                pass\n",
        (f"{PG}::test_an_owner_computing_past_the_lease_keeps_its_claim",),
        "an owner computing past the lease lets its claim go stale",
    ),
    Mutation(
        "cache-compute-no-watcher", "gpufn/api/cache.py",
        "        self._ensure_thread()  # it touches the claim while the call runs\n",
        "",
        (f"{PG}::test_an_owner_computing_past_the_lease_keeps_its_claim",),
        "an owner with nothing to wait for never starts the thread that touches its claims",
    ),
    Mutation(
        "stream-item-unchecked", "worker/streaming.py",
        '                    ser.check_payload(frames, f"a value yielded by {call.name}")\n',
        "",
        (f"{PG}::test_a_yielded_value_over_the_limit_ends_the_stream_naming_the_function",
         f"{BAD}::test_a_yielded_value_over_the_limit_ends_its_stream_and_the_worker_serves_on"),
        "a yielded value over GPUFN_MAX_PAYLOAD is sent (and drops the worker's connection)",
    ),
    Mutation(
        "allow-keys-ignored-on-loopback", "gpufn/net/curve.py",
        "        if not (needs_curve(host, ipc) or allow_keys is not None):\n",
        "        if not needs_curve(host, ipc):\n",
        (f"{PG}::test_an_allow_list_on_loopback_encrypts_or_refuses",
         f"{SEC}::test_an_allow_list_on_loopback_encrypts_or_refuses_to_start"),
        "--allow-keys on loopback is silently ignored (no CURVE, anyone with the token gets in)",
    ),
    Mutation(
        "map-bytes-never-freed", "gpufn/api/map_run.py",
        "        self.inflight_bytes -= self.sizes.pop(idx, 0)\n",
        "        self.sizes.pop(idx, 0)\n",
        (f"{IG}::test_a_map_over_more_bytes_than_its_window_returns_every_output_in_order",),
        "a map over more bytes than its window returns only the first window's outputs",
    ),
    Mutation(
        "map-bytes-window-ignored", "gpufn/api/map_run.py",
        "               and self.inflight_bytes < MAP_WINDOW_BYTES):\n",
        "               ):\n",
        (f"{IG}::test_a_map_over_more_bytes_than_its_window_returns_every_output_in_order",),
        "a map submits every call at once, whatever the bytes of its arguments",
    ),
    # ---- issue 23, beyond the list: one-line bugs in the modules the last release added
    # or reshaped (fencing, recovery, retries, CURVE, apps, cache, streams, usage, ops,
    # sharded models, interfaces, supervisor, maps, model book)
    Mutation(
        'fence-admits-fenced-generation', 'scheduler/fencing.py',
        '    if incarnation and incarnation <= d.fenced:\n',
        '    if incarnation and incarnation < d.fenced:\n',
        (f"{UF}::test_a_frozen_worker_is_fenced_and_its_late_messages_ignored", f"{UF}::test_a_fenced_control_channel_does_not_replace_the_current_one"),
        why='a worker of the generation that was fenced gets back in',
    ),
    Mutation(
        'fence-not-recorded', 'scheduler/core.py',
        '            d.fenced = max(d.fenced, d.incarnation)  # its late messages are ignored\n',
        '            pass\n',
        (f"{UF}::test_a_frozen_worker_is_fenced_and_its_late_messages_ignored", f"{UF}::test_a_fenced_control_channel_does_not_replace_the_current_one"),
        why='losing a worker does not fence its generation',
    ),
    Mutation(
        'fenced-hello-not-killed', 'scheduler/core.py',
        '                self.send(d.supervisor, p.KillWorker(key, msg.pid, "a fenced worker came back"))\n',
        '                pass\n',
        (f"{CG}::test_a_fenced_worker_that_comes_back_is_refused_and_its_supervisor_told_to_kill_it",),
        why='a fenced worker that comes back is refused but left running',
    ),
    Mutation(
        'exit-notice-old-pid-applied', 'scheduler/fencing.py',
        '             else d.worker is not None and msg.pid != d.worker_pid)\n',
        '             else False)\n',
        (f"{CG}::test_exit_notices_without_a_generation_are_judged_by_pid",),
        why='an exit notice without a generation about an old pid takes down the new worker',
    ),
    Mutation(
        'exit-notice-other-supervisor', 'scheduler/core.py',
        '        if d is None or d.supervisor != peer or fencing.stale_exit(d, msg):\n',
        '        if d is None or fencing.stale_exit(d, msg):\n',
        (f"{CG}::test_an_exit_notice_from_another_supervisor_is_not_applied",),
        why="one supervisor's exit notice is applied to another host's device",
    ),
    Mutation(
        'supervisor-restart-keeps-generations', 'scheduler/core.py',
        '                d.incarnation = d.fenced = 0  # generations are counted per supervisor\n',
        '                pass\n',
        (f"{CG}::test_a_restarted_supervisor_counts_generations_anew",),
        why="a restarted supervisor's first workers are refused as fenced",
    ),
    Mutation(
        'hello-incarnation-ignored', 'scheduler/core.py',
        '        d.incarnation = incarnation or d.incarnation + 1\n',
        '        d.incarnation = d.incarnation + 1\n',
        (f"{CG}::test_late_exit_notices_of_restarts_that_never_said_hello_spare_the_serving_worker",),
        why='the generation a worker says in Hello is ignored (counted by the scheduler instead)',
    ),
    Mutation(
        'recovery-same-instance-waits', 'scheduler/recovery.py',
        '        if info.resubmit and not same and now < self.began + self.grace:  # restarted\n',
        '        if info.resubmit and now < self.began + self.grace:  # restarted\n',
        (f"{UF}::test_a_client_forgotten_by_the_same_scheduler_resubmits_without_waiting",),
        why='a client forgotten by this same scheduler waits out the restart grace',
    ),
    Mutation(
        'recovery-grace-forever', 'scheduler/recovery.py',
        '        if info.resubmit and not same and now < self.began + self.grace:  # restarted\n',
        '        if info.resubmit and not same:  # restarted\n',
        (),
        equivalent="the grace is also checked when a call is submitted (`not_before` returns 0 once it is over), so remembering a late client's grace end changes nothing",
    ),
    Mutation(
        'recovery-no-grace-wait', 'scheduler/recovery.py',
        '        if until <= now:\n',
        '        if True:\n',
        (f"{UF}::test_a_resubmitted_call_a_worker_ran_fails_with_worker_lost_without_retries",),
        why='calls resubmitted after a restart start before the workers could say what they ran',
    ),
    Mutation(
        'recovery-forgets-early-reports', 'scheduler/recovery.py',
        '        return self.ran.pop(invocation_id, None) is not None\n',
        '        return False\n',
        (f"{UF}::test_a_worker_that_reports_before_the_resubmit_is_remembered",),
        why="a worker's report that came before the resubmit is forgotten (the call runs twice)",
    ),
    Mutation(
        'recovery-late-reports-ignored', 'scheduler/core.py',
        '                self.tx.lost_before_restart(self.invocations[inv_id], now)\n',
        '                pass\n',
        (f"{UF}::test_a_resubmitted_call_a_worker_ran_fails_with_worker_lost_without_retries",),
        why='a worker reporting after the resubmit does not mark the call lost',
    ),
    Mutation(
        'recovery-retries-one-too-few', 'scheduler/transitions.py',
        '        if inv.counted_attempts <= inv.spec.retries:\n            self.counters.retried += 1\n',
        '        if inv.counted_attempts < inv.spec.retries:\n            self.counters.retried += 1\n',
        (f"{UF}::test_a_resubmitted_call_a_worker_ran_fails_with_worker_lost_without_retries",),
        why='a call lost in a restart gets no retry with retries=1',
    ),
    Mutation(
        'recovery-memory-prunes-fresh', 'scheduler/recovery.py',
        '            self.ran = {k: t for k, t in self.ran.items() if now - t <= RAN_MEMORY_SECONDS}\n',
        '            self.ran = {}\n',
        (f"{CG}::test_a_workers_report_of_what_it_ran_is_remembered_for_minutes",),
        why='pruning old reports of what workers ran drops the recent ones too',
    ),
    Mutation(
        'raised-retries-one-too-few', 'scheduler/transitions.py',
        '                and inv.counted_attempts <= inv.spec.retries):\n',
        '                and inv.counted_attempts < inv.spec.retries):\n',
        (f"{USR}::test_retry_or_fail_requeues_with_backoff_until_retries_run_out",),
        why='Retries(n, on=...) gives n-1 retries',
    ),
    Mutation(
        'raised-retry-after-items', 'scheduler/transitions.py',
        '        if (not result.ok and result.meta.retryable and not inv.members and not inv.items\n',
        '        if (not result.ok and result.meta.retryable and not inv.members\n',
        (f"{USR}::test_a_streaming_call_is_never_retried_after_an_item",),
        why='a stream that delivered values is retried after it raised',
    ),
    Mutation(
        'raised-retry-ignores-judgement', 'scheduler/transitions.py',
        '        if (not result.ok and result.meta.retryable and not inv.members and not inv.items\n',
        '        if (not result.ok and not inv.members and not inv.items\n',
        (f"{USR}::test_not_retryable_or_int_retries_fail_at_once",),
        why='an exception Retries(on=...) does not match is retried',
    ),
    Mutation(
        'retry-forgets-lost-device', 'scheduler/transitions.py',
        '            inv.lost_on = lost_on\n',
        '            pass\n',
        (f"{UF}::test_retries_back_off_and_prefer_another_device",),
        why='a retry does not remember the device it was lost on',
    ),
    Mutation(
        'retry-no-backoff', 'scheduler/transitions.py',
        '                              else now + self.config.retry_delay(max(1, inv.counted_attempts)))\n',
        '                              else now)\n',
        (f"{UF}::test_retries_back_off_and_prefer_another_device",),
        why='a lost call is retried at once, without backoff',
    ),
    Mutation(
        'lost-retry-after-items', 'scheduler/transitions.py',
        '        if inv.counted_attempts <= inv.spec.retries and not inv.items:\n',
        '        if inv.counted_attempts <= inv.spec.retries:\n',
        (f"{CG}::test_a_stream_that_delivered_a_value_is_not_retried_when_its_worker_is_lost",),
        why='a stream that delivered values is retried when its worker is lost',
    ),
    Mutation(
        'backoff-not-doubling', 'scheduler/settings.py',
        '        return min(self.retry_backoff_max, self.retry_backoff_seconds * 2 ** max(0, min(retry - 1, 32)))\n',
        '        return min(self.retry_backoff_max, self.retry_backoff_seconds)\n',
        (f"{UF}::test_retries_back_off_and_prefer_another_device", f"{UF}::test_retry_delay_doubles_up_to_the_cap"),
        why='the lost-worker backoff does not double',
    ),
    Mutation(
        'spec-backoff-not-capped', 'gpufn/wire/spec.py',
        '    return min(spec.retry_max_delay, spec.retry_delay * spec.retry_backoff ** max(0, retry - 1))\n',
        '    return spec.retry_delay * spec.retry_backoff ** max(0, retry - 1)\n',
        (f"{USR}::test_retry_delay_and_retries_spec",),
        why='Retries(max_delay=...) does not cap the backoff',
    ),
    Mutation(
        'retry-same-device-first', 'scheduler/placement_pass.py',
        '            usable.sort(key=lambda d: d.key in inv.lost_on)\n',
        '            pass\n',
        (f"{UF}::test_retries_back_off_and_prefer_another_device",),
        why='a retry prefers the device it was lost on',
    ),
    Mutation(
        'gang-retry-same-devices', 'scheduler/placement_pass.py',
        '        if inv.lost_on and len(fresh) >= spec.count:  # a retry: away from where it was lost\n',
        '        if False:\n',
        (f"{CG}::test_a_retried_gang_moves_away_from_the_devices_it_was_lost_on",),
        why='a retried gang goes back to the devices it was lost on',
    ),
    Mutation(
        'preemption-does-not-count-as-attempt', 'scheduler/records.py',
        '        return self.attempts - self.preemptions - self.unstarted_losses\n',
        '        return self.attempts - self.unstarted_losses\n',
        (f"{CG}::test_a_preemption_does_not_count_against_retries",),
        why='a preemption uses up a retry',
    ),
    Mutation(
        'preempt-streamed-call', 'scheduler/placement_pass.py',
        '                        or victim.items):  # a stream that delivered values cannot restart\n',
        '                        ):\n',
        (f"{CG}::test_a_stream_that_delivered_a_value_is_never_preempted",),
        why='a stream that delivered values is preempted (it cannot restart)',
    ),
    Mutation(
        'key-mode-unchecked', 'gpufn/net/curve.py',
        '    if mode & (stat.S_IRWXG | stat.S_IRWXO):\n',
        '    if False:\n',
        (f"{USEC}::test_key_files_are_private_even_under_umask_0", f"{USEC}::test_client_key_file_is_used_and_checked"),
        why='a secret key readable by others is used',
    ),
    Mutation(
        'loopback-curve-never', 'gpufn/net/curve.py',
        '    return config.curve_forced() or not is_loopback(host)\n',
        '    return config.curve_forced()\n',
        (f"{USEC}::test_loopback_and_when_curve_is_needed", f"{USEC}::test_an_off_loopback_bind_needs_keys"),
        why='a bind off loopback runs without CURVE',
    ),
    Mutation(
        'curve-force-ignored', 'gpufn/net/curve.py',
        '    return config.curve_forced() or not is_loopback(host)\n',
        '    return not is_loopback(host)\n',
        (f"{USEC}::test_loopback_and_when_curve_is_needed",),
        why='GPUFN_CURVE=1 is ignored on loopback',
    ),
    Mutation(
        'allow-list-admits-anyone', 'gpufn/net/curve.py',
        '        ok = key in self.keys()\n',
        '        ok = True\n',
        (f"{PG}::test_the_allow_list_admits_only_its_keys_and_this_hosts_own",),
        why='the allow-list admits any key',
    ),
    Mutation(
        'allow-list-never-reread', 'gpufn/net/curve.py',
        '            if mtime != self._mtime:\n',
        '            if self._mtime == -1.0:\n',
        (f"{PG}::test_the_allow_list_admits_only_its_keys_and_this_hosts_own",),
        why='keys added to the allow-list folder are never seen',
    ),
    Mutation(
        'allow-list-local-key-dropped', 'gpufn/net/curve.py',
        '            extra.add(zmq.auth.load_certificate(str(local))[0])\n',
        '            pass\n',
        (f"{PG}::test_an_allow_list_admits_this_hosts_own_peers_by_their_local_key",),
        why="with --allow-keys the host's own supervisor and workers are refused",
    ),
    Mutation(
        'secret-key-mode-umask', 'gpufn/net/curve.py',
        '    os.chmod(secret, 0o600)\n',
        '    pass\n',
        (f"{PG}::test_a_secret_key_left_readable_is_made_private_when_the_pair_is_remade",),
        why='a remade secret key keeps the readable mode of a left-over file',
    ),
    Mutation(
        'key-dir-mode-kept', 'gpufn/net/curve.py',
        "    os.chmod(d, 0o700)  # mkdir's mode is masked by the umask, and an old folder keeps its own\n",
        '    pass\n',
        (f"{USEC}::test_key_files_are_private_even_under_umask_0",),
        why='the key folder keeps a mode that others may read',
    ),
    Mutation(
        'token-not-checked', 'scheduler/handshake.py',
        '    if token and not hmac.compare_digest(token.encode(), (msg.token or "").encode()):\n',
        '    if False:\n',
        (f"{UCORE}::test_handshake_refuses_bad_token_and_version",),
        why='a Hello with the wrong token is welcomed',
    ),
    Mutation(
        'role-table-skipped', 'scheduler/core.py',
        '            if known.role not in handshake.ROLES_ALLOWED[type(msg)]:\n',
        '            if False:\n',
        (f"{USR}::test_clients_may_not_send_items_and_strangers_may_not_credit", f"{UOPS}::test_only_clients_may_drain"),
        why='any role may send any message (a client sends Items, a worker drains)',
    ),
    Mutation(
        'deploy-unchanged-makes-version', 'scheduler/app_book.py',
        '            if cur is not None and cur.code_hash == code_hash:\n',
        '            if False:\n',
        (f"{UDEP}::test_alias_calls_bind_to_the_version_current_at_admission", f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-unchanged-code]"),
        why='deploying unchanged code makes a new version',
    ),
    Mutation(
        'deploy-alias-cache-stale', 'scheduler/app_book.py',
        '        self.store.add_version(v, functions)\n        self._resolved.clear()\n',
        '        self.store.add_version(v, functions)\n',
        (f"{UDEP}::test_alias_calls_bind_to_the_version_current_at_admission",),
        why='after a deploy, calls by name still resolve to the old version',
    ),
    Mutation(
        'stop-cancels-running', 'scheduler/app_book.py',
        '        n = self._stop_calls(app, now, f"app {app} was stopped", keep=None, cancel_running=False)\n',
        '        n = self._stop_calls(app, now, f"app {app} was stopped", keep=None, cancel_running=True)\n',
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-unchanged-code]", f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-changed-code]"),
        why='app stop cancels running calls instead of letting them finish',
    ),
    Mutation(
        'stop-releases-shared-models', 'scheduler/app_book.py',
        '        self._release |= keys - used_elsewhere\n',
        '        self._release |= keys\n',
        (f"{CG}::test_stopping_an_app_keeps_a_model_another_app_uses",),
        why='stopping an app evicts a model another app still uses',
    ),
    Mutation(
        'stop-evicts-models-in-use', 'scheduler/app_book.py',
        '                if e is None or e.pinned or e.in_use or (d.key, key) in self._evicting:\n',
        '                if e is None or e.pinned or (d.key, key) in self._evicting:\n',
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[while-running-unchanged-code]",),
        why='stopping an app evicts models its running calls still use (the tick raises)',
    ),
    Mutation(
        'stopped-app-still-callable', 'scheduler/app_book.py',
        '        if a.state != "active":\n',
        '        if False:\n',
        (f"{UDEP}::test_unknown_and_stopped_apps", f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-unchanged-code]"),
        why="a stopped app's functions can still be called",
    ),
    Mutation(
        'calls-1h-not-counted', 'scheduler/app_book.py',
        '            self._count(app, fn, now)\n',
        '            pass\n',
        (f"{UDEP}::test_a_new_scheduler_serves_what_the_last_one_deployed",),
        why='calls by name are not counted for `app list`',
    ),
    Mutation(
        'calls-1h-window-unbounded', 'scheduler/app_book.py',
        '        first = int(now // 60) - 59\n',
        '        first = 0\n',
        (f"{CG}::test_calls_in_the_last_hour_forget_older_calls",),
        why='`app list` counts calls older than an hour',
    ),
    Mutation(
        'recreate-keeps-old-queued', 'scheduler/app_book.py',
        '        if old is not None and v.strategy == "recreate":\n',
        '        if False:\n',
        (f"{UDEP}::test_recreate_fails_queued_calls_with_app_stopped",),
        why="--strategy recreate leaves the old version's calls queued and running",
    ),
    Mutation(
        'rollback-of-stopped-keeps-old', 'scheduler/app_book.py',
        '        return self._switch(v, functions, a.current if a.state == "active" else None, now)\n',
        '        return self._switch(v, functions, a.current, now)\n',
        (f"{CG}::test_a_rollback_of_a_stopped_app_leaves_the_calls_the_stop_let_finish",),
        why='a recreate rollback of a stopped app cancels the calls the stop let finish',
    ),
    Mutation(
        'fit-note-ignores-kept', 'scheduler/app_book.py',
        '        if not added or not caps or any(c >= kept + added for c in caps):\n',
        '        if not added or not caps or any(c >= added for c in caps):\n',
        (f"{CG}::test_a_deploy_says_drain_first_when_the_new_models_do_not_fit_beside_the_old",),
        why='a deploy whose models do not fit beside the old ones does not say drain first',
    ),
    Mutation(
        'pin-ignored', 'scheduler/app_book.py',
        '        v = version or a.current\n',
        '        v = a.current\n',
        (f"{UDEP}::test_alias_calls_bind_to_the_version_current_at_admission",),
        why='a call pinned to a version runs the current one',
    ),
    Mutation(
        'deploy-bad-spec-accepted', 'scheduler/app_book.py',
        '            make_spec(GpuSpec.from_wire(d["spec"]))  # a bad spec fails the deploy, not a call\n',
        '            pass\n',
        (f"{CG}::test_a_deploy_with_a_bad_spec_fails_and_adds_no_version",),
        why='a deploy with an invalid spec is accepted (and fails its calls later)',
    ),
    Mutation(
        'cache-dead-owner-kept', 'gpufn/api/cache.py',
        '            stale = not alive(owner["pid"])\n',
        '            stale = False\n',
        (f"{UCACHE}::test_a_dead_owners_claim_is_broken",),
        why='a claim whose owner died on this host is never broken',
    ),
    Mutation(
        'cache-lease-never-expires', 'gpufn/api/cache.py',
        '            stale = age > LEASE_S if owner else age > LEASE_S / 3\n',
        '            stale = False\n',
        (f"{UCACHE}::test_another_hosts_claim_is_broken_after_its_lease", f"{PG}::test_an_owner_whose_claim_was_taken_over_leaves_the_new_owners_claim"),
        why='a claim another host stopped touching is never broken',
    ),
    Mutation(
        'cache-no-retry-after-break', 'gpufn/api/cache.py',
        '        for _ in range(3):\n',
        '        for _ in range(1):\n',
        (f"{UCACHE}::test_a_dead_owners_claim_is_broken", f"{UCACHE}::test_another_hosts_claim_is_broken_after_its_lease"),
        why='a caller that broke a stale claim does not take it',
    ),
    Mutation(
        'cache-errors-cached', 'gpufn/api/cache.py',
        '            if res.ok and res.meta.gather is None:\n',
        '            if res.meta.gather is None:\n',
        (f"{UCACHE}::test_a_failed_call_is_not_cached_and_a_waiter_computes",),
        why='failed calls are cached',
    ),
    Mutation(
        'cache-no-recheck-after-claim', 'gpufn/api/cache.py',
        '            frames = self.store.read(key)  # stored between the read and the claim\n',
        '            frames = None\n',
        (f"{PG}::test_a_result_stored_between_the_lookup_and_the_claim_is_a_hit",),
        why='a result stored between the lookup and the claim is computed again',
    ),
    Mutation(
        'cache-no-single-flight-here', 'gpufn/api/cache.py',
        '            if fut is not None:  # the same call is already being resolved in this process\n',
        '            if False:\n',
        (f"{UCACHE}::test_identical_calls_compute_once",),
        why='identical calls in one process each compute',
    ),
    Mutation(
        'cache-submit-error-keeps-claim', 'gpufn/api/cache.py',
        '        except BaseException as e:\n            self.store.release(key)\n            fut.set_exception(e)\n            raise\n',
        '        except BaseException as e:\n            fut.set_exception(e)\n            raise\n',
        (f"{PG}::test_a_submit_that_raises_releases_its_claim",),
        why='a submit that raises leaves its claim: other callers wait forever',
    ),
    Mutation(
        'cache-call-error-keeps-claim', 'gpufn/api/cache.py',
        '        except BaseException as e:\n            self.store.release(key)\n            fut.set_exception(e)\n            return\n',
        '        except BaseException as e:\n            fut.set_exception(e)\n            return\n',
        (f"{PG}::test_a_call_that_ends_in_an_exception_releases_its_claim",),
        why='a call that ends in an exception leaves its claim: other callers wait forever',
    ),
    Mutation(
        'cache-key-ignores-bytecode', 'gpufn/api/cache.py',
        '        put(code.co_code)\n',
        '        pass\n',
        (f"{PG}::test_the_code_key_follows_operators_defaults_and_closure_values",),
        why='a change of operator (x+1 to x-1) keeps the cached results',
    ),
    Mutation(
        'cache-key-ignores-defaults', 'gpufn/api/cache.py',
        '        put(const(getattr(target, "__defaults__", None)))\n',
        '        pass\n',
        (f"{PG}::test_the_code_key_follows_operators_defaults_and_closure_values",),
        why='a change of a default argument keeps the cached results',
    ),
    Mutation(
        'cache-key-ignores-closure', 'gpufn/api/cache.py',
        '                put(const(cell.cell_contents))\n',
        '                pass\n',
        (f"{PG}::test_the_code_key_follows_operators_defaults_and_closure_values",),
        why='a change of a closure value keeps the cached results',
    ),
    Mutation(
        'cache-corrupt-file-read', 'gpufn/api/cache.py',
        '        if not data.startswith(_MAGIC):\n',
        '        if False:\n',
        (f"{PG}::test_a_result_file_that_is_not_ours_is_a_miss",),
        why='a result file that is not ours is read as a result',
    ),
    Mutation(
        'credit-window-off-by-one', 'worker/streaming.py',
        '            while not self.cancelled and seq >= self.allowed:\n',
        '            while not self.cancelled and seq > self.allowed:\n',
        (f"{USR}::test_driver_sends_a_window_then_waits_for_credit_and_stops_on_cancel",),
        why='a producer sends one value more than its credit',
    ),
    Mutation(
        'credit-may-shrink', 'worker/streaming.py',
        '            if allowed > self.allowed:\n',
        '            if True:\n',
        (f"{PG}::test_a_late_smaller_credit_never_shrinks_the_window",),
        why='a late, older Credit shrinks the window (the producer stalls)',
    ),
    Mutation(
        'credit-other-dispatch', 'worker/streaming.py',
        '        if flow is not None and dispatch_token in (0, flow.dispatch_token):\n',
        '        if flow is not None:\n',
        (f"{USR}::test_driver_sends_a_window_then_waits_for_credit_and_stops_on_cancel",),
        why='a Credit for another dispatch of the call is applied',
    ),
    Mutation(
        'interrupt-other-dispatch', 'worker/streaming.py',
        '        if flow is None or (dispatch_token and dispatch_token != flow.dispatch_token):\n',
        '        if flow is None:\n',
        (f"{PG}::test_a_cancel_for_another_dispatch_does_not_stop_a_stream",),
        why='a cancel for an earlier dispatch stops the current stream',
    ),
    Mutation(
        'all-ranks-stream', 'worker/streaming.py',
        '        sends = call.context.rank == 0\n',
        '        sends = True\n',
        (f"{USR}::test_driver_other_ranks_send_nothing_and_coroutines_run_on_one_loop",),
        why='every rank of a gang streams its values',
    ),
    Mutation(
        'stream-not-closed', 'worker/streaming.py',
        "                close()  # runs the generator's finally blocks when it stopped early\n",
        '                pass\n',
        (f"{USR}::test_driver_sends_a_window_then_waits_for_credit_and_stops_on_cancel",),
        why="a stopped stream's generator is not closed (its finally blocks do not run)",
    ),
    Mutation(
        'items-not-counted', 'scheduler/streams.py',
        '        inv.items += 1\n',
        '        pass\n',
        (f"{USR}::test_a_streaming_call_is_never_retried_after_an_item",),
        why='streamed values are not counted (a stream is retried after values)',
    ),
    Mutation(
        'items-from-any-rank', 'scheduler/streams.py',
        '                or msg.dispatch_token != inv.dispatch_token or inv.devices[0] != d.key):\n',
        '                or msg.dispatch_token != inv.dispatch_token):\n',
        (f"{CG}::test_only_rank_zero_values_of_a_gang_reach_the_caller",),
        why="values from a gang's other ranks reach the caller",
    ),
    Mutation(
        'items-any-dispatch', 'scheduler/streams.py',
        '                or msg.dispatch_token != inv.dispatch_token or inv.devices[0] != d.key):\n',
        '                or inv.devices[0] != d.key):\n',
        (f"{USR}::test_items_pass_through_in_order_and_credits_reach_the_worker",),
        why='values of an earlier dispatch reach the caller',
    ),
    Mutation(
        'credit-from-stranger', 'scheduler/streams.py',
        '        if inv is None or inv.client != peer or inv.state is not InvState.RUNNING or not inv.devices:\n',
        '        if inv is None or inv.state is not InvState.RUNNING or not inv.devices:\n',
        (f"{USR}::test_clients_may_not_send_items_and_strangers_may_not_credit",),
        why="a client may credit another client's stream",
    ),
    Mutation(
        'client-credit-stale', 'gpufn/api/calls.py',
        '            self._call._client.credit(self._call.id, self._read + p.STREAM_WINDOW)\n',
        '            self._call._client.credit(self._call.id, p.STREAM_WINDOW)\n',
        (f"{PG}::test_a_consumer_credits_what_it_read_plus_the_window",),
        why='the consumer credits a fixed window, not what it read plus the window',
    ),
    Mutation(
        'attach-live-not-watched', 'scheduler/streams.py',
        '            self.watchers.setdefault(msg.invocation_id, set()).add(peer)\n',
        '            pass\n',
        (f"{USR}::test_attach_gets_a_live_call_result_and_a_kept_one",),
        why='FunctionCall.from_id on a live call never gets its Result',
    ),
    Mutation(
        'keep-every-result', 'scheduler/streams.py',
        '        if keep:\n            self.keep.add(inv.id)\n',
        '        self.keep.add(inv.id)\n',
        (f"{USR}::test_attach_gets_a_live_call_result_and_a_kept_one",),
        why="every call's Result is kept, not only spawned calls'",
    ),
    Mutation(
        'attached-not-told', 'scheduler/streams.py',
        '            if peer != inv.client and peer in self.core.peers:\n',
        '            if False:\n',
        (f"{USR}::test_attach_gets_a_live_call_result_and_a_kept_one",),
        why='attached callers are not sent the Result',
    ),
    Mutation(
        'usage-no-bucket-split', 'scheduler/usage.py',
        '            edge = min(now, (int(t // BUCKET_S) + 1) * BUCKET_S)\n',
        '            edge = now\n',
        (f"{UOPS}::test_usage_meter_splits_device_time_over_minutes_and_counts_gangs",),
        why='device time is not spread over the minutes it covers',
    ),
    Mutation(
        'usage-since-ignored', 'scheduler/usage.py',
        '            if first is not None and b < first:\n',
        '            if False:\n',
        (f"{UOPS}::test_usage_meter_splits_device_time_over_minutes_and_counts_gangs",),
        why='usage --since is ignored',
    ),
    Mutation(
        'usage-retention-ignored', 'scheduler/usage.py',
        '                self._buckets.popitem(last=False)\n',
        '                break\n',
        (f"{PG}::test_the_usage_meter_forgets_what_is_older_than_its_retention",),
        why='usage older than its retention is kept forever',
    ),
    Mutation(
        'usage-batch-not-shared', 'scheduler/ops.py',
        '                share = held / len(inv.members)\n',
        '                share = held\n',
        (f"{CG}::test_a_batch_meters_its_device_time_once_shared_by_its_calls",),
        why="each call of a batch is metered the batch's whole device time",
    ),
    Mutation(
        'usage-batch-members-again', 'scheduler/ops.py',
        '            elif inv.carrier is None:\n',
        '            else:\n',
        (f"{CG}::test_a_batch_meters_its_device_time_once_shared_by_its_calls",),
        why="a batch's calls are metered again on their own",
    ),
    Mutation(
        'usage-wait-from-finish', 'scheduler/usage.py',
        '        wait = max(0.0, (started if started is not None else now) - submitted)\n',
        '        wait = max(0.0, now - submitted)\n',
        (f"{UOPS}::test_usage_meter_splits_device_time_over_minutes_and_counts_gangs",),
        why='queue wait is measured to the end of the call, not its start',
    ),
    Mutation(
        'usage-user-dropped', 'scheduler/core.py',
        '        inv.user = self.peers[peer].info.user\n',
        '        pass\n',
        (f"{UOPS}::test_ops_desk_keeps_output_meters_calls_by_user_and_drains",),
        why="usage by user loses the caller's user",
    ),
    Mutation(
        'drain-admits', 'scheduler/ops.py',
        '        if not self.draining:\n            return None\n',
        '        return None\n',
        (f"{UOPS}::test_ops_desk_keeps_output_meters_calls_by_user_and_drains",),
        why='a draining scheduler admits new calls',
    ),
    Mutation(
        'drain-keeps-queued', 'scheduler/ops.py',
        '            failed += 1\n',
        '            failed += 1\n            break\n',
        (f"{CG}::test_a_drain_drops_every_queued_call_and_a_second_drain_never_extends_the_grace",),
        why='a drain drops only the first queued call',
    ),
    Mutation(
        'drain-no-grace-end', 'scheduler/ops.py',
        '        return now >= self.drain_deadline or self.running() == 0\n',
        '        return self.running() == 0\n',
        (f"{UOPS}::test_drain_drops_queued_calls_and_ends_after_its_grace",),
        why='a drain waits for running calls past its grace',
    ),
    Mutation(
        'drain-extends-grace', 'scheduler/ops.py',
        '        self.drain_deadline = deadline if self.drain_deadline is None else min(deadline, self.drain_deadline)\n',
        '        self.drain_deadline = deadline\n',
        (f"{CG}::test_a_drain_drops_every_queued_call_and_a_second_drain_never_extends_the_grace",),
        why="a second drain extends the first one's grace",
    ),
    Mutation(
        'logs-not-kept', 'scheduler/ops.py',
        '        self.logs.add(inv.function.app, inv.function.name, msg.invocation_id, msg.stream,\n',
        '        (inv.function.app, inv.function.name, msg.invocation_id, msg.stream,\n',
        (f"{UOPS}::test_ops_desk_keeps_output_meters_calls_by_user_and_drains",),
        why='what calls print is not kept for `gpufn logs`',
    ),
    Mutation(
        'shards-valid-after-failure', 'scheduler/model_book.py',
        '        return h is not None and not h.failed and h.gang is not None and self.gangs.holds(h.devices, h.gang)\n',
        '        return h is not None and h.gang is not None and self.gangs.holds(h.devices, h.gang)\n',
        (),
        equivalent="a rank whose loader failed fails the call, which breaks the gang's group (`gangs.broken`), and shards of a broken group are invalid anyway; the flag only lets the sweep notice earlier, while the shards are still in use and cannot leave",
    ),
    Mutation(
        'shards-valid-after-group-left', 'scheduler/model_book.py',
        '        return h is not None and not h.failed and h.gang is not None and self.gangs.holds(h.devices, h.gang)\n',
        '        return h is not None and not h.failed and h.gang is not None\n',
        (f"{USH}::test_a_failed_gang_makes_its_shards_stale_and_the_next_call_reloads", f"{USH}::test_a_dead_rank_invalidates_the_shards_on_the_whole_gang"),
        why='shards tied to a group that is gone serve again',
    ),
    Mutation(
        'shard-loads-counted-per-rank', 'scheduler/model_book.py',
        '                lead = rec is None or rec.holder is None or rec.holder.devices[0] == d.key\n',
        '                lead = True\n',
        (f"{USH}::test_calls_go_to_the_gang_holding_the_shards_in_rank_order",),
        why="a sharded model's load is counted once per rank",
    ),
    Mutation(
        'shard-smaller-size-plans', 'scheduler/model_book.py',
        '                            nbytes = max(nbytes, rec.measured)  # the largest shard plans the gang\n',
        '                            pass\n',
        (f"{USH}::test_the_largest_shard_plans_the_gang",),
        why="a smaller shard's size plans the gang (the largest must)",
    ),
    Mutation(
        'shard-failure-not-marked', 'scheduler/model_book.py',
        "                    rec.holder.failed = True  # the other ranks' shards are partial: swept\n",
        '                    pass\n',
        (),
        equivalent='as for shards-valid-after-failure: the failed call breaks the group, which invalidates the shards by itself',
    ),
    Mutation(
        'shards-sweep-keeps-holder', 'scheduler/model_book.py',
        '            if not pending:\n                rec.holder = None\n',
        '            if False:\n                rec.holder = None\n',
        (f"{USH}::test_a_failed_gang_makes_its_shards_stale_and_the_next_call_reloads", f"{USH}::test_a_dead_rank_invalidates_the_shards_on_the_whole_gang"),
        why='swept shards keep their holder (the model is never loaded again)',
    ),
    Mutation(
        'shards-not-on-holding-gang', 'scheduler/model_book.py',
        '            if all(k in idle for k in h.devices):\n                return h.devices, ()\n',
        '            if False:\n                return h.devices, ()\n',
        (f"{USH}::test_calls_go_to_the_gang_holding_the_shards_in_rank_order", f"{USH}::test_eviction_takes_every_shard_and_a_restore_brings_them_all_back"),
        why='a call does not go to the gang holding its shards',
    ),
    Mutation(
        'shard-victim-alone', 'scheduler/model_book.py',
        '            if shards:  # a victim shard here takes its siblings on other devices along\n',
        '            if False:\n',
        (f"{USH}::test_a_single_device_call_that_evicts_a_shard_takes_the_whole_model",),
        why='evicting one shard leaves its siblings on the other devices',
    ),
    Mutation(
        'ifname-overrides-user', 'gpufn/net/interfaces.py',
        '    missing = [v for v in SOCKET_IFNAME_VARS if not current.get(v)]\n',
        '    missing = list(SOCKET_IFNAME_VARS)\n',
        (f"{UHOSTS}::test_socket_ifname_env_keeps_what_the_user_set",),
        why='GLOO/NCCL_SOCKET_IFNAME set by the user is overridden',
    ),
    Mutation(
        'ifname-wildcard-host', 'gpufn/net/interfaces.py',
        '    return None if host in ("", "*", "0.0.0.0", "::") else host\n',
        '    return host or None\n',
        (f"{UHOSTS}::test_scheduler_host_parses_tcp_addresses_only",),
        why='a wildcard scheduler address (0.0.0.0) is taken for a route',
    ),
    Mutation(
        'ifname-unknown-interface', 'gpufn/net/interfaces.py',
        '    if r.ifname is None:\n',
        '    if False:\n',
        (f"{UHOSTS}::test_socket_ifname_env_leaves_ipc_and_unknown_routes_alone",),
        why='an address no interface holds gives a bogus interface name',
    ),
    Mutation(
        'ifname-ipv6-ignored', 'gpufn/net/interfaces.py',
        '        return ipv6().get(str(ip))\n',
        '        return None\n',
        (f"{UHOSTS}::test_interface_of_maps_the_source_address_to_its_interface",),
        why='an IPv6 route to the scheduler finds no interface',
    ),
    Mutation(
        'supervisor-net-env-dropped', 'worker/supervisor.py',
        '        env.update(self.net_env)\n',
        '        pass\n',
        (f"{PG}::test_workers_get_the_interface_that_reaches_the_scheduler",),
        why='workers do not get the interface that reaches the scheduler',
    ),
    Mutation(
        'supervisor-served-counts-failure', 'worker/supervisor.py',
        '            if slot.kill_reason or slot.served:  # it started fine: not a crash loop\n',
        '            if slot.kill_reason:  # it started fine: not a crash loop\n',
        (f"{USUP}::test_workers_that_served_and_were_killed_never_make_it_give_up", f"{USUP}::test_failures_to_start_give_up_then_try_again_later"),
        why='a worker that served and was killed counts as a failure to start',
    ),
    Mutation(
        'supervisor-no-backoff', 'worker/supervisor.py',
        '                slot.restart_at = now + RESTART_BACKOFF.delay(slot.fast_failures - 1)\n',
        '                slot.restart_at = now\n',
        (f"{PG}::test_failures_to_start_back_off_more_each_time",),
        why='a worker failing to start is restarted at once, in a tight loop',
    ),
    Mutation(
        'supervisor-kills-successor', 'worker/supervisor.py',
        '        if msg.pid and slot.proc.pid != msg.pid:\n',
        '        if False:\n',
        (f"{PG}::test_a_kill_order_for_an_older_process_spares_its_successor",),
        why='a kill order for an older process kills its successor',
    ),
    Mutation(
        'supervisor-serving-any-pid', 'worker/supervisor.py',
        '        if slot is not None and slot.proc is not None and slot.proc.pid == msg.pid:\n',
        '        if slot is not None and slot.proc is not None:\n',
        (f"{PG}::test_a_serving_notice_for_an_older_process_is_not_applied",),
        why='a serving notice for an older process marks the new one as serving',
    ),
    Mutation(
        'supervisor-give-up-resets', 'worker/supervisor.py',
        '                slot.fast_failures = GIVE_UP_AFTER - 1  # one more failure gives up again\n',
        '                slot.fast_failures = 0\n',
        (f"{USUP}::test_failures_to_start_give_up_then_try_again_later",),
        why='after giving up, a still-broken device takes 5 more failures to give up again',
    ),
    Mutation(
        'supervisor-notice-no-generation', 'worker/supervisor.py',
        '                self._send(p.WorkerExited(key, proc.pid, rc, reason, slot.incarnation))\n',
        '                self._send(p.WorkerExited(key, proc.pid, rc, reason))\n',
        (f"{USUP}::test_workers_that_served_and_were_killed_never_make_it_give_up",),
        why='exit notices carry no generation',
    ),
    Mutation(
        'map-count-window-ignored', 'gpufn/api/map_run.py',
        '        while (not self.exhausted and len(self.calls) + len(batch) < self.window\n',
        '        while (not self.exhausted\n',
        (f"{IG}::test_a_map_over_more_bytes_than_its_window_returns_every_output_in_order[calls]",),
        why='a map submits every call at once, whatever GPUFN_MAP_WINDOW says',
    ),
    Mutation(
        'replan-forever', 'scheduler/model_book.py',
        '        return not msg.ok and msg.error_kind == kind_of(OutOfMemory) and inv.replans == 0\n',
        '        return not msg.ok and msg.error_kind == kind_of(OutOfMemory)\n',
        (f"{CG}::test_a_call_is_planned_again_once_when_its_model_is_larger_than_declared",),
        why='a call whose model keeps turning out larger is planned again and again',
    ),
    Mutation(
        'swap-thrash', 'scheduler/model_book.py',
        '            if swapping and (plan.load or plan.restore or plan.victims):\n',
        '            if False:\n',
        (f"{CG}::test_one_model_swap_at_a_time_per_device",),
        why='a second model swap starts on a device while one is under way (thrash)',
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
    if m.equivalent:
        return "equivalent", 0.0, m.equivalent
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
    counts = {o: sum(1 for _, x, _, _ in rows if x == o) for o in ("killed", "equivalent")}
    print(f"\n{len(rows)} mutations: {counts['killed']} killed, {counts['equivalent']} equivalent, "
          f"{len(rows) - sum(counts.values())} not killed")
    bad = [m.name for m, outcome, _, _ in rows if outcome not in ("killed", "equivalent")]
    if bad:
        print(f"\nnot killed: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
