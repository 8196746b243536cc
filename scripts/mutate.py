"""Mutation runner: apply one known-bad edit at a time, run the tests meant to catch it, restore.

Each mutation names a file, an exact source snippet (which must occur exactly once, so a
mutation gone stale after a refactor is reported, never skipped silently), its replacement,
and the pytest node ids that must fail under it. Prints a table and exits non-zero when a
mutation survives or is stale. A mutation no test can tell from the original says why in
`equivalent` (it is checked for staleness only), so the audit of a rule is kept. The
mutations live in `mutation_table.py` (the first releases' and issue 23's list),
`mutations_scheduler.py`, `mutations_edges.py`, `mutations_users.py`, `mutations_hotpath.py`, `mutations_holes.py`,
`mutations_restart.py`, `mutations_http.py` and `mutations_state.py`.

    python scripts/mutate.py            # every mutation
    python scripts/mutate.py -k aging   # those whose name contains "aging"
    python scripts/mutate.py --table restart,holes   # one area's tables
    python scripts/mutate.py --list
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutation_table import LISTED, Mutation  # noqa: E402
from mutations_edges import EDGES  # noqa: E402
from mutations_holes import HOLES  # noqa: E402
from mutations_hotpath import HOTPATH  # noqa: E402
from mutations_http import HTTP  # noqa: E402
from mutations_restart import RESTART  # noqa: E402
from mutations_scheduler import SCHEDULER  # noqa: E402
from mutations_state import STATE  # noqa: E402
from mutations_users import USERS  # noqa: E402

TABLES: dict[str, tuple[Mutation, ...]] = {
    "listed": LISTED, "scheduler": SCHEDULER, "edges": EDGES, "users": USERS,
    "hotpath": HOTPATH, "holes": HOLES, "restart": RESTART, "http": HTTP,
    "state": STATE,
}
MUTATIONS: tuple[Mutation, ...] = tuple(m for table in TABLES.values() for m in table)


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
    mutated = source.replace(m.snippet, m.replacement)
    if m.file.endswith(".py"):
        try:  # a mutation that does not parse would be "killed" by any test: it is stale
            compile(mutated, m.file, "exec")
        except SyntaxError as e:
            return "stale", 0.0, f"the mutated {m.file} does not parse: {e}"
    t0 = time.monotonic()
    try:
        path.write_text(mutated)
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
    ap.add_argument("--table", default="", help="only these tables, comma-separated: "
                    + ", ".join(TABLES))
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    tables = [t for t in args.table.split(",") if t]
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        ap.error(f"unknown table(s) {', '.join(unknown)}; the tables are {', '.join(TABLES)}")
    pool = [m for t in tables for m in TABLES[t]] if tables else list(MUTATIONS)
    chosen = [m for m in pool if args.k in m.name]
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
