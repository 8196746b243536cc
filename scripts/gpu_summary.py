"""The summary of a `scripts/gpu_check.sh` run, from its log: each GPU test's outcome, then
the table of figures against their anchors (the `GPUFN-FIGURE name | value | anchor` lines
the device section and the tests print; `tests/gpu/figures.py`). Printed, and written to a
file. Standard library only: it runs on the GPU machine's bare Python.

    python3 scripts/gpu_summary.py gpu-check-out/gpu-check.log gpu-check-out/gpu-summary.txt --exit 0
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import time
from pathlib import Path

FIGURE = re.compile(r"GPUFN-FIGURE (.*)$")
TEST = re.compile(r"GPUFN-TEST (.*)$")
PYTEST_END = re.compile(r"^=+ (.*\b(?:passed|failed|skipped|errors?|deselected|no tests ran)\b.*) =+$")
STOPPED = re.compile(r"^stopped: .*")


def fields(text: str, n: int) -> list[str]:
    """`a | b | c` as n fields (missing ones empty, extra ones joined into the last)."""
    parts = [p.strip() for p in text.split(" | ")]
    parts = [*parts[: n - 1], " | ".join(parts[n - 1:])] if len(parts) > n else parts
    return parts + [""] * (n - len(parts))


def parse(log: str) -> tuple[dict[str, list[str]], list[list[str]], list[str]]:
    """Figure rows by name (the last value printed wins, first order kept), test rows, notes."""
    figures: dict[str, list[str]] = {}
    tests: list[list[str]] = []
    notes: list[str] = []
    for line in log.splitlines():
        if m := FIGURE.search(line):
            name, value, anchor = fields(m.group(1), 3)
            figures[name] = [name, value, anchor]
        elif m := TEST.search(line):
            test = fields(m.group(1), 4)
            tests.append([test[0].removeprefix("tests/gpu/"), *test[1:]])
        elif m := PYTEST_END.match(line.strip()):
            notes.append(f"pytest: {m.group(1)}")
        elif m := STOPPED.match(line.strip()):
            notes.append(m.group(0))
    return figures, tests, notes


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, columns padded to their widths."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    return [line(header), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, rows)]


def summary(log: str, status: int) -> list[str]:
    """The summary's lines: header, notes, the tests, and the figures last."""
    figures, tests, notes = parse(log)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [f"gpufn GPU check on {socket.gethostname()}, {stamp}: exit {status}"]
    out += notes or ["pytest: no closing line (it did not run, or was stopped)"]
    out += ["", "GPU tests"]
    out += table(["test", "outcome", "reason", "s"], tests) if tests else ["(none ran)"]
    out += ["", "Figures against their anchors"]
    out += table(["figure", "value", "anchor"], list(figures.values())) if figures else [
        "(no figure was printed)"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the summary of the log and write it to the summary file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("summary", type=Path)
    ap.add_argument("--exit", type=int, default=0, help="the check's exit status")
    args = ap.parse_args(argv)
    log = args.log.read_text(errors="replace") if args.log.exists() else ""
    text = "\n".join(summary(log, args.exit)) + "\n"
    args.summary.write_text(text)
    sys.stdout.write("\n== summary (" + str(args.summary) + ")\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
