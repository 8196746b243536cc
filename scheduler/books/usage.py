"""The usage meter: device-seconds, calls and queue wait per app, function, version and user,
for `gpufn usage` and the Prometheus counters; fed once per finished call.

Device time is metered from dispatch to finish, per second, times the devices held (a gang
of 4 counts 4), and spread over one-minute buckets so that `--since` cuts a long call at the
window's edge. Buckets older than `retention` are dropped. Times are wall-clock seconds
the core derives from its `now` (`core.wall(now)`; queries say "since N seconds ago"),
so buckets mean the same after a restart: the minutes changed since the last save are
handed to the `OpsStore` (`take_dirty`) and read back at start (`load`).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpufn.scheduler.stores.ops import UsageRow

BUCKET_S = 60.0
RETENTION_S = 35 * 86400.0
MAX_ROWS = 500_000  # minute totals kept on disk at most (the oldest go first)
# Histogram bounds for queue wait and call duration, 1 ms to 600 s (Prometheus `le`).
BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
          25.0, 60.0, 120.0, 300.0, 600.0)
BY = ("app", "function", "user")


class Key(NamedTuple):  # a tuple: made and hashed once per finished call, in C
    app: str
    function: str
    version: int
    user: str


@dataclass(slots=True)
class Cell:
    """One bucket's totals for one key."""

    calls: int = 0
    device_seconds: float = 0.0
    wait_seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    total: float = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS, v)] += 1
        self.total += v


class UsageMeter:
    def __init__(self, retention: float = RETENTION_S) -> None:
        self.retention = retention
        self._buckets: OrderedDict[int, dict[Key, Cell]] = OrderedDict()
        # Totals since start, for Prometheus (counters never go down).
        self.calls_total: dict[tuple[str, str, int, str], int] = {}
        self.queue_wait: dict[tuple[str, str], Histogram] = {}
        self.duration: dict[tuple[str, str], Histogram] = {}
        self.device_seconds_total: dict[tuple[str, str], float] = {}
        self.track = False  # note the cells written, for `take_dirty` (a durable store)
        self._dirty: set[tuple[int, Key]] = set()

    def load(self, rows: list[UsageRow]) -> None:
        """The minutes a previous scheduler saved (before any call of this one)."""
        for r in rows:
            cells = self._buckets.setdefault(r.minute, {})
            cells[Key(r.app, r.function, r.version, r.user)] = Cell(
                r.calls, r.device_seconds, r.wait_seconds, dict(r.outcomes))
        self._buckets = OrderedDict(sorted(self._buckets.items()))

    def take_dirty(self) -> list[UsageRow]:
        """The minute totals changed since the last call, whole."""
        out = []
        for b, k in self._dirty:
            c = self._buckets.get(b, {}).get(k)
            if c is not None:
                out.append(UsageRow(b, k.app, k.function, k.version, k.user, c.calls,
                                    c.device_seconds, c.wait_seconds, dict(c.outcomes)))
        self._dirty.clear()
        return out

    def give_back(self, rows: list[UsageRow]) -> None:
        """`take_dirty`'s rows were not written (a full disk): they are taken again next
        time, whole (their cells are in memory anyway: this costs no more than the meter)."""
        for r in rows:
            self._dirty.add((r.minute, Key(r.app, r.function, r.version, r.user)))

    def oldest_minute(self, now: float) -> int:
        return int(now // BUCKET_S) - int(self.retention // BUCKET_S)

    def _cell(self, t: float, key: Key) -> Cell:
        b = int(t // BUCKET_S)
        cells = self._buckets.get(b)
        if cells is None:
            cells = self._buckets[b] = {}
            if len(self._buckets) > 1 and next(reversed(self._buckets)) != b:
                self._buckets = OrderedDict(sorted(self._buckets.items()))
            oldest = b - int(self.retention // BUCKET_S)
            while self._buckets and next(iter(self._buckets)) < oldest:
                self._buckets.popitem(last=False)
        cell = cells.get(key)
        if cell is None:
            cell = cells[key] = Cell()
        if self.track:
            self._dirty.add((b, key))
        return cell

    def record_call(self, key: Key, outcome: str, submitted: float, started: float | None,
                    now: float) -> None:
        """A caller's call ended: count it, its outcome and its queue wait."""
        wait = max(0.0, (started if started is not None else now) - submitted)
        cell = self._cell(now, key)
        cell.calls += 1
        cell.wait_seconds += wait
        cell.outcomes[outcome] = cell.outcomes.get(outcome, 0) + 1
        ck = (key.app, key.function, key.version, outcome)
        self.calls_total[ck] = self.calls_total.get(ck, 0) + 1
        fk = (key.app, key.function)
        self.queue_wait.setdefault(fk, Histogram()).observe(wait)
        if started is not None:
            self.duration.setdefault(fk, Histogram()).observe(max(0.0, now - started))

    def record_ran(self, key: Key, outcome: str, spans: list[tuple[float, float]]) -> None:
        """Calls that ran the moment they came (under a lease: no queue wait), each a
        (started, ended) span: as `record_call` for each, counted once per minute."""
        if not spans:
            return
        fk = (key.app, key.function)
        waits = self.queue_wait.setdefault(fk, Histogram())
        durations = self.duration.setdefault(fk, Histogram())
        ck = (key.app, key.function, key.version, outcome)
        self.calls_total[ck] = self.calls_total.get(ck, 0) + len(spans)
        waits.counts[bisect.bisect_left(BOUNDS, 0.0)] += len(spans)
        minutes: dict[int, tuple[float, int]] = {}  # minute -> (a time in it, calls)
        for started, ended in spans:
            durations.observe(max(0.0, ended - started))
            b = int(ended // BUCKET_S)
            n = minutes.get(b)
            minutes[b] = (ended, 1) if n is None else (n[0], n[1] + 1)
        for t, calls in minutes.values():
            cell = self._cell(t, key)
            cell.calls += calls
            cell.outcomes[outcome] = cell.outcomes.get(outcome, 0) + calls

    def record_devices(self, key: Key, started: float, now: float, devices: float) -> None:
        """`devices` were held from `started` to `now`: spread the device-seconds over the
        buckets the interval covers."""
        if devices <= 0 or now <= started:
            return
        fk = (key.app, key.function)
        self.device_seconds_total[fk] = self.device_seconds_total.get(fk, 0.0) + (now - started) * devices
        t = max(started, now - self.retention)
        while t < now:
            edge = min(now, (int(t // BUCKET_S) + 1) * BUCKET_S)
            self._cell(t, key).device_seconds += (edge - t) * devices
            t = edge

    def report(self, now: float, since: float | None = None, by: str = "function",
               user: str | None = None) -> list[dict[str, Any]]:
        """Totals per `by` key for buckets newer than `since` seconds ago (a bucket partly
        inside counts whole: the window is accurate to a minute); with `user`, only that
        user's calls."""
        if by not in BY:
            raise ValueError(f"--by must be one of {', '.join(BY)}, not {by!r}")
        first = int((now - since) // BUCKET_S) if since is not None else None
        rows: dict[tuple[str, ...], dict[str, Any]] = {}
        for b, cells in self._buckets.items():
            if first is not None and b < first:
                continue
            for k, c in cells.items():
                if user is not None and k.user != user:
                    continue
                rk = ((k.app,) if by == "app" else (k.user,) if by == "user"
                      else (k.app, k.function))
                row = rows.get(rk)
                if row is None:
                    row = rows[rk] = {"app": k.app, "function": k.function if by == "function" else "",
                                      "user": k.user if by == "user" else "", "calls": 0,
                                      "device_seconds": 0.0, "queue_wait_seconds": 0.0,
                                      "outcomes": {}}
                row["calls"] += c.calls
                row["device_seconds"] += c.device_seconds
                row["queue_wait_seconds"] += c.wait_seconds
                for o, n in c.outcomes.items():
                    row["outcomes"][o] = row["outcomes"].get(o, 0) + n
        for row in rows.values():
            row["mean_queue_wait_seconds"] = row["queue_wait_seconds"] / row["calls"] if row["calls"] else 0.0
        return sorted(rows.values(), key=lambda r: -r["device_seconds"])
