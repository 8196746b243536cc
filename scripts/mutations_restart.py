"""Mutations of a head restart (issue 18 items 1 and 3): workers that outlive `gpufn serve`,
calls taken over rather than run again, held results, versions pinned at admission, and
the operator's books kept on disk; and the spawned calls of deployed functions whose
spawner left, admitted again by the next scheduler."""

from __future__ import annotations

from mutation_table import Mutation

T = "tests/integration/test_restart.py"
U = "tests/unit/test_restart.py"
UD = "tests/unit/test_detached_restart.py"

RESTART: tuple[Mutation, ...] = (
    Mutation(
        "restart-no-takeover", "scheduler/core.py",
        "        if isinstance(claim, Report) and self.adoption.adopt(inv, claim, now, queued=False):\n",
        "        if False:\n",
        (f"{U}::test_a_running_call_is_taken_over_not_run_again[True]",
         "tests/integration/test_faults.py::"
         "test_a_restarted_scheduler_takes_over_running_calls_and_runs_queued_ones"),
        "a resubmitted call a worker runs is not taken over (it counts as lost, or runs twice)",
    ),
    Mutation(
        "restart-held-not-asked-for", "scheduler/calls/adoption.py",
        "        if report.held:\n",
        "        if False:\n",
        (f"{U}::test_a_result_the_worker_holds_is_asked_for_again",),
        "a result a worker holds is never asked for again: its caller waits forever",
    ),
    Mutation(
        "worker-holds-no-results", "worker/process.py",
        "                        self.held.add(a.msg, run.attempt, output)\n",
        "                        pass\n",
        (f"{T}::test_a_head_restart_is_invisible_to_callers[serve-SIGKILL]",),
        "a result sent while the head was away is lost: the call runs again",
    ),
    Mutation(
        "worker-journals-nothing", "worker/process.py",
        "                        self.journal.started(inv)\n",
        "                        pass\n",
        (f"{T}::test_a_call_on_a_worker_that_died_during_the_outage_counts_as_lost",),
        "a worker that dies while the head is away takes what it ran with it: calls run twice",
    ),
    Mutation(
        "ran-decided-during-the-hold", "scheduler/calls/adoption.py",
        "        if self.recovery.holding(now):\n            self.recovery.suspects.add(inv.id)\n",
        "        if False:\n            self.recovery.suspects.add(inv.id)\n",
        (f"{U}::test_a_worker_that_runs_a_call_a_supervisor_said_ran_takes_it_over",),
        "a call said to have run is failed before the worker running its retry could say so",
    ),
    Mutation(
        "hold-never-ends-early", "scheduler/peers/membership.py",
        "        if self.recovery.device_ready(key):  # every device seen before the restart is back\n",
        "        if False:\n",
        (f"{U}::test_the_hold_ends_once_every_device_seen_before_is_back",),
        "resubmitted calls always wait the whole GPUFN_RESTART_GRACE",
    ),
    Mutation(
        "no-version-pins", "scheduler/desks/app_book.py",
        "            self._pin_in_flight(v.app)\n",
        "            pass\n",
        (f"{U}::test_a_call_keeps_the_version_that_admitted_it_across_a_restart",
         f"{T}::test_a_call_keeps_its_deployment_version_across_a_restart"),
        "a call in flight across a restart during a rolling update runs the new version",
    ),
    Mutation(
        "client-fails-on-a-restart", "gpufn/client/client.py",
        "            if msg.final:\n",
        "            if True:\n",
        (f"{T}::test_a_head_restart_is_invisible_to_callers[serve-SIGTERM]",
         f"{T}::test_retried_calls_wait_through_an_outage"),
        "a SIGTERMed head fails every outstanding call instead of letting it wait",
    ),
    Mutation(
        "worker-reports-no-models", "worker/model_cache.py",
        "        return [[key, nbytes] for key, nbytes in resident.items() if key not in sharded]\n",
        "        return []\n",
        (f"{T}::test_a_head_restart_is_invisible_to_callers[scheduler-SIGKILL]",),
        "after a restart the ledger thinks resident models are absent",
    ),
    Mutation(
        "usage-not-saved", "scheduler/desks/ops.py",
        "        rows = self.usage.take_dirty()\n",
        "        rows = []\n",
        (f"{U}::test_usage_and_logs_outlive_a_restart_in_a_0600_file",),
        "usage is lost when the scheduler restarts",
    ),
    Mutation(
        "supervisor-follows-serve", "gpufn/cluster/embedded.py",
        '            cmd += ["--head-grace", f"{self.head_grace:g}"]\n',
        '            cmd += ["--parent-pid", str(os.getpid())]\n',
        (f"{T}::test_a_head_restart_is_invisible_to_callers[serve-SIGKILL]",),
        "the head's workers die with gpufn serve",
    ),
    Mutation(
        "client-hello-never-again", "gpufn/client/client.py",
        "                if not self._resubmit or time.monotonic() - self._rehello_at > HELLO_AGAIN_SECONDS:\n",
        "                if not self._resubmit:\n",
        ("tests/unit/test_connection.py::test_a_hello_lost_with_a_dying_head_is_sent_again",),
        "a client whose new Hello died with the head never says Hello again (its calls wait out the grace)",
    ),
    Mutation(
        "logs-owner-not-saved", "scheduler/books/logs.py",
        "            ring.lines.append(Line(r.seq, r.at, r.invocation_id, r.stream, r.text, r.user))\n",
        "            ring.lines.append(Line(r.seq, r.at, r.invocation_id, r.stream, r.text))\n",
        ("tests/unit/test_restart.py::test_log_lines_keep_their_owner_across_a_restart",),
        "after a restart a user's log lines are no one's (only the admin reads them)",
    ),
    Mutation(
        "takeover-forgets-its-start", "scheduler/calls/transitions.py",
        "        inv.started = inv.run_started = now - max(0.0, ran_seconds)\n",
        "        inv.started = inv.run_started = now\n",
        ("tests/unit/test_restart.py::test_a_taken_over_call_is_billed_and_timed_from_its_real_start",),
        "a call taken over after a restart is billed and timed only from the restart",
    ),
    Mutation(
        "adopts-workers-of-other-options", "gpufn/cluster/head.py",
        '                    and old.get("workers") == self._worker_options()):\n',
        "                    ):\n",
        ("tests/integration/test_restart.py::"
         "test_a_restart_with_other_device_options_replaces_the_workers",),
        "gpufn serve adopts the previous workers although its device options changed",
    ),
    Mutation(
        "detached-not-noted", "scheduler/desks/streams.py",
        "                self._unsaved[inv.id] = inv  # noted on disk at the next save\n",
        "                pass\n",
        (f"{UD}::test_a_running_and_a_queued_call_are_admitted_again_and_run_once",
         f"{T}::test_a_spawned_call_whose_spawner_left_survives_a_head_restart"),
        "a spawned call whose spawner left is kept only in memory: a restart loses it",
    ),
    Mutation(
        "detached-not-readmitted", "scheduler/core.py",
        "            self._readmit(call, now)\n",
        "            pass\n",
        (f"{UD}::test_a_running_and_a_queued_call_are_admitted_again_and_run_once",),
        "the noted calls are never admitted again: queued ones vanish, running ones are orphans",
    ),
    Mutation(
        "detached-row-outlives-its-result", "scheduler/stores/kept_results.py",
        '            cur.execute("DELETE FROM calls WHERE id=?", (rid,))\n'
        '            cur.execute("DELETE FROM call_frames WHERE id=?", (rid,))\n'
        '            cur.execute("COMMIT")\n',
        '            cur.execute("COMMIT")\n',
        (f"{UD}::test_a_running_and_a_queued_call_are_admitted_again_and_run_once",),
        "a call whose Result is kept stays noted (the book grows; only the kept-result check "
        "keeps it from running again)",
    ),
    Mutation(
        "detached-ended-runs-again", "scheduler/calls/recovery.py",
        "            (ended if c.invocation_id in results else calls).append(c)\n",
        "            calls.append(c)\n",
        (f"{UD}::test_a_noted_call_whose_result_is_kept_is_not_run_again",),
        "a noted call whose Result was kept before its row left runs a second time",
    ),
    Mutation(
        "detached-resubmit-not-rebound", "scheduler/desks/streams.py",
        "            inv.client = peer\n",
        "            pass\n",
        (f"{UD}::test_a_spawner_that_resubmits_it_too_gets_the_one_call",),
        "a spawner that resubmits a call admitted again never gets its Result",
    ),
    Mutation(
        "detached-readmitted-without-hold", "scheduler/core.py",
        "            self._admit(inv, True, hold, now)\n",
        "            self._admit(inv, True, 0.0, now)\n",
        (f"{UD}::test_a_readmitted_call_waits_for_the_hold",),
        "a call admitted again is placed before its worker could say it runs it: it runs twice",
    ),
    Mutation(
        "detached-shutdown-runs-again", "scheduler/desks/streams.py",
        "        if final:\n            for inv_id in [*self._saved, *self._unsaved]:\n",
        "        if False:\n            for inv_id in [*self._saved, *self._unsaved]:\n",
        (f"{UD}::test_after_a_final_stop_calls_not_ended_are_not_admitted_again",),
        "after a final stop a call that was running is admitted again and runs a second time",
    ),
    Mutation(
        "detached-not-durable", "scheduler/desks/streams.py",
        "            if self.durable and inv.function.app:\n",
        "            if inv.function.app:\n",
        (f"{UD}::test_a_scheduler_that_is_not_durable_notes_nothing",),
        "an embedded scheduler (whose workers die with it) notes calls a later one runs again",
    ),
    Mutation(
        "requeued-suspect-cancelled", "scheduler/calls/adoption.py",
        "            if (inv.state is InvState.QUEUED and inv.attempts and isinstance(claim, Report)\n",
        "            if (False and isinstance(claim, Report)\n",
        (f"{UD}::test_a_requeued_suspect_whose_worker_reports_it_late_is_taken_over",),
        "a call counted as lost and queued again has its live run stopped when its worker "
        "reports it late",
    ),
    Mutation(
        "detached-pin-left", "scheduler/desks/app_book.py",
        "        if self._pins.pop(invocation_id, None) is not None:\n"
        "            self.store.unpin(invocation_id)\n"
        "        return self._record_by_id(function_id)\n",
        "        return self._record_by_id(function_id)\n",
        (f"{UD}::test_it_keeps_its_version_through_a_rolling_update_and_a_restart",),
        "a call admitted again keeps its saved version binding forever (saved again at "
        "each version change)",
    ),
    Mutation(
        "worker-refused-rehello-never-again", "worker/process.py",
        "        self._hello_again_at = time.monotonic() + HELLO_RETRY_SECONDS\n",
        "        pass\n",
        ("tests/integration/test_worker_rehello.py::"
         "test_a_worker_refused_on_its_hello_again_says_it_again",),
        "a worker refused on its Hello to a restarted scheduler (its supervisor not back yet) "
        "stays unregistered: the device is 'starting' for ever",
    ),
)
