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
T = "tests/integration/test_restart.py"
U = "tests/unit/test_restart.py"


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
    # ---- a head restart (issue 18)
    Mutation(
        "restart-no-takeover", "scheduler/core.py",
        "        if isinstance(claim, Report) and self._adopt(inv, claim, now, queued=False):\n",
        "        if False:\n",
        (f"{U}::test_a_running_call_is_taken_over_not_run_again[False]",
         "tests/integration/test_faults.py::"
         "test_a_restarted_scheduler_takes_over_running_calls_and_runs_queued_ones"),
        "a resubmitted call a worker runs is not taken over (it counts as lost, or runs twice)",
    ),
    Mutation(
        "restart-held-not-asked-for", "scheduler/core.py",
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
        "ran-decided-during-the-hold", "scheduler/core.py",
        "        if self.recovery.holding(now):\n            self.recovery.suspects.add(inv.id)\n",
        "        if False:\n            self.recovery.suspects.add(inv.id)\n",
        (f"{U}::test_a_worker_that_runs_a_call_a_supervisor_said_ran_takes_it_over",),
        "a call said to have run is failed before the worker running its retry could say so",
    ),
    Mutation(
        "hold-never-ends-early", "scheduler/core.py",
        "        if self.recovery.device_ready(key):  # every device seen before the restart is back\n",
        "        if False:\n",
        (f"{U}::test_the_hold_ends_once_every_device_seen_before_is_back",),
        "resubmitted calls always wait the whole GPUFN_RESTART_GRACE",
    ),
    Mutation(
        "no-version-pins", "scheduler/app_book.py",
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
        "usage-not-saved", "scheduler/ops.py",
        "        rows = self.usage.take_dirty()\n",
        "        rows = []\n",
        (f"{U}::test_usage_and_logs_outlive_a_restart_in_a_0600_file",),
        "usage is lost when the scheduler restarts",
    ),
    Mutation(
        "supervisor-follows-serve", "gpufn/client/embedded.py",
        '            cmd += ["--head-grace", f"{self.head_grace:g}"]\n',
        '            cmd += ["--parent-pid", str(os.getpid())]\n',
        (f"{T}::test_a_head_restart_is_invisible_to_callers[serve-SIGKILL]",),
        "the head's workers die with gpufn serve",
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
