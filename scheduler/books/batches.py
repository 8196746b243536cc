"""Dynamic batching as pure functions over the ready queue: queued calls of a
`@gpu(batch_size=N, batch_wait_ms=W)` function are grouped into one execution of up to N
inputs, waiting at most W ms for a batch to fill.

A batch travels as one *carrier* invocation (what a device runs and a worker reports);
each caller's call is a member that gets its own result, or its own exception when the
function returned one in that item's place.
"""

from __future__ import annotations

from dataclasses import replace

from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.nouns.records import Invocation
from gpufn.wire import protocol as p


def due(queue: ReadyQueue, head: Invocation) -> float | None:
    """None if a batch should go now (full, or its oldest call waited long enough),
    else the time it becomes due."""
    spec = head.spec
    assert spec.batch_size is not None and spec.batch_wait_ms is not None
    if queue.depth(head.function.function_id) >= spec.batch_size:
        return None
    return head.submitted + spec.batch_wait_ms / 1000.0


def form(queue: ReadyQueue, head: Invocation, seq: int, now: float) -> Invocation:
    """Take up to batch_size queued calls of the head's function into a carrier."""
    fn, spec = head.function, head.spec
    assert spec.batch_size is not None
    members: list[Invocation] = []
    while len(members) < spec.batch_size and queue.head(fn.function_id) is not None:
        members.append(queue.pop(fn.function_id))
    frames = tuple(f for m in members for f in m.frames)
    carrier = Invocation(f"batch-{seq}-{members[0].id}", fn, b"", spec, frames,
                         members[0].submitted, seq)
    carrier.members = members
    carrier.history.append(("queued", now))
    for m in members:
        m.carrier = carrier
    return carrier


def split_result(carrier: Invocation, msg: p.Result) -> list[p.Result]:
    """A carrier's result as one result per member (in member order)."""
    items = msg.meta.batch_items or []
    base = replace(msg.meta, batch_items=None, batch_size=len(carrier.members))
    out, i = [], 0
    for m, item in zip(carrier.members, items, strict=False):
        n = int(item.get("n", 0))
        meta = replace(base, error_type=str(item.get("type", "")),
                       traceback=str(item.get("traceback", "")))
        out.append(p.Result(m.id, bool(item.get("ok")), str(item.get("error_kind", "")),
                            str(item.get("message", "")), meta, tuple(msg.frames[i:i + n])))
        i += n
    return out
