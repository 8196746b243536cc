"""Dynamic batching (mixin of `SchedulerCore`): queued calls of a `@gpu(batch_size=N,
batch_wait_ms=W)` function are grouped into one execution of up to N inputs, waiting at
most W ms for a batch to fill.

A batch travels as one *carrier* invocation (what a device runs and a worker reports);
each caller's call is a member that gets its own result, or its own exception when the
function returned one in that item's place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpufn import protocol as p
from gpufn.scheduler.queues import ReadyQueue
from gpufn.scheduler.records import Invocation
from gpufn.scheduler.states import InvState


class Batching:
    queue: ReadyQueue
    counters: Any
    _wakeup_at: float | None
    _seq: int
    _send: Callable[[bytes, p.Message], None]

    def _batch_ready(self, inv: Invocation, now: float) -> bool:
        """Dispatch when the batch is full or its oldest call has waited long enough."""
        spec = inv.spec
        assert spec.batch_size is not None
        if self.queue.depth(inv.function.function_id) >= spec.batch_size:
            return True
        due = inv.submitted + spec.batch_wait_ms / 1000.0
        if now >= due:
            return True
        if self._wakeup_at is None or due < self._wakeup_at:
            self._wakeup_at = due  # the shell wakes the scheduler then
        return False

    def _form_batch(self, inv: Invocation, now: float) -> Invocation:
        """Take up to batch_size queued calls of the function into a carrier."""
        fn, spec = inv.function, inv.spec
        assert spec.batch_size is not None
        members: list[Invocation] = []
        while len(members) < spec.batch_size and self.queue.head(fn.function_id) is not None:
            members.append(self.queue.pop(fn.function_id))
        self._seq += 1
        frames = tuple(f for m in members for f in m.frames)
        carrier = Invocation(f"batch-{self._seq}-{members[0].id}", fn, b"", spec, frames,
                             members[0].submitted, self._seq)
        carrier.members = members
        carrier.history.append(("queued", now))
        for m in members:
            m.carrier = carrier
        self.counters.batches += 1
        return carrier

    def _batch_meta(self, carrier: Invocation) -> dict[str, Any]:
        return {"batch": [len(m.frames) for m in carrier.members],
                "members": [m.id for m in carrier.members]}

    def _start_members(self, carrier: Invocation, now: float) -> None:
        for m in carrier.members:
            m.to(InvState.RUNNING, now)
            m.devices, m.started = carrier.devices, now
            m.deadline = None  # started in time, like a single call
            m.attempts += 1

    def _member_results(self, carrier: Invocation, msg: p.Result) -> list[p.Result]:
        """Split a carrier's result into one result per member."""
        items = msg.meta.get("batch_items") or []
        base = {k: v for k, v in msg.meta.items() if k != "batch_items"}
        base["batch_size"] = len(carrier.members)
        out, i = [], 0
        for m, item in zip(carrier.members, items, strict=False):
            n = int(item.get("n", 0))
            meta = {**base, **{k: v for k, v in item.items() if k not in ("ok", "n")}}
            out.append(p.Result(m.id, bool(item.get("ok")), str(item.get("error_kind", "")),
                                str(item.get("message", "")), meta, tuple(msg.frames[i:i + n])))
            i += n
        return out
