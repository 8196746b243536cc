"""The mutations `scripts/mutate.py` applies: the table type, the test files they name, and
the mutations of the first releases and of issue 23's list (the rules of the last release).
The other modules' mutations are in `mutations_scheduler.py` and `mutations_edges.py`."""

from __future__ import annotations

from dataclasses import dataclass

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


LISTED: tuple[Mutation, ...] = (
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
        "model-no-wait-for-holder", "scheduler/books/model_book.py",
        "                    return None  # it will be free there sooner than a copy could load here\n",
        "                    pass\n",
        (f"{G}::test_a_call_waits_for_the_device_holding_its_model",),
        "placement loads a second copy instead of waiting for the device holding the model",
    ),
    Mutation(
        "queue-no-aging", "scheduler/books/queues.py",
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
        "retries-one-too-few", "scheduler/calls/transitions.py",
        "        if inv.counted_attempts <= inv.spec.retries and not inv.items:\n",
        "        if inv.counted_attempts < inv.spec.retries and not inv.items:\n",
        ("tests/integration/test_call_path.py::test_retries_run_the_call_again_elsewhere",),
        "retries=N gives N-1 retries",
    ),
    Mutation(
        "retries-one-too-many", "scheduler/calls/transitions.py",
        "        if inv.counted_attempts <= inv.spec.retries and not inv.items:\n",
        "        if inv.counted_attempts <= inv.spec.retries + 1 and not inv.items:\n",
        (f"{G}::test_retries_stop_after_the_last_attempt",),
        "retries=N gives N+1 retries",
    ),
    Mutation(
        "gang-root-cause-inverted", "scheduler/books/gang_verdict.py",
        '    own = [f for f in fails if not f[1].meta.comm_error]\n',
        '    own = [f for f in fails if f[1].meta.comm_error]\n',
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
        "rendezvous-no-nonce", "scheduler/books/gang_book.py",
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
        "embedded-shares-the-state-dir", "gpufn/cluster/embedded.py",
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
        "retry-of-an-exception-warns", "scheduler/calls/transitions.py",
        "            raised = not_before is not None\n",
        "            raised = False\n",
        (f"{E}::test_a_retried_exception_is_not_a_warning_and_states_its_delay_once",),
        "each retry of a raised exception is a WARNING in the user's terminal",
    ),
    Mutation(
        "killed-worker-warns-late", "worker/supervisor/daemon.py",
        "            level = logging.INFO if slot.kill_reason else logging.WARNING\n",
        "            level = logging.WARNING\n",
        (f"{E}::test_nothing_is_printed_after_the_scripts_last_line",),
        "the supervisor's note of a worker the scheduler killed trails the script's last line",
    ),
    Mutation(
        "unschedulable-no-setting-named", "scheduler/placement/device_fit.py",
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
        "eviction-policy-env-ignored", "scheduler/nouns/settings.py",
        '        policy = c.env_str("GPUFN_EVICTION_POLICY", "cost") or "cost"\n',
        '        policy = "cost"\n',
        (f"{R}::test_lru_count_eviction_policy_from_the_environment",),
        "GPUFN_EVICTION_POLICY is ignored",
    ),
    # ---- issue 23: the rules of the last release that no test held
    Mutation(
        "fencing-stale-by-fenced", "scheduler/peers/fencing.py",
        "    stale = (msg.incarnation < d.incarnation if msg.incarnation\n",
        "    stale = (msg.incarnation <= d.fenced if msg.incarnation\n",
        (f"{CG}::test_late_exit_notices_of_restarts_that_never_said_hello_spare_the_serving_worker",),
        "a late exit notice of a restart that never said Hello takes down the serving worker",
    ),
    Mutation(
        "fencing-stale-unless-current", "scheduler/peers/fencing.py",
        "    stale = (msg.incarnation < d.incarnation if msg.incarnation\n",
        "    stale = (msg.incarnation != d.incarnation if msg.incarnation\n",
        (f"{CG}::test_in_order_exit_notices_of_restarts_that_never_said_hello_are_applied",),
        "exit notices of generations newer than the last Hello (the supervisor gave up) are ignored",
    ),
    Mutation(
        "recovery-charges-twice", "scheduler/calls/transitions.py",
        "        if inv.state is not InvState.QUEUED or inv.attempts:\n",
        "        if inv.state is not InvState.QUEUED:\n",
        (f"{CG}::test_a_call_lost_here_is_not_charged_again_when_its_worker_re_registers_listing_it",),
        "a call lost and requeued here is charged again when its worker re-registers listing it",
        equivalent="a second line: SchedulerCore._recovered makes the same check before the "
                   "report reaches lost_before_restart, and a suspect decided at the hold's end "
                   "was never placed (nothing is, during the hold)",
    ),
    Mutation(
        "unstarted-loss-uses-retry", "scheduler/calls/transitions.py",
        "                inv.unstarted_losses += 1  # it never ran: queue it again, no retry used\n",
        "                pass\n",
        (f"{CG}::test_a_call_lost_while_its_model_loads_runs_again_without_a_retry",),
        "a call lost while its model loads spends a retry",
    ),
    Mutation(
        "clock-starts-while-model-loads", "scheduler/calls/transitions.py",
        "            if any(d.ledger.state(k) is not Residency.RESIDENT for k in inv.function.model_keys):\n",
        "            if any(d.ledger.state(k) is Residency.ABSENT for k in inv.function.model_keys):\n",
        (f"{CG}::test_a_call_lost_while_its_model_loads_runs_again_without_a_retry",),
        "a call counts as started (timeout clock, retries) while its model still loads",
    ),
    Mutation(
        "rollback-to-the-first", "scheduler/desks/app_book.py",
        "            target_n = older[-1].version\n",
        "            target_n = older[0].version\n",
        (f"{CG}::test_rollback_without_a_version_goes_to_the_version_before_the_current_one",),
        "a rollback without a version goes to v1, not the version before the current one",
    ),
    Mutation(
        "deploy-unchanged-leaves-stopped", "scheduler/desks/app_book.py",
        '                    self.store.set_state(msg.app, "active")\n',
        "                    pass\n",
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-unchanged-code]",),
        "deploying unchanged code to a stopped app leaves it stopped",
    ),
    Mutation(
        "deploy-changed-leaves-stopped", "scheduler/stores/deployments.py",
        "DO UPDATE SET current=excluded.current, state='active'\",",
        "DO UPDATE SET current=excluded.current\",",
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[after-eviction-changed-code]",),
        "deploying changed code to a stopped app adds a version but leaves the app stopped",
    ),
    Mutation(
        "restart-keeps-releasing-models", "scheduler/desks/app_book.py",
        "                    self._keep_models(self.store.functions(msg.app, current.current))\n",
        "                    pass\n",
        (f"{CG}::test_deploying_to_a_stopped_app_starts_it_again[while-running-unchanged-code]",),
        "a stopped app started again by an unchanged deploy still has its models evicted",
    ),
    Mutation(
        "usage-gang-counts-one-device", "scheduler/desks/ops.py",
        "            held = len(inv.devices)\n",
        "            held = 1\n",
        (f"{CG}::test_a_gang_call_is_metered_as_its_devices_times_its_run_time",
         f"{IG}::test_a_gang_call_is_metered_as_its_devices_times_its_run_time"),
        "a gang call on N devices is metered as one device",
    ),
    Mutation(
        "usage-counts-requeued-runs", "scheduler/desks/ops.py",
        "        if state is not InvState.QUEUED and not inv.members:\n",
        "        if not inv.members:\n",
        (f"{CG}::test_a_retried_call_counts_once_as_succeeded_with_both_runs_device_time",
         f"{CG}::test_a_preempted_call_counts_once_as_succeeded_with_both_runs_device_time"),
        "a retried or preempted call counts as two calls, one of them 'queued'",
    ),
    Mutation(
        "usage-drops-lost-runs", "scheduler/desks/ops.py",
        "        if started is not None and inv.devices:\n",
        "        if started is not None and inv.devices and state is not InvState.QUEUED:\n",
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
        "                    if nbytes > limit:\n",
        "                    if False:\n",
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
)
