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
        "eviction-policy-env-ignored", "scheduler/settings.py",
        '        policy = c.env_str("GPUFN_EVICTION_POLICY", "cost") or "cost"\n',
        '        policy = "cost"\n',
        (f"{R}::test_lru_count_eviction_policy_from_the_environment",),
        "GPUFN_EVICTION_POLICY is ignored",
    ),
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
        "deployments-db-not-private", "scheduler/deployments.py",
        "                open_private(self.path)\n",
        "                self.path.parent.mkdir(parents=True, exist_ok=True)\n",
        ("tests/unit/test_deployments.py::test_the_store_and_its_wal_files_are_owner_only",),
        "the deployments database and its WAL files are created with the umask's mode (0644)",
    ),
    Mutation(
        "worker-log-not-private", "worker/supervisor.py",
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
        "worker-session-leftovers-kept", "worker/supervisor.py",
        "        left = proc_table.in_session(pid)\n",
        "        left: list[int] = []\n",
        ("tests/integration/test_call_children.py::test_what_escapes_the_call_ends_when_the_worker_is_replaced",),
        "what a replaced worker's session still runs is left running",
    ),
    Mutation(
        "memory-watch-no-limit", "worker/memory_watch.py",
        "        if b is not None and limit and n > limit:\n",
        "        if False:\n",
        ("tests/unit/test_memory_watch.py::test_over_budget_names_the_limit_and_the_fix",
         "tests/integration/test_host_memory.py::test_a_worker_over_its_host_budget_is_replaced_and_its_call_fails_typed"),
        "a worker over its host-memory budget is never stopped",
    ),
    Mutation(
        "memory-watch-no-children", "worker/memory_watch.py",
        "            members = set(by_session.get(w.pid, [])) | {w.pid}\n",
        "            members = {w.pid}\n",
        ("tests/unit/test_memory_watch.py::test_a_session_over_its_budget_is_found_through_its_child",
         "tests/integration/test_host_memory.py::test_memory_of_a_calls_child_counts_and_the_child_is_stopped"),
        "the memory of a worker's children does not count",
    ),
    Mutation(
        "memory-declared-ignored", "worker/memory_watch.py",
        "        base = self.declared or self.default\n",
        "        base = self.default\n",
        ("tests/unit/test_memory_watch.py::test_a_limit_is_the_budget_or_the_declaration_plus_models_under_the_ceiling",
         "tests/integration/test_host_memory.py::test_a_function_declares_its_own_host_memory"),
        "@gpu(host_memory=) does not change the worker's limit",
    ),
    Mutation(
        "host-oom-retried", "scheduler/core.py",
        "        if msg.returncode == p.OUT_OF_HOST_MEMORY:  # its calls fail: a retry would grow again\n",
        "        if False:\n",
        ("tests/unit/test_faults.py::test_a_worker_stopped_over_its_host_memory_fails_its_calls_without_a_retry",),
        "calls of a worker stopped over its host memory are retried as lost (WorkerLost), untyped",
    ),
    Mutation(
        "detached-cancelled-with-spawner", "scheduler/core.py",
        "                if self.streams.outlives(inv):\n",
        "                if False:\n",
        ("tests/unit/test_kept_results.py::test_a_spawned_call_of_a_deployed_function_outlives_its_spawner",
         "tests/integration/test_detached.py::test_it_runs_to_its_end_and_its_result_is_found_later"),
        "a spawned call of a deployed function is cancelled when its spawner leaves",
    ),
    Mutation(
        "kept-results-not-on-disk", "scheduler/streams.py",
        "        if inv.function.app:  # on disk: found after its spawner left, and after a restart\n",
        "        if False:\n",
        ("tests/unit/test_kept_results.py::test_kept_results_survive_a_new_scheduler",),
        "kept results of deployed functions' calls live in memory only (lost on a restart)",
    ),
    Mutation(
        "kept-results-any-user", "scheduler/streams.py",
        "        return info is not None and info.info.user == owner\n",
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
        "kept-results-never-expire", "scheduler/kept_results.py",
        "            if wall - entry.ended <= self.retention:\n",
        "            if True:\n",
        ("tests/unit/test_kept_results.py::test_the_book_on_disk_is_owner_only_bounded_and_expires",),
        "kept results stay past their retention",
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
