"""Function output kept for `gpufn logs`: a ring buffer per (app, function), bounded by lines and
bytes, and a bound on how many functions are remembered (the least recently written goes).

Times are the scheduler's monotonic `now`; queries say "since N seconds ago" and lines carry
their age, so the core stays clock-free and the CLI turns ages into wall-clock times.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

MAX_LINES = 5000  # per function
MAX_BYTES = 2 * 2**20  # per function
MAX_FUNCTIONS = 512
MAX_LINE = 8192  # longer lines are cut (a progress bar without newlines)


@dataclass(slots=True)
class Line:
    seq: int
    at: float
    invocation_id: str
    stream: str
    text: str
    user: str = ""  # whose call printed it (users.py): only they and an admin read it


@dataclass(slots=True)
class _Ring:
    lines: deque[Line] = field(default_factory=deque)
    nbytes: int = 0


def matches(target: str, app: str, function: str) -> bool:
    """`APP` (every function of a deployed app), `APP.FN`, or a plain ad-hoc function name;
    "" matches everything."""
    if not target:
        return True
    if app:
        return target in (app, f"{app}.{function}")
    return target == function


class LogStore:
    def __init__(self, max_lines: int = MAX_LINES, max_bytes: int = MAX_BYTES,
                 max_functions: int = MAX_FUNCTIONS) -> None:
        self.max_lines, self.max_bytes, self.max_functions = max_lines, max_bytes, max_functions
        self._rings: OrderedDict[tuple[str, str], _Ring] = OrderedDict()
        self._seq = 0

    def add(self, app: str, function: str, invocation_id: str, stream: str, text: str,
            now: float, user: str = "") -> None:
        key = (app, function)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = _Ring()
            while len(self._rings) > self.max_functions:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        for part in text.rstrip("\n").split("\n"):
            part = part[:MAX_LINE]
            self._seq += 1
            ring.lines.append(Line(self._seq, now, invocation_id, stream, part, user))
            ring.nbytes += len(part)
        while ring.lines and (len(ring.lines) > self.max_lines or ring.nbytes > self.max_bytes):
            ring.nbytes -= len(ring.lines.popleft().text)

    def known(self) -> list[str]:
        """The names `gpufn logs` accepts for what is stored (for an unknown-target message)."""
        return sorted({a or f for a, f in self._rings} | {f"{a}.{f}" for a, f in self._rings if a})

    def query(self, target: str, now: float, since: float | None = None, after: int = 0,
              limit: int = 10_000, user: str | None = None) -> dict[str, Any]:
        """Lines of matching functions newer than `since` seconds ago and after seq `after`,
        oldest first (at most `limit`, the newest ones); with `user`, only that user's."""
        found = False
        out: list[Line] = []
        keys: dict[int, tuple[str, str]] = {}
        for (app, fn), ring in self._rings.items():
            if not matches(target, app, fn):
                continue
            found = True
            for line in reversed(ring.lines):
                if line.seq <= after or (since is not None and now - line.at > since):
                    break
                if user is not None and line.user != user:
                    continue
                out.append(line)
                keys[line.seq] = (app, fn)
        out.sort(key=lambda ln: ln.seq)
        out = out[-limit:]
        return {
            "found": found,
            "next": max([after, self._seq] if found else [after]),
            "lines": [{"seq": ln.seq, "age": now - ln.at, "app": keys[ln.seq][0],
                       "function": keys[ln.seq][1], "invocation_id": ln.invocation_id,
                       "stream": ln.stream, "text": ln.text} for ln in out],
        }
