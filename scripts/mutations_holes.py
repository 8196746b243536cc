"""Mutations of issue 18's holes: spawned calls that outlive their spawner and their kept
results, the forgotten-client hold, the cache lease, option bounds, owner-only files, a
call's child processes, worker sessions and the host-memory watch."""

from __future__ import annotations

from mutation_table import Mutation

HOLES: tuple[Mutation, ...] = (
    Mutation(
        "client-hello-no-hold", "gpufn/client/client.py",
        "                        self._outbox and not self._resubmit):\n",
        "                        self._outbox):\n",
        ("tests/unit/test_connection.py::test_calls_made_while_saying_hello_again_wait_for_their_functions",),
        "calls made while a forgotten client says Hello again reach the scheduler before their function",
    ),
    Mutation(
        "cache-lease-ignored-on-same-host", "gpufn/api/cache.py",
        '        if not stale and owner.get("host") == _HOST and isinstance(owner.get("pid"), int):\n',
        '        if owner.get("host") == _HOST and isinstance(owner.get("pid"), int):\n',
        ("tests/unit/test_cache.py::test_a_claim_of_a_live_unrelated_pid_on_this_host_is_broken_after_its_lease",
         "tests/unit/test_cache.py::test_a_waiter_behind_an_expired_same_host_claim_computes"),
        "a same-host claim with a live (reused) pid is never broken by its lease",
    ),
    Mutation(
        "spec-no-upper-bound", "gpufn/wire/spec.py",
        "    if maximum is not None and value > maximum:\n",
        "    if False:\n",
        ("tests/unit/test_spec.py::test_priority_far_out_of_range_names_the_bound",
         "tests/unit/test_spec.py::test_integer_options_are_bounded_everywhere"),
        "integer options have no upper bound (priority=10**30 overflows msgpack at submit)",
    ),
    Mutation(
        "deployments-db-not-private", "scheduler/stores/deployments.py",
        "                open_private(self.path)\n",
        "                self.path.parent.mkdir(parents=True, exist_ok=True)\n",
        ("tests/unit/test_deployments.py::test_the_store_and_its_wal_files_are_owner_only",),
        "the deployments database and its WAL files are created with the umask's mode (0644)",
    ),
    Mutation(
        "worker-log-not-private", "worker/supervisor/daemon.py",
        '        with os.fdopen(open_private_append(slot.log_path), "ab") as logf:\n',
        '        with open(slot.log_path, "ab") as logf:\n',
        ("tests/integration/test_security.py::test_worker_logs_are_owner_only",),
        "worker logs are created with the umask's mode (0644)",
    ),
    Mutation(
        "call-children-left-running", "worker/executor.py",
        "        if left:  # after the Result is on its way: stopping them may take a grace\n",
        "        if False:\n",
        ("tests/integration/test_call_children.py::test_a_sleep_the_call_started_is_stopped_when_it_ends",
         "tests/integration/test_call_children.py::test_a_forked_child_is_stopped_when_the_call_ends"),
        "processes a call started keep running after it ended",
    ),
    Mutation(
        "worker-session-leftovers-kept", "worker/supervisor/daemon.py",
        "        left = proc_table.in_session(pid)\n",
        "        left: list[int] = []\n",
        ("tests/integration/test_call_children.py::test_what_escapes_the_call_ends_when_the_worker_is_replaced",),
        "what a replaced worker's session still runs is left running",
    ),
    Mutation(
        "memory-watch-no-limit", "worker/host/memory_watch.py",
        "        if b is not None and limit and n > limit:\n",
        "        if False:\n",
        ("tests/unit/test_memory_watch.py::test_over_budget_names_the_limit_and_the_fix",
         "tests/integration/test_host_memory.py::test_a_worker_over_its_host_budget_is_replaced_and_its_call_fails_typed"),
        "a worker over its host-memory budget is never stopped",
    ),
    Mutation(
        "memory-watch-no-children", "worker/host/memory_watch.py",
        "            members = set(by_session.get(w.pid, [])) | {w.pid}\n",
        "            members = {w.pid}\n",
        ("tests/unit/test_memory_watch.py::test_a_session_over_its_budget_is_found_through_its_child",
         "tests/integration/test_host_memory.py::test_memory_of_a_calls_child_counts_and_the_child_is_stopped"),
        "the memory of a worker's children does not count",
    ),
    Mutation(
        "memory-declared-ignored", "worker/host/memory_watch.py",
        "        base = self.declared or self.default\n",
        "        base = self.default\n",
        ("tests/unit/test_memory_watch.py::test_a_limit_is_the_budget_or_the_declaration_plus_models_under_the_ceiling",
         "tests/integration/test_host_memory.py::test_a_function_declares_its_own_host_memory"),
        "@gpu(host_memory=) does not change the worker's limit",
    ),
    Mutation(
        "host-oom-retried", "scheduler/peers/membership.py",
        "        if msg.returncode == p.OUT_OF_HOST_MEMORY:  # its calls fail: a retry would grow again\n",
        "        if False:\n",
        ("tests/unit/test_faults.py::test_a_worker_stopped_over_its_host_memory_fails_its_calls_without_a_retry",),
        "calls of a worker stopped over its host memory are retried as lost (WorkerLost), untyped",
    ),
    Mutation(
        "detached-cancelled-with-spawner", "scheduler/core.py",
        "            if self.streams.outlives(inv):\n",
        "            if False:\n",
        ("tests/unit/test_kept_results.py::test_a_spawned_call_of_a_deployed_function_outlives_its_spawner",
         "tests/integration/test_detached.py::test_it_runs_to_its_end_and_its_result_is_found_later"),
        "a spawned call of a deployed function is cancelled when its spawner leaves",
    ),
    Mutation(
        "kept-results-not-on-disk", "scheduler/desks/streams.py",
        "        if inv.function.app:  # on disk: found after its spawner left, and after a restart\n",
        "        if False:\n",
        ("tests/unit/test_kept_results.py::test_kept_results_survive_a_new_scheduler",),
        "kept results of deployed functions' calls live in memory only (lost on a restart)",
    ),
    Mutation(
        "kept-results-any-user", "scheduler/desks/streams.py",
        "        return sees(self.core.peers.get(peer), owner)\n",
        "        return info is not None\n",
        ("tests/unit/test_kept_results.py::test_only_the_same_user_reads_or_cancels_it",),
        "another user reads (and cancels) a kept call",
    ),
    Mutation(
        "resubmit-runs-again", "scheduler/core.py",
        "        if self.streams.answer_again(peer, msg.invocation_id):\n",
        "        if False:\n",
        ("tests/unit/test_kept_results.py::test_a_resubmitted_call_that_ended_is_answered_not_run_again",),
        "a call sent again after it ended runs a second time",
    ),
    Mutation(
        "kept-results-never-expire", "scheduler/stores/kept_results.py",
        "            if wall - entry.ended <= self.retention:\n",
        "            if True:\n",
        ("tests/unit/test_kept_results.py::test_the_book_on_disk_is_owner_only_bounded_and_expires",),
        "kept results stay past their retention",
    ),
)
