"""Mutants picked by a tool (cosmic-ray), one room at a time: every mutant of a module's
code that the tool's operators make, the room's tests run against each, the survivors
listed with their diffs, minus the ones `mutants_equivalent.py` says no test can tell.

    pip install -e ".[mutation]"
    python scripts/mutants.py --list                 # the rooms, their modules and tests
    python scripts/mutants.py --room users           # one room (every module in it)
    python scripts/mutants.py --room users --resume  # go on with an interrupted run
    python scripts/mutants.py --room users --survivors  # only the last run's survivors again
    python scripts/mutants.py --room users --report  # the last run's score and survivors
    python scripts/mutants.py --room shm --unit-only # a first pass with the unit files only

cosmic-ray edits the module on disk, runs the test command as a subprocess and puts the
file back; so the editable install (`scheduler/` is `gpufn.scheduler` through
package-dir) and every process a test starts (scheduler, supervisor, workers) import the
mutant. Run it only in a worktree of your own, never where others work. Each mutant's
test run has a timeout (a hang counts as killed), and each room a budget (minutes,
`--budget`); what is left is reported as pending and `--resume` goes on. The sessions
(sqlite) and reports live in `.mutation/` (ignored by git). Not part of `.ci/run`.

Operators: cosmic-ray's core set, less the replacements that make no plausible one-line
bug and only cost time (`x is None` -> `x > None` is a TypeError any test kills; `a | b`
-> `a ** b`): comparisons are swapped with their negation or their boundary neighbour
only, binary operators with their arithmetic inverse only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutants_equivalent import EQUIVALENT  # noqa: E402

WORK = ROOT / ".mutation"
UNIT = "tests/unit"


@dataclass(frozen=True)
class Room:
    """Modules mutated together, the tests run against each mutant, a bound per run."""

    modules: tuple[str, ...]
    tests: tuple[str, ...]
    timeout: float = 60.0  # seconds, one mutant's test run (a hang is killed)
    budget: float = 20.0  # minutes, the whole room
    # Only the mutants inside these functions ("Class.method" or "function"; nested ones
    # included) are run: a room over the newest part of a large module. Empty: all.
    only: tuple[str, ...] = ()


ROOMS: dict[str, Room] = {
    "fingerprint": Room(("gpufn/wire/fingerprint.py",),
                        (f"{UNIT}/test_fingerprint.py", f"{UNIT}/test_serialization.py")),
    "users": Room(("scheduler/books/users.py",),
                  (f"{UNIT}/test_users.py", f"{UNIT}/test_kept_results.py", f"{UNIT}/test_ops.py")),
    "user_desk": Room(("scheduler/desks/user_desk.py",),
                      (f"{UNIT}/test_users.py", f"{UNIT}/test_ops.py")),
    "recovery": Room(("scheduler/calls/recovery.py",),
                     (f"{UNIT}/test_restart.py", f"{UNIT}/test_core_guards.py",
                      f"{UNIT}/test_detached_restart.py")),
    "kept_results": Room(("scheduler/stores/kept_results.py",),
                         (f"{UNIT}/test_kept_results.py", f"{UNIT}/test_detached_restart.py")),
    "open_index": Room(("scheduler/placement/open_index.py",),
                       (f"{UNIT}/test_open_index.py", f"{UNIT}/test_queues_placement.py")),
    # test_sharded and test_model_heal (last: the slower ones) cover the sharded models'
    # gangs and sweeps, and the load failures' records, which the other files never make.
    "model_book": Room(("scheduler/books/model_book.py",),
                       (f"{UNIT}/test_model_book.py", f"{UNIT}/test_scheduler_pieces.py",
                        f"{UNIT}/test_open_index.py",
                        f"{UNIT}/test_residency.py", f"{UNIT}/test_eviction.py",
                        f"{UNIT}/test_model_heal.py", f"{UNIT}/test_sharded.py")),
    "held": Room(("worker/host/held.py",), (f"{UNIT}/test_held.py", f"{UNIT}/test_restart.py")),
    "proc_table": Room(("worker/host/proc_table.py",),
                       (f"{UNIT}/test_proc_table.py", f"{UNIT}/test_memory_watch.py")),
    "memory_watch": Room(("worker/host/memory_watch.py",), (f"{UNIT}/test_memory_watch.py",)),
    "children": Room(("worker/host/children.py",),
                     (f"{UNIT}/test_children.py", f"{UNIT}/test_memory_watch.py",
                      "tests/integration/test_call_children.py"), timeout=180.0),
    "shm": Room(("gpufn/wire/shm.py",),
                (f"{UNIT}/test_shm_pool.py", "tests/integration/test_shm.py"), timeout=240.0),
    "discovery": Room(("gpufn/net/discovery.py",),
                      (f"{UNIT}/test_discovery.py", "tests/integration/test_discovery_cli.py"),
                      timeout=240.0),
    # The unit-only first pass of `discovery` (its integration file costs about a minute a
    # mutant here); both rooms share the module's session, so `--room discovery --survivors`
    # runs only this pass's survivors with the integration file added.
    "discovery_unit": Room(("gpufn/net/discovery.py",), (f"{UNIT}/test_discovery.py",)),
    "head": Room(("gpufn/cluster/head.py",),
                 (f"{UNIT}/test_head.py", "tests/integration/test_restart.py"),
                 timeout=400.0),
    "streaming": Room(("worker/streaming.py",),
                      (f"{UNIT}/test_stream_bursts.py", f"{UNIT}/test_streams_retries.py",
                       "tests/integration/test_streaming.py"), timeout=300.0),
    # The unit-only first pass of `streaming` (sharing its session, as discovery_unit).
    "streaming_unit": Room(("worker/streaming.py",),
                           (f"{UNIT}/test_stream_bursts.py", f"{UNIT}/test_streams_retries.py"),
                           timeout=40.0),
    "http": Room(tuple(f"gpufn/http/{m}.py" for m in ("calls", "events", "directory", "pool")),
                 (f"{UNIT}/test_http_gateway.py", f"{UNIT}/test_http_pieces.py",
                  "tests/integration/test_http_faults.py"),
                 timeout=400.0),
    # Unit-only first passes of `http` and `head` (sharing their sessions, as discovery_unit):
    # their integration files cost a minute or more a mutant here.
    "http_unit": Room(tuple(f"gpufn/http/{m}.py" for m in ("calls", "events", "directory", "pool")),
                      (f"{UNIT}/test_http_gateway.py", f"{UNIT}/test_http_pieces.py")),
    # test_head: the record, the stops, start's refuse/adopt/replace and run's restart
    # policy, against real processes and a stand-in cluster (a few seconds a mutant).
    # The gateway's error shapes (native and OpenAI) and its bounded request bodies.
    "http_errors": Room(("gpufn/http/errors.py", "gpufn/http/bodies.py"),
                        (f"{UNIT}/test_http_pieces.py", f"{UNIT}/test_openai_pieces.py",
                         f"{UNIT}/test_http_gateway.py")),
    "head_unit": Room(("gpufn/cluster/head.py",), (f"{UNIT}/test_head.py",), timeout=40.0),
    "leases": Room(("worker/leases.py", "gpufn/client/leases.py", "scheduler/desks/lease_desk.py"),
                   (f"{UNIT}/test_leases.py",)),
    # The call futures (a hang, e.g. a waiter never notified, is killed at 30 s).
    "futures": Room(("gpufn/client/futures.py",), (f"{UNIT}/test_futures.py",), timeout=30.0),
    # The socket helpers every process uses and the client's sockets to leased workers.
    "sockets": Room(("gpufn/net/sockets.py", "gpufn/client/direct.py"),
                    (f"{UNIT}/test_sockets.py", f"{UNIT}/test_lease_settle.py",
                     f"{UNIT}/test_sync_channel.py"), timeout=30.0),
    # Attempts under a lease counted by the scheduler (Submit.prior_attempts), and the
    # client's probes that settle calls of an ended lease or a worker in doubt.
    "lease_retries": Room(("gpufn/client/client.py", "scheduler/calls/transitions.py",
                           "scheduler/core.py"),
                          (f"{UNIT}/test_lease_settle.py", f"{UNIT}/test_leases.py",
                           f"{UNIT}/test_sync_channel.py", f"{UNIT}/test_scheduler_core.py",
                           f"{UNIT}/test_core_guards.py", f"{UNIT}/test_users.py"),
                          timeout=60.0, budget=30.0,
                          only=("Client._lease_retry", "Client._lost", "Client._settle",
                                "Client._lost_at", "Client._lease_ended",
                                "Client._dispatch_direct", "Transitions.carry_attempts",
                                "Transitions.out_of_retries", "SchedulerCore._on_submit")),
    # Leased calls' timeouts: the worker's clock and interrupt, the scheduler's answer to
    # a call that did not stop, the client taking that answer.
    "lease_timeouts": Room(("worker/lease_clock.py", "worker/executor.py",
                            "scheduler/desks/lease_desk.py", "gpufn/client/client.py"),
                           (f"{UNIT}/test_lease_clock.py", f"{UNIT}/test_executor.py",
                            f"{UNIT}/test_leases.py", f"{UNIT}/test_lease_settle.py"),
                           timeout=60.0, budget=40.0,
                           only=("LeaseClock.started", "LeaseClock.ended", "LeaseClock.next_at",
                                 "LeaseClock._due_at", "LeaseClock.due", "LeaseClock.stuck",
                                 "LeaseClock.interrupted", "timed_out", "within_timeout",
                                 "Executor.interrupt", "LeaseDesk._on_overrun",
                                 "LeaseDesk.start", "Client._dispatch")),
    # A timed-out scheduled call among pipelined ones, and what a Hello again sends again.
    "lost_calls": Room(("scheduler/calls/transitions.py", "scheduler/core.py",
                        "gpufn/client/client.py"),
                       (f"{UNIT}/test_scheduler_policies.py", f"{UNIT}/test_scheduler_core.py",
                        f"{UNIT}/test_leases.py", f"{UNIT}/test_lease_settle.py",
                        f"{UNIT}/test_core_guards.py"),
                       timeout=60.0, budget=40.0,
                       only=("Transitions.advance_starts", "Transitions.lost_with_worker",
                             "SchedulerCore._worker_gone", "Client._send_again")),
    # Calls in flight under a lease lost with its worker: did they start there? (its journal)
    "lost_leases": Room(("scheduler/desks/lost_leases.py", "scheduler/nouns/records.py",
                         "scheduler/desks/lease_desk.py",
                         "scheduler/core.py", "scheduler/calls/transitions.py",
                         "worker/host/held.py", "gpufn/client/client.py",
                         "gpufn/client/leases.py"),
                        (f"{UNIT}/test_lost_leases.py", f"{UNIT}/test_held.py",
                         f"{UNIT}/test_leases.py", f"{UNIT}/test_lease_settle.py",
                         f"{UNIT}/test_sync_channel.py", f"{UNIT}/test_scheduler_policies.py",
                         f"{UNIT}/test_scheduler_core.py", f"{UNIT}/test_users.py",
                         f"{UNIT}/test_faults.py", f"{UNIT}/test_scheduler_pieces.py",
                         f"{UNIT}/test_scheduler_regressions.py"),
                        timeout=60.0, budget=40.0,
                        only=("LostLeases.opened", "LostLeases.lost", "LostLeases.worker",
                              "LostLeases.why", "LostLeases.verdict", "LostLeases.decided",
                              "LostLeases.park", "LostLeases.journal", "LostLeases.expired",
                              "LostLeases.unpark", "journal_of", "may_have_started",
                              "LeaseDesk.resubmitted", "LeaseDesk.worker_exited",
                              "LeaseDesk.tick", "LeaseDesk._release", "LeaseDesk.lost",
                              "SchedulerCore._on_submit", "SchedulerCore._admit_parked",
                              "SchedulerCore._on_worker_exited", "SchedulerCore._on_cancel",
                              "Transitions.out_of_retries", "Transitions._lost_unstarted",
                              "Transitions.retry_or_fail_lost",
                              "SchedulerCore._worker_gone", "RunJournal.read_whole",
                              "Client._lease_retry", "Client._lost", "lost")),
    # The worker's executor: calls run inline or on its threads, cancels, batches, relays.
    "executor": Room(("worker/executor.py",),
                     (f"{UNIT}/test_executor.py", f"{UNIT}/test_worker_core.py",
                      f"{UNIT}/test_streams_retries.py", f"{UNIT}/test_stream_bursts.py",
                      f"{UNIT}/test_shm_pool.py"), timeout=60.0, budget=40.0),
    # The worker's side of a lease: DirectRuns in, short leased calls run at once, their
    # answers out (the newest part of worker/process.py; the rest of it has no room).
    "worker_leases": Room(("worker/process.py",),
                          ("tests/integration/test_leases.py",
                           "tests/integration/test_leased_maps.py"),
                          timeout=150.0, budget=45.0,
                          only=("WorkerProcess._flush_direct", "WorkerProcess._leased",
                                "WorkerProcess._lease_act", "WorkerProcess._run_leased",
                                "WorkerProcess._special", "WorkerProcess._leased_done",
                                "WorkerProcess._step_leases", "WorkerProcess._start_leased",
                                "WorkerProcess._direct_receive")),
    # A blocking call's channel: straight to a leased worker, else through the scheduler.
    "sync_channel": Room(("gpufn/client/sync_channel.py",),
                         (f"{UNIT}/test_sync_channel.py", "tests/integration/test_leases.py", "tests/integration/test_call_path.py"),
                         timeout=150.0, budget=60.0),
    # Batches packed into one frame, and the rest of the codec.
    "codec": Room(("gpufn/wire/codec.py",), (f"{UNIT}/test_protocol.py",)),
    # The OpenAI surface's pure pieces: parameters, prompts and choices, embeddings.
    "openai_pieces": Room(("gpufn/http/openai_params.py", "gpufn/http/openai_embeddings.py",
                           "gpufn/http/openai_completions.py"),
                          (f"{UNIT}/test_openai_pieces.py", f"{UNIT}/test_openai_params.py",
                           f"{UNIT}/test_openai_completions.py",
                           f"{UNIT}/test_openai_embeddings.py", f"{UNIT}/test_openai_routes.py"),
                          timeout=30.0),
    # The gateway's own routes through the whole ASGI app, over a stand-in connection.
    "http_app": Room(("gpufn/http/app.py",), (f"{UNIT}/test_http_app.py",), timeout=30.0),
    # The OpenAI routes over a stand-in gateway and connection.
    "openai_routes": Room(("gpufn/http/openai_routes.py",),
                          (f"{UNIT}/test_openai_routes.py", f"{UNIT}/test_openai_embeddings.py"),
                          timeout=30.0),
    # The gateway's server, metrics, entry point and dashboard: real sockets, a child
    # process writing prometheus-client's files, `python -m gpufn.http` itself.
    "http_serving": Room(("gpufn/http/server.py", "gpufn/http/metrics.py",
                          "gpufn/http/__main__.py", "gpufn/http/dashboard.py"),
                         (f"{UNIT}/test_http_server.py", f"{UNIT}/test_http_metrics.py",
                          f"{UNIT}/test_http_main.py", f"{UNIT}/test_http_app.py"),
                         timeout=60.0),
}

_COMPARE_KEPT = ("Eq_NotEq", "NotEq_Eq", "Is_IsNot", "IsNot_Is", "In_NotIn", "NotIn_In",
                 "Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Lt_Gt", "Gt_Lt", "LtE_GtE", "GtE_LtE")
_BINARY_KEPT = ("Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Mul", "Mod_FloorDiv",
                "BitOr_BitAnd", "BitAnd_BitOr")
EXCLUDED_OPERATORS = (
    f"core/ReplaceComparisonOperator_(?!({'|'.join(_COMPARE_KEPT)})$)",
    f"core/ReplaceBinaryOperator_(?!({'|'.join(_BINARY_KEPT)})$)",
    "core/ReplaceUnaryOperator_(?!(Delete_Not|USub_UAdd)$)",
    "core/RemoveDecorator",  # @dataclass, @property, @staticmethod: any use fails
)


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the module's annotations are ((line, col) to (line, col)): with `from
    __future__ import annotations` they are never evaluated, so a mutant inside one
    (`int | None` -> `int & None`) is equivalent by construction and is not run."""
    import ast

    spans = []
    for node in ast.walk(ast.parse(source)):
        notes: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs,
                                            *(x for x in (a.vararg, a.kwarg) if x))]
            notes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        for n in notes:
            if n is not None and n.end_lineno is not None and n.end_col_offset is not None:
                spans.append(((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)))
    return spans


def in_annotation(pos: tuple[int, int], spans: list[tuple[tuple[int, int], tuple[int, int]]]) -> bool:
    return any(start <= tuple(pos) < end for start, end in spans)


def skip_annotations(module: str, db: Path) -> None:
    """Mark the mutants inside annotations skipped (see `annotation_spans`)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    source = (ROOT / module).read_text()
    if "from __future__ import annotations" not in source:
        return
    spans = annotation_spans(source)
    with use_db(str(db), WorkDB.Mode.open) as work:
        skip = [item.job_id for item in work.pending_work_items
                if in_annotation(item.mutations[0].start_pos, spans)]
        work.set_multiple_results(skip, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))


def function_spans(source: str, names: tuple[str, ...],
                   strict: bool = True) -> list[tuple[int, int]]:
    """The lines (first, last) of each named function ("Class.method" or "function");
    a name the module does not define is an error (the room went stale), unless not
    `strict` (a room of several modules: each name is in one of them, `room_spans`)."""
    import ast

    found: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    found[name] = (first, child.end_lineno or child.lineno)
                visit(child, f"{name}.")

    visit(ast.parse(source), "")
    missing = [n for n in names if n not in found]
    if missing and strict:
        raise SystemExit(f"no function {', '.join(missing)} in the module: update the room")
    return [found[n] for n in names if n in found]


def room_spans(room: Room) -> dict[str, list[tuple[int, int]]]:
    """Each module's spans of the room's `only` functions; a name in none of its modules
    is an error (the room went stale)."""
    import ast

    spans = {m: function_spans((ROOT / m).read_text(), room.only, strict=False)
             for m in room.modules}
    defined = set()
    for m in room.modules:
        for node in ast.walk(ast.parse((ROOT / m).read_text())):
            if isinstance(node, ast.ClassDef):
                defined |= {f"{node.name}.{f.name}" for f in node.body
                            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(node.name)
    missing = [n for n in room.only if n not in defined]
    if missing:
        raise SystemExit(f"no function {', '.join(missing)} in the room's modules: update it")
    return spans


def skip_outside(module: str, db: Path, names: tuple[str, ...]) -> None:
    """Mark the mutants outside the named functions skipped (a room's `only`)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans = function_spans((ROOT / module).read_text(), names, strict=False)
    with use_db(str(db), WorkDB.Mode.open) as work:
        skip = [item.job_id for item in work.pending_work_items
                if not any(a <= item.mutations[0].start_pos[0] <= b for a, b in spans)]
        work.set_multiple_results(skip, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))


_PROBE = ("import gpufn, gpufn.worker, gpufn.scheduler, gpufn.memory_pool; "
          "print(gpufn.__file__, gpufn.worker.__file__, gpufn.scheduler.__file__, "
          "gpufn.memory_pool.__file__)")


def install_problem() -> str | None:
    """Why this interpreter would test another checkout's files (its editable install
    maps gpufn's packages elsewhere: every mutant would survive), or None."""
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        return f"gpufn does not import with {sys.executable}: {out.stderr.strip()[-300:]}"
    elsewhere = [f for f in out.stdout.split() if not Path(f).resolve().is_relative_to(ROOT)]
    if elsewhere:
        return (f"{sys.executable} imports gpufn from {Path(elsewhere[0]).parent}, not from "
                f"{ROOT}: make this checkout's own environment (python -m venv .venv && "
                "pip install torch==2.13.0 && pip install -e \".[test,mutation]\") and "
                "activate it")
    return None


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def config_for(module: str, room: Room, unit_only: bool = False) -> Path:
    """The cosmic-ray config of one module (written into .mutation/); with `unit_only`
    the room's integration files are left out (a fast first pass: `--survivors` without
    it then runs only what the unit files let survive against every test)."""
    tests = " ".join(t for t in room.tests if not unit_only or t.startswith(f"{UNIT}/"))
    # -p no:cacheprovider: the mutant's run leaves nothing behind; -x: the first failure kills
    command = f"{sys.executable} -m pytest -x -q -p no:cacheprovider -o addopts= -m 'not slow' {tests}"
    excluded = ", ".join(json.dumps(e) for e in EXCLUDED_OPERATORS)
    path = WORK / f"{slug(module)}.toml"
    path.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(module)}\n"
        f"timeout = {room.timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n\n"
        "[cosmic-ray.distributor]\nname = \"local\"\n\n"
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = [{excluded}]\n")
    return path


def _cr(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", *args], cwd=ROOT, check=True)


def forget_survivors(db: Path) -> None:
    """Mark the last session's survivors to be run again (after new tests were added)."""
    import sqlite3

    with sqlite3.connect(db) as con:
        con.execute("DELETE FROM work_results WHERE worker_outcome = 'NORMAL' "
                    "AND test_outcome = 'SURVIVED'")


def run_module(module: str, room: Room, deadline: float, resume: bool,
               unit_only: bool = False) -> dict[str, object]:
    cfg = config_for(module, room, unit_only)
    db = WORK / f"{slug(module)}.sqlite"
    if not (resume and db.exists()):
        db.unlink(missing_ok=True)
        _cr("init", str(cfg), str(db))
        subprocess.run([sys.executable, "-m", "cosmic_ray.tools.filters.operators_filter",
                        str(db), str(cfg)], cwd=ROOT, check=True)
        subprocess.run([sys.executable, "-m", "cosmic_ray.tools.filters.pragma_no_mutate",
                        str(db)], cwd=ROOT, check=True)
        skip_annotations(module, db)
        if room.only:
            room_spans(room)  # every name is in one of the room's modules
            skip_outside(module, db, room.only)
    source = ROOT / module
    saved = source.read_bytes()
    left = deadline - time.monotonic()
    proc = subprocess.Popen(["nice", "-n", "10", sys.executable, "-m", "cosmic_ray.cli", "exec",
                             str(cfg), str(db)], cwd=ROOT, start_new_session=True)
    try:
        proc.wait(max(1.0, left))
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        why = "the room's budget is spent" if isinstance(e, subprocess.TimeoutExpired) else "Ctrl-C"
        print(f"{module}: {why}; stopping (--resume goes on)")
        _stop(proc)
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        if source.read_bytes() != saved:  # never leave a mutant on disk
            source.write_bytes(saved)
    return summarize(module, db)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop cosmic-ray (its own session): SIGINT, so it puts the module back on the way out."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def _changed(diff: str) -> tuple[str, str]:
    """The removed and the added line of a one-line mutant's diff."""
    lines = diff.splitlines()
    old = [x[1:].strip() for x in lines if x.startswith("-") and not x.startswith("---")]
    new = [x[1:].strip() for x in lines if x.startswith("+") and not x.startswith("+++")]
    return " / ".join(old), " / ".join(new)


def summarize(module: str, db: Path) -> dict[str, object]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    equivalent = {(e.module, e.before, e.after) for e in EQUIVALENT}
    source = (ROOT / module).read_text()
    spans = (annotation_spans(source) if "from __future__ import annotations" in source
             else [])
    killed = incompetent = pending = 0
    survivors: list[dict[str, str]] = []
    eq = 0
    with use_db(str(db), WorkDB.Mode.open) as work:
        done = list(work.completed_work_items)
        pending = sum(1 for _ in work.pending_work_items)
    for item, result in done:
        if result.worker_outcome == WorkerOutcome.SKIPPED:
            continue  # filtered out (an excluded operator, a pragma)
        if result.worker_outcome == WorkerOutcome.NO_TEST:
            continue
        if result.test_outcome == TestOutcome.INCOMPETENT:
            incompetent += 1
            continue
        before, after = _changed(result.diff or "")
        if result.test_outcome == TestOutcome.KILLED:
            killed += 1
        elif ((module, before, after) in equivalent
              or in_annotation(item.mutations[0].start_pos, spans)):
            eq += 1
        else:
            m = item.mutations[0]
            survivors.append({"operator": m.operator_name, "line": str(m.start_pos[0]),
                              "before": before, "after": after})
    total = killed + len(survivors)
    score = 100.0 * killed / total if total else 100.0
    out: dict[str, object] = {"module": module, "killed": killed, "total": total,
                              "equivalent": eq, "incompetent": incompetent,
                              "pending": pending, "score": round(score, 1),
                              "survivors": survivors}
    (WORK / f"{slug(module)}.json").write_text(json.dumps(out, indent=1))
    return out


def report(out: dict[str, object]) -> None:
    print(f"\n{out['module']}: {out['killed']}/{out['total']} killed ({out['score']}%), "
          f"{out['equivalent']} equivalent, {out['incompetent']} incompetent, "
          f"{out['pending']} not run")
    for s in out["survivors"]:  # type: ignore[attr-defined]
        print(f"  SURVIVED line {s['line']} {s['operator']}:\n    - {s['before']}\n"
              f"    + {s['after']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--room", action="append", choices=sorted(ROOMS), default=[])
    ap.add_argument("--budget", type=float, default=None, help="minutes per room")
    ap.add_argument("--resume", action="store_true", help="go on with the last session")
    ap.add_argument("--survivors", action="store_true",
                    help="run the last session's survivors again")
    ap.add_argument("--report", action="store_true", help="only report the last session")
    ap.add_argument("--unit-only", action="store_true",
                    help="run the room's unit files only (a first pass; then --survivors)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list or not a.room:
        for name, room in ROOMS.items():
            print(f"{name:14} {' '.join(room.modules)}\n{'':14} tests: {' '.join(room.tests)}")
        return 0
    if shutil.which("nice") is None:
        print("needs nice(1)", file=sys.stderr)
        return 2
    problem = None if a.report else install_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    WORK.mkdir(exist_ok=True)
    worst = 100.0
    for name in a.room:
        room = ROOMS[name]
        deadline = time.monotonic() + 60 * (a.budget or room.budget)
        for module in room.modules:
            db = WORK / f"{slug(module)}.sqlite"
            if a.report and not db.exists():
                print(f"\n{module}: not run yet")
                continue
            if a.survivors:
                forget_survivors(db)
            out = (summarize(module, db) if a.report
                   else run_module(module, room, deadline, a.resume or a.survivors,
                                   a.unit_only))
            report(out)
            worst = min(worst, float(out["score"]))  # type: ignore[arg-type]
    return 0 if worst >= 90.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
