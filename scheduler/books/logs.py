"""Function output kept for `gpufn logs`: a ring buffer per (app, function), bounded by lines and
bytes, and a bound on how many functions are remembered (the least recently written goes).

Times are wall-clock seconds the core derives from its `now` (`core.wall(now)`); queries
say "since N seconds ago" and lines carry their age, which the CLI turns into times. With
a durable `OpsStore` the new lines (and what the bounds let go) are handed to it
(`take_new`) and read back at start (`load`), so `gpufn logs` outlives a restart.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from gpufn.scheduler.stores.ops import LogRow

MAX_LINES = 5000  # per function
MAX_BYTES = 2 * 2**20  # per function
MAX_FUNCTIONS = 512
MAX_LINE = 8192  # longer lines are cut (a progress bar without newlines)
RETENTION_S = 7 * 86400.0  # lines older than this are not kept on disk
MAX_UNSAVED = 100_000  # lines kept for the disk while it cannot be written (the newest)


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
        self.track = False  # note new lines and what left, for `take_new` (a durable store)
        self._new: list[LogRow] = []
        self._touched: set[tuple[str, str]] = set()
        self._dropped: list[tuple[str, str]] = []

    def load(self, rows: list[LogRow]) -> None:
        """The lines a previous scheduler saved, oldest first (before any of this one)."""
        for r in rows:
            key = (r.app, r.function)
            ring = self._rings.get(key)
            if ring is None:
                ring = self._rings[key] = _Ring()
            else:
                self._rings.move_to_end(key)
            ring.lines.append(Line(r.seq, r.at, r.invocation_id, r.stream, r.text, r.user))
            ring.nbytes += len(r.text)
            self._seq = max(self._seq, r.seq)
        for ring in self._rings.values():
            self._trim(ring)
        while len(self._rings) > self.max_functions:
            self._rings.popitem(last=False)

    def take_new(self) -> tuple[list[LogRow], dict[tuple[str, str], int], list[tuple[str, str]]]:
        """(lines added since the last call, the oldest seq each function touched keeps,
        the functions no longer kept)."""
        new, self._new = self._new, []
        oldest = {k: r.lines[0].seq for k in self._touched
                  if (r := self._rings.get(k)) is not None and r.lines}
        dropped, self._dropped = self._dropped, []
        self._touched.clear()
        return new, oldest, dropped

    def give_back(self, new: list[LogRow], oldest: dict[tuple[str, str], int],
                  dropped: list[tuple[str, str]]) -> int:
        """`take_new`'s answer was not written (a full disk): taken again next time. At
        most `MAX_UNSAVED` lines wait (the oldest go first); returns how many went."""
        self._new = new + self._new
        self._touched.update(oldest)
        self._dropped = dropped + self._dropped
        over = max(0, len(self._new) - MAX_UNSAVED)
        if over:
            del self._new[:over]
        return over

    def _trim(self, ring: _Ring) -> None:
        while ring.lines and (len(ring.lines) > self.max_lines or ring.nbytes > self.max_bytes):
            ring.nbytes -= len(ring.lines.popleft().text)

    def add(self, app: str, function: str, invocation_id: str, stream: str, text: str,
            now: float, user: str = "") -> None:
        key = (app, function)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = _Ring()
            while len(self._rings) > self.max_functions:
                gone, _ = self._rings.popitem(last=False)
                if self.track:
                    self._dropped.append(gone)
        else:
            self._rings.move_to_end(key)
        for part in text.rstrip("\n").split("\n"):
            part = part[:MAX_LINE]
            self._seq += 1
            ring.lines.append(Line(self._seq, now, invocation_id, stream, part, user))
            ring.nbytes += len(part)
            if self.track:
                self._new.append(LogRow(self._seq, now, app, function, invocation_id, stream,
                                        part, user))
        if self.track:
            self._touched.add(key)
        self._trim(ring)

    def known(self) -> list[str]:
        """The names `gpufn logs` accepts for what is stored (for an unknown-target message)."""
        return sorted({a or f for a, f in self._rings} | {f"{a}.{f}" for a, f in self._rings if a})

    def query(self, target: str, now: float, since: float | None = None, after: int = 0,
              limit: int = 10_000, user: str | None = None) -> dict[str, Any]:
        """Lines of matching functions newer than `since` seconds ago and after seq `after`,
        oldest first (at most `limit`, the newest ones); with `user`, only that user's.
        A target that names no function is taken for a call's id: that call's lines."""
        by_id = not any(matches(target, app, fn) for app, fn in self._rings)
        found = False
        out: list[Line] = []
        keys: dict[int, tuple[str, str]] = {}
        for (app, fn), ring in self._rings.items():
            if by_id:
                if not any(line.invocation_id == target for line in ring.lines):
                    continue
            elif not matches(target, app, fn):
                continue
            found = True
            for line in reversed(ring.lines):
                if line.seq <= after or (since is not None and now - line.at > since):
                    break
                if (user is not None and line.user != user) or (
                        by_id and line.invocation_id != target):
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
