"""Mutations of the hot path (issue 20): the placement pass's early end, the compiled
header checks, same-host shared memory (and its pool of argument files), the globals
fingerprint, the placement index of open devices and the model plan search (the
scheduler at scale), streams in bursts (order, credit, the outbox's wake-up, the
bytes bound), and warm gangs (inline ranks, unread rank values, the formation's
backend and spec)."""

from __future__ import annotations

from mutation_table import Mutation

HOTPATH: tuple[Mutation, ...] = (
    Mutation(
        "placement-stops-before-backfill", "scheduler/placement/placement_pass.py",
        "        self._backfill_checked, self._backfill_possible = r, possible\n        return not possible\n",
        "        self._backfill_checked, self._backfill_possible = r, possible\n        return True\n",
        ("tests/unit/test_scheduler_gangs.py::"
         "test_head_gang_reserves_draining_devices_and_only_short_calls_backfill",),
        "a pass ends at a gang's reservation although a short call could backfill",
    ),
    Mutation(
        "pipeline-depth-ignores-runtime", "scheduler/placement/device_fit.py",
        "    return min(most, max(MIN_PIPELINE_DEPTH, fits))\n",
        "    return MIN_PIPELINE_DEPTH\n",
        ("tests/unit/test_scheduler_policies.py::"
         "test_short_calls_pipeline_about_two_ms_of_work_at_a_worker",),
        "very short calls queue only two deep at a worker, so a map waits on round trips",
    ),
    Mutation(
        "plan-bound-counts-resident-models-as-loads", "scheduler/books/model_book.py",
        "                        t, waiting = 0.0, waiting + (e.state is Residency.LOADING)\n",
        "                        t, waiting = load_s, waiting + (e.state is Residency.LOADING)\n",
        ("tests/unit/test_open_index.py::"
         "test_the_plan_search_s_bound_skips_only_devices_that_cannot_win",),
        "the plan search skips a device that holds the models, loading a second copy elsewhere",
    ),
    Mutation(
        "plan-bound-off", "scheduler/books/model_book.py",
        "                        workspace + load_b + restore_b - d.ledger.free, d.key) > best[0]:\n",
        "                        workspace + load_b + restore_b - d.ledger.free, d.key) > best[0] and False:\n",
        ("tests/unit/test_open_index.py::"
         "test_a_model_call_among_equal_devices_fits_one_ledger_not_all",),
        "every candidate is fitted: 1,000 ledger fits per model call at 1,024 devices",
    ),
    Mutation(
        "header-check-skips-a-field", "gpufn/wire/codec.py",
        "            tests.append(f\"isinstance(v{i}, k{i})\")\n",
        "            tests.append(\"True\") if i == len(checks) - 1 else tests.append(f\"isinstance(v{i}, k{i})\")\n",
        ("tests/unit/test_protocol.py::test_every_field_of_the_wrong_type_is_refused",),
        "the compiled header check lets an ill-typed last field through to the handlers",
    ),
    Mutation(
        "shm-arguments-never-released", "gpufn/client/client.py",
        "            shm.release(entry[0], self.shm_reusable(meta))\n",
        "            pass\n",
        ("tests/integration/test_shm.py::test_a_call_cancelled_before_it_ran_frees_its_arguments",),
        "a call cancelled before a worker read its shared-memory arguments leaks the file",
    ),
    Mutation(
        "shm-no-sweep", "worker/supervisor/daemon.py",
        "                    shm.sweep()\n",
        "                    pass\n",
        ("tests/integration/test_shm.py::test_files_of_a_caller_that_died_are_removed",
         "tests/integration/test_shm.py::test_a_killed_caller_s_pooled_files_are_removed"),
        "the shared-memory files of a caller that died (its pooled ones too) are never removed",
    ),
    Mutation(
        "shm-receiver-keeps-file", "gpufn/wire/shm.py",
        "        if not pooled:\n            try:\n                os.unlink(path)\n",
        "        if False:\n            try:\n                os.unlink(path)\n",
        ("tests/integration/test_shm.py::"
         "test_a_kept_argument_is_never_written_again_and_its_result_is_a_copy",),
        "a received shared-memory payload's file stays after the call",
    ),
    Mutation(
        "shm-pool-reuses-a-file-still-viewed", "gpufn/wire/shm.py",
        "    freed = [b.name for b in lent if not b.used and b.lease() is None]\n",
        "    freed = [b.name for b in lent if not b.used]\n",
        ("tests/integration/test_shm.py::"
         "test_a_kept_argument_is_never_written_again_and_its_result_is_a_copy",
         "tests/unit/test_shm_pool.py::"
         "test_a_worker_reports_only_the_files_nothing_views_and_copies_one_still_viewed"),
        "an argument file the function kept a view of is written again for the next call",
    ),
    Mutation(
        "shm-result-names-a-kept-argument", "gpufn/wire/shm.py",
        "        if b.used and b.lease() is not None and b.mm is not None and out is not None:\n",
        "        if False:\n",
        ("tests/integration/test_shm.py::"
         "test_a_kept_argument_is_never_written_again_and_its_result_is_a_copy",),
        "a result sent back in an argument file the worker still views changes with it",
    ),
    Mutation(
        "shm-result-written-over-a-kept-argument", "gpufn/wire/shm.py",
        "                      and view.nbytes <= b.size <= 2 * view.nbytes and b.lease() is None), None)\n",
        "                      and view.nbytes <= b.size <= 2 * view.nbytes), None)\n",
        ("tests/integration/test_shm.py::"
         "test_a_kept_argument_is_never_written_again_and_its_result_is_a_copy",),
        "a new result is written into the file of an argument the function kept",
    ),
    Mutation(
        "shm-result-file-not-held-for-reading", "gpufn/client/client.py",
        "                shm.hold(set(entry[0]) & set(meta.shm))\n",
        "                pass\n",
        ("tests/integration/test_shm.py::"
         "test_an_argument_file_carries_the_result_back_and_is_reused",),
        "a result in a pooled argument file is freed (and may be reused) before it is read",
    ),
    Mutation(
        "shm-pool-reused-after-a-retry", "gpufn/client/client.py",
        "        if meta is None or len(meta.devices) > 1 or meta.attempts > 1:\n",
        "        if meta is None or len(meta.devices) > 1:\n",
        ("tests/integration/test_shm.py::"
         "test_a_worker_that_died_with_the_argument_mapped_leaves_no_file",),
        "an argument file a dead attempt's worker mapped is reused (another may still map it)",
    ),
    Mutation(
        "shm-pool-viewed-file-freed", "gpufn/wire/shm.py",
        "            if seg.busy or seg.views or seg.holds or self._used.get(seg.name) is not seg:\n",
        "            if seg.busy or seg.holds or self._used.get(seg.name) is not seg:\n",
        ("tests/unit/test_shm_pool.py::"
         "test_a_result_read_before_its_call_ends_keeps_the_file",),
        "a pooled file is written again while a result tensor still views it",
    ),
    Mutation(
        "shm-pool-never-idles-out", "gpufn/wire/shm.py",
        "                self._free.append(seg)\n                self._arm()\n",
        "                self._free.append(seg)\n",
        ("tests/unit/test_shm_pool.py::test_free_files_go_when_idle_over_the_cap_or_cleared",),
        "free pooled files are kept for ever (their memory is never given back while it runs)",
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
        "index-walk-stops-at-first-device", "scheduler/placement/open_index.py",
        "                if drain + lo > best[0]:\n",
        "                if True:\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "single-device choice takes the first usable device by drain, ignoring run times",
    ),
    Mutation(
        "index-skips-equal-drains-with-unequal-run-times", "scheduler/placement/open_index.py",
        "                if uniform and drain == best_drain:\n",
        "                if drain == best_drain:\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "devices draining as soon as the best are skipped although this call runs faster there",
    ),
    Mutation(
        "index-update-keeps-old-entry", "scheduler/placement/open_index.py",
        "            del lst[bisect.bisect_left(lst, old)]\n",
        "            pass\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "a device moved in the index keeps its old place too (chosen by its old load)",
    ),
    Mutation(
        "placement-index-not-moved-after-dispatch", "scheduler/placement/placement_pass.py",
        "                    self._index.update(d, still)\n",
        "                    pass\n",
        ("tests/unit/test_open_index.py::test_a_pass_places_by_the_load_its_own_dispatches_left",),
        "a pass keeps choosing by the load devices had before its own dispatches",
    ),
    Mutation(
        "estimate-bounds-never-refreshed", "scheduler/placement/open_index.py",
        "    if got is not None and got[0] == stamp:\n",
        "    if got is not None:\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "the walk's lower bound is kept after the function's run times changed",
    ),
    Mutation(
        "plan-search-stops-at-equal-drain", "scheduler/books/model_book.py",
        "                if ordered and drain > best[0][0]:\n",
        "                if ordered and drain >= best[0][0]:\n",
        ("tests/unit/test_open_index.py::test_the_ordered_plan_search_finds_the_full_search_s_plan",),
        "a model call's search stops before devices whose drain ties the best expected time",
    ),
    Mutation(
        "plan-search-skips-every-cold-device", "scheduler/books/model_book.py",
        "                if (drain + least, (load_b, restore_b, waiting, 0.0, 0), len(d.running),\n",
        "                if least > 0 or (drain + least, (load_b, restore_b, waiting, 0.0, 0), len(d.running),\n",
        ("tests/unit/test_open_index.py::test_the_ordered_plan_search_finds_the_full_search_s_plan",),
        "once a plan is found, devices that must load a model are never planned",
    ),
    Mutation(
        "fit-cache-ignores-ledger-version", "scheduler/books/model_book.py",
        "        if got is not None and got[0] == version:\n",
        "        if got is not None:\n",
        ("tests/unit/test_open_index.py::test_a_remembered_fit_is_not_used_once_the_ledger_changed",),
        "a remembered fit is used after the device's ledger changed",
    ),
    Mutation(
        "burst-out-of-order", "worker/streaming.py",
        "                self._batches.append(b)\n",
        "                self._batches.insert(0, b)\n",
        ("tests/unit/test_stream_bursts.py::test_a_burst_goes_as_one_item_of_one_frame_and_a_big_value_alone_in_order",),
        "a call's Items leave the worker's outbox newest first (values out of order)",
    ),
    Mutation(
        "outbox-tells-once-only", "worker/streaming.py",
        "                self._told = False  # the next value tells again\n                if not self._batches:\n                    return []\n",
        "                if not self._batches:\n                    return []\n                self._told = False\n",
        ("tests/unit/test_stream_bursts.py::test_the_first_value_after_a_drain_of_one_call_and_an_empty_drain_wakes_again",
         "tests/integration/test_streaming.py::test_first_value_arrives_long_before_the_generator_ends"),
        "after a call's values left with its Result, the next stream's values wait for a timer",
    ),
    Mutation(
        "burst-split-reversed", "gpufn/client/items.py",
        "        out.append((item.seq + k, (buf[i:i + n],)))\n",
        "        out.insert(0, (item.seq + k, (buf[i:i + n],)))\n",
        ("tests/unit/test_stream_bursts.py::test_the_worker_sends_bursts_that_the_client_reads_in_order",),
        "the client reads a burst's values in the wrong order",
    ),
    Mutation(
        "stream-bytes-unbounded", "worker/streaming.py",
        "        return self.sent_bytes - self.read_bytes >= p.STREAM_BYTES and bool(self.unread)\n",
        "        return False\n",
        ("tests/unit/test_stream_bursts.py::test_a_producer_of_big_values_keeps_few_unread",),
        "a stream of big values keeps a whole window of them unread",
    ),
    Mutation(
        "credit-only-when-drained", "gpufn/api/calls.py",
        "        if unread >= CREDIT_EVERY and (not self._items or unread >= CREDIT_MOST):\n",
        "        if unread >= CREDIT_EVERY and not self._items:\n",
        ("tests/unit/test_stream_bursts.py::test_a_consumer_credits_in_values_once_per_burst_and_while_values_wait",),
        "a consumer with values waiting never credits: the producer stops a window ahead",
    ),
    Mutation(
        "credit-fast-path-ignores-window", "worker/streaming.py",
        "        if not self.cancelled and seq < self.allowed and not self._over_bytes():\n",
        "        if not self.cancelled and not self._over_bytes():\n",
        ("tests/unit/test_streams_retries.py::"
         "test_driver_sends_a_window_then_waits_for_credit_and_stops_on_cancel",
         "tests/unit/test_stream_bursts.py::test_the_worker_sends_bursts_that_the_client_reads_in_order"),
        "the producer's lock-free check lets it run past its credit",
    ),
    Mutation(
        "scheduler-counts-a-burst-once", "scheduler/desks/streams.py",
        "        inv.items += msg.values()  # a burst's values come (and are relayed) as one Item\n",
        "        inv.items += 1\n",
        ("tests/unit/test_streams_retries.py::"
         "test_the_scheduler_counts_every_value_of_a_burst_and_relays_it_whole",),
        "the scheduler counts a burst of values as one (its per-call items are wrong)",
    ),
    Mutation(
        "warm-gang-never-inline", "scheduler/placement/device_fit.py",
        "    return warm and inv.spec.concurrency == 1 and inv.function.is_short(threshold)\n",
        "    return False\n",
        ("tests/unit/test_scheduler_gangs.py::"
         "test_a_warm_short_gang_runs_its_ranks_inline_and_nothing_else_does",
         "tests/integration/test_warm_gangs.py::"
         "test_a_cold_gang_runs_in_threads_and_a_warm_short_one_inline"),
        "a warm, measured-short gang's ranks wait for an executor thread",
    ),
    Mutation(
        "cold-gang-inline", "scheduler/placement/device_fit.py",
        "    return warm and inv.spec.concurrency == 1 and inv.function.is_short(threshold)\n",
        "    return inv.spec.concurrency == 1 and inv.function.is_short(threshold)\n",
        ("tests/unit/test_scheduler_gangs.py::"
         "test_a_warm_short_gang_runs_its_ranks_inline_and_nothing_else_does",),
        "a gang that must join a new group does so on the workers' main threads",
    ),
    Mutation(
        "unread-rank-value-pickled", "worker/executor.py",
        "        if value is Unused.VALUE:\n",
        "        if value is None and value is Unused.VALUE:\n",
        ("tests/unit/test_worker_core.py::test_only_a_rank_whose_value_is_read_pickles_it",),
        "a gang rank whose value nobody reads still pickles and sends it",
    ),
    Mutation(
        "warm-gang-backend-read-again", "scheduler/calls/transitions.py",
        "            if not warm or not formation.backend:  # a warm group keeps the backend it has\n",
        "            if True:\n",
        ("tests/unit/test_scheduler_gangs.py::"
         "test_a_warm_group_keeps_its_backend_and_a_new_generation_reads_it_again",),
        "a warm group's ranks are told a backend other than the one their group was made with",
    ),
    Mutation(
        "gang-spec-cache-ignores-change", "worker/core.py",
        "        if last is not None and last[0] == wire:\n",
        "        if last is not None:\n",
        ("tests/unit/test_worker_core.py::"
         "test_a_warm_gang_s_spec_is_read_once_and_a_new_generation_again",),
        "a rank keeps the gang spec of an earlier generation",
    ),
)
