"""Mutations of the hot path (issue 20): the placement pass's early end, the compiled
header checks, same-host shared memory, the globals fingerprint, and the placement
index of open devices and the model plan search (the scheduler at scale)."""

from __future__ import annotations

from mutation_table import Mutation

HOTPATH: tuple[Mutation, ...] = (
    Mutation(
        "placement-stops-before-backfill", "scheduler/placement_pass.py",
        "        self._backfill_checked, self._backfill_possible = r, possible\n        return not possible\n",
        "        self._backfill_checked, self._backfill_possible = r, possible\n        return True\n",
        ("tests/unit/test_scheduler_gangs.py::"
         "test_head_gang_reserves_draining_devices_and_only_short_calls_backfill",),
        "a pass ends at a gang's reservation although a short call could backfill",
    ),
    Mutation(
        "pipeline-depth-ignores-runtime", "scheduler/device_fit.py",
        "    return min(most, max(MIN_PIPELINE_DEPTH, fits))\n",
        "    return MIN_PIPELINE_DEPTH\n",
        ("tests/unit/test_scheduler_policies.py::"
         "test_short_calls_pipeline_about_two_ms_of_work_at_a_worker",),
        "very short calls queue only two deep at a worker, so a map waits on round trips",
    ),
    Mutation(
        "plan-bound-counts-resident-models-as-loads", "scheduler/model_book.py",
        "                        t, waiting = 0.0, waiting + (e.state is Residency.LOADING)\n",
        "                        t, waiting = load_s, waiting + (e.state is Residency.LOADING)\n",
        ("tests/unit/test_open_index.py::"
         "test_the_plan_search_s_bound_skips_only_devices_that_cannot_win",),
        "the plan search skips a device that holds the models, loading a second copy elsewhere",
    ),
    Mutation(
        "plan-bound-off", "scheduler/model_book.py",
        "                        workspace + load_b + restore_b - d.ledger.free, d.key) > best[0]:\n",
        "                        workspace + load_b + restore_b - d.ledger.free, d.key) > best[0] and False:\n",
        ("tests/unit/test_open_index.py::"
         "test_a_model_call_among_equal_devices_fits_one_ledger_not_all",),
        "every candidate is fitted: 1,000 ledger fits per model call at 1,024 devices",
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
        "index-walk-stops-at-first-device", "scheduler/open_index.py",
        "                if drain + lo > best[0]:\n",
        "                if True:\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "single-device choice takes the first usable device by drain, ignoring run times",
    ),
    Mutation(
        "index-skips-equal-drains-with-unequal-run-times", "scheduler/open_index.py",
        "                if uniform and drain == best_drain:\n",
        "                if drain == best_drain:\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "devices draining as soon as the best are skipped although this call runs faster there",
    ),
    Mutation(
        "index-update-keeps-old-entry", "scheduler/open_index.py",
        "            del lst[bisect.bisect_left(lst, old)]\n",
        "            pass\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "a device moved in the index keeps its old place too (chosen by its old load)",
    ),
    Mutation(
        "placement-index-not-moved-after-dispatch", "scheduler/placement_pass.py",
        "                    self._index.update(d, still)\n",
        "                    pass\n",
        ("tests/unit/test_open_index.py::test_a_pass_places_by_the_load_its_own_dispatches_left",),
        "a pass keeps choosing by the load devices had before its own dispatches",
    ),
    Mutation(
        "estimate-bounds-never-refreshed", "scheduler/open_index.py",
        "    if got is not None and got[0] == stamp:\n",
        "    if got is not None:\n",
        ("tests/unit/test_open_index.py::"
         "test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes",),
        "the walk's lower bound is kept after the function's run times changed",
    ),
    Mutation(
        "plan-search-stops-at-equal-drain", "scheduler/model_book.py",
        "                if ordered and drain > best[0][0]:\n",
        "                if ordered and drain >= best[0][0]:\n",
        ("tests/unit/test_open_index.py::test_the_ordered_plan_search_finds_the_full_search_s_plan",),
        "a model call's search stops before devices whose drain ties the best expected time",
    ),
    Mutation(
        "plan-search-skips-every-cold-device", "scheduler/model_book.py",
        "                if drain + least > best[0][0]:\n",
        "                if least > 0:\n",
        ("tests/unit/test_open_index.py::test_the_ordered_plan_search_finds_the_full_search_s_plan",),
        "once a plan is found, devices that must load a model are never planned",
    ),
    Mutation(
        "fit-cache-ignores-ledger-version", "scheduler/model_book.py",
        "        if got is not None and got[0] == version:\n",
        "        if got is not None:\n",
        ("tests/unit/test_open_index.py::test_a_remembered_fit_is_not_used_once_the_ledger_changed",),
        "a remembered fit is used after the device's ledger changed",
    ),
)
