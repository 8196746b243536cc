"""How a multi-device call ends: its ranks' reports and losses in, one verdict out.

Pure functions over an invocation's `rank_results` and `lost_ranks`. The caller sees
the root cause: a lost rank (WorkerLost, or a retry), else a rank whose error is not a
consequence of a peer failing (a communication error, or `Cancelled` because the failing
call's other ranks were stopped), else the first failure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpufn.exceptions import Cancelled, kind_of
from gpufn.scheduler.nouns.records import Invocation
from gpufn.wire import protocol as p

CANCELLED = kind_of(Cancelled)


@dataclass(frozen=True, slots=True)
class Succeeded:
    """Every rank reported success: rank 0's value, or every rank's with gather=True;
    `run_time`, the shortest rank's duration, is what the gang's own work and collectives
    took: the rank dispatched last waits least for its peers, while rank 0's duration also
    holds the others' dispatch lag (on a loaded host, enough to look long)."""

    meta: p.ResultMeta
    frames: tuple[Any, ...]
    run_time: float | None = None


@dataclass(frozen=True, slots=True)
class Lost:
    """A rank's worker died: retry the call or fail it with WorkerLost."""

    rank: int
    why: str


@dataclass(frozen=True, slots=True)
class Failed:
    """A rank raised: its error is the call's."""

    rank: int
    result: p.Result


Verdict = Succeeded | Lost | Failed


def answered(inv: Invocation) -> int:
    """Reporting ranks that reported or were lost."""
    return sum(1 for r in range(inv.reporters) if r in inv.rank_results or r in inv.lost_ranks)


def verdict(inv: Invocation, force: bool = False) -> Verdict | None:
    """The call's outcome, or None while it must still wait for ranks. A failing call
    waits for every rank to answer, unless `force` (its settle time is over)."""
    if inv.failing_since is None:
        if len(inv.rank_results) >= inv.reporters:
            return succeeded(inv)
        return None
    if answered(inv) < inv.reporters and not force:
        return None
    if inv.lost_ranks:
        rank, why = min(inv.lost_ranks.items())
        return Lost(rank, why)
    fails = [(r, m) for r, m in inv.rank_results.items() if not m.ok]  # in report order
    if not fails:  # told to stop, and nothing went wrong on any rank that answered
        return Lost(0, "its ranks were stopped")
    own = [f for f in fails if not f[1].meta.comm_error]
    # A rank stopped because another failed reports Cancelled, maybe before that one's
    # own error arrives: it is a consequence too.
    root = [f for f in own if f[1].error_kind != CANCELLED] or own or fails
    return Failed(*root[0])


def succeeded(inv: Invocation) -> Succeeded:
    first = inv.rank_results[0]
    meta = replace(first.meta)
    frames = first.frames
    if inv.spec.gather:
        ordered = [inv.rank_results[r] for r in range(len(inv.devices))]
        meta.gather = [len(r.frames) for r in ordered]
        frames = tuple(f for r in ordered for f in r.frames)
    times = [r.meta.duration for r in inv.rank_results.values() if r.meta.duration is not None]
    return Succeeded(meta, frames, min(times) if times else None)
