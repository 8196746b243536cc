"""Mutations of the hot path (issue 20): the placement pass's early end, the compiled
header checks, same-host shared memory and the globals fingerprint."""

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
)
