"""`StepLoop`: the sans-I/O loop a worker drives around one engine: a priority queue of
requests, admission by slots and by KV bytes, cancel, preemption and per-step outputs
routed by request id. No threads, sockets or clock: the caller passes `now`."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufn.engines.base import (
    Engine,
    KVAccounting,
    Preemptible,
    Prompt,
    RequestOutput,
    SamplingParams,
)
from gpufn.engines.waiting import WaitingQueue
from gpufn.exceptions import Unschedulable


@dataclass
class LoopRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    preemptible: bool
    kv_bytes: int  # reserved while it runs: its KV at full length
    arrived: float
    deadline: float | None
    order: int = 0  # arrival number: its place among its priority, kept across preemption
    joined: int = -1  # when it last joined the batch (a counter), for choosing victims
    suspended: bool = False  # in the engine, out of the batch, waiting here to resume


@dataclass(frozen=True)
class StepResult:
    """One step: each request's output (at most one per request), and who joined the
    batch, who was preempted and who finished in it."""

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    joined: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()


class StepLoop:
    """Admits requests into `engine` while they fit `max_batch` slots and the
    `kv_budget_bytes` byte budget (each running request reserves `engine.bytes_for`),
    highest priority first, first come first within a priority. A request that can
    never fit is refused at `submit`. When the head of the queue does not fit, running
    `preemptible` requests of lower priority are suspended for it (newest first) if that
    makes it fit; otherwise it waits and so does everyone behind it (no starvation of a
    large request by small ones)."""

    def __init__(self, engine: Engine, *, max_batch: int,
                 kv_budget_bytes: int | None = None) -> None:
        engine_batch = getattr(engine, "max_batch", max_batch)
        if not 1 <= max_batch <= engine_batch:
            raise ValueError(f"max_batch={max_batch}: give 1..{engine_batch} (the engine's)")
        if kv_budget_bytes is not None and not isinstance(engine, KVAccounting):
            raise ValueError("kv_budget_bytes needs an engine with bytes_for() "
                             f"and kv_bytes_per_token; {type(engine).__name__} has neither")
        self.engine, self.max_batch, self.kv_budget_bytes = engine, max_batch, kv_budget_bytes
        self._waiting: WaitingQueue[LoopRequest] = WaitingQueue()
        self._running: dict[str, LoopRequest] = {}
        self._aborting: set[str] = set()  # cancelled in the engine, its last output pending
        self._pending: dict[str, RequestOutput] = {}  # outputs made here, out next step
        self._joins = 0
        self.kv_bytes_reserved = 0

    # -- the caller's side -------------------------------------------------------------------

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
               priority: int = 0, preemptible: bool = False, now: float = 0.0,
               deadline: float | None = None) -> None:
        """Queue a request. Raises `Unschedulable` when its KV cache can never fit the
        budget, `ValueError` for a duplicate id or a request the engine refuses."""
        if request_id in self._waiting or request_id in self._running \
                or request_id in self._aborting or request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in this loop")
        kv = self.engine.bytes_for(prompt, params) if isinstance(self.engine, KVAccounting) else 0
        budget = self.kv_budget_bytes
        if budget is not None and kv > budget:
            per = self.engine.kv_bytes_per_token if isinstance(self.engine, KVAccounting) else 0
            raise Unschedulable(
                f"request {request_id!r} needs {kv:,} bytes of KV cache ({kv // max(per, 1):,} "
                f"tokens of prompt plus max_tokens at {per:,} bytes each) but this engine's KV "
                f"budget is {budget:,} bytes: lower max_tokens or shorten the prompt")
        req = LoopRequest(request_id, prompt, params, priority, preemptible, kv, now, deadline,
                          self._waiting.next_order())
        self._waiting.push(request_id, req, priority, req.order)

    def cancel(self, request_id: str) -> None:
        """End a request: a waiting one leaves the queue, a running one frees its slot for
        the next step. Its last output (finish_reason 'abort') comes with the next step."""
        req = self._waiting.remove(request_id)
        if req is not None and not req.suspended:
            self._pending[request_id] = RequestOutput.aborted(request_id)
            return
        if req is None:
            req = self._running.pop(request_id, None)
            if req is None:
                return
            self._release(req)
        self.engine.abort(request_id)
        self._aborting.add(request_id)

    def step(self, now: float) -> StepResult:
        """Expire, admit (preempting if needed), step the engine once, route outputs."""
        outputs, self._pending = self._pending, {}
        self._expire(now, outputs)
        joined, preempted = self._admit(outputs)
        finished = [rid for rid, out in outputs.items() if out.finished]
        if self.engine.has_unfinished():
            for out in self.engine.step():
                outputs[out.request_id] = out
                if out.finished:
                    finished.append(out.request_id)
                    self._finish(out.request_id)
        if self._aborting and not self.engine.has_unfinished():
            # An engine with nothing left that never said 'abort' for a cancelled request
            # (against the protocol): its last output is made here, so the loop ends.
            for rid in list(self._aborting):
                outputs[rid] = RequestOutput.aborted(rid)
                finished.append(rid)
                self._finish(rid)
        return StepResult(outputs, tuple(joined), tuple(preempted), tuple(finished))

    @property
    def running(self) -> list[str]:
        return list(self._running)

    @property
    def waiting(self) -> list[str]:
        """Waiting request ids in the order they would join."""
        return [r.request_id for r in self._waiting]

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborting or self._pending)

    # -- admission ---------------------------------------------------------------------------

    def _fits(self, req: LoopRequest) -> bool:
        budget = self.kv_budget_bytes
        return len(self._running) < self.max_batch and (
            budget is None or self.kv_bytes_reserved + req.kv_bytes <= budget)

    def _admit(self, outputs: dict[str, RequestOutput]) -> tuple[list[str], list[str]]:
        joined: list[str] = []
        preempted: list[str] = []
        while (head := self._waiting.peek()) is not None:
            if not self._fits(head):
                victims = self._victims_for(head)
                if not victims:
                    break
                for victim in victims:
                    self._suspend(victim)
                    preempted.append(victim.request_id)
            self._waiting.remove(head.request_id)
            if self._join(head, outputs):
                joined.append(head.request_id)
        return joined, preempted

    def _join(self, req: LoopRequest, outputs: dict[str, RequestOutput]) -> bool:
        try:
            if req.suspended:
                assert isinstance(self.engine, Preemptible)
                self.engine.resume(req.request_id)
            else:
                self.engine.add_request(req.request_id, req.prompt, req.params, req.priority)
        except Exception as exc:  # this request alone is refused
            outputs[req.request_id] = RequestOutput.failed(req.request_id, str(exc))
            return False
        req.suspended = False
        req.joined = self._joins
        self._joins += 1
        self._running[req.request_id] = req
        self.kv_bytes_reserved += req.kv_bytes
        return True

    def _victims_for(self, head: LoopRequest) -> list[LoopRequest]:
        """The fewest preemptible lower-priority running requests (lowest priority, then
        newest first) whose suspension makes `head` fit; none if no such set exists."""
        if not isinstance(self.engine, Preemptible):
            return []
        candidates = sorted((r for r in self._running.values()
                             if r.preemptible and r.priority < head.priority),
                            key=lambda r: (r.priority, -r.joined))
        chosen: list[LoopRequest] = []
        slots, kv = len(self._running), self.kv_bytes_reserved
        budget = self.kv_budget_bytes
        for r in candidates:
            chosen.append(r)
            slots, kv = slots - 1, kv - r.kv_bytes
            if slots < self.max_batch and (budget is None or kv + head.kv_bytes <= budget):
                return chosen
        return []

    def _suspend(self, req: LoopRequest) -> None:
        assert isinstance(self.engine, Preemptible)
        self.engine.suspend(req.request_id)
        del self._running[req.request_id]
        self._release(req)
        req.suspended = True
        self._waiting.push(req.request_id, req, req.priority, req.order)

    def _release(self, req: LoopRequest) -> None:
        self.kv_bytes_reserved -= req.kv_bytes

    def _finish(self, request_id: str) -> None:
        self._aborting.discard(request_id)
        req = self._running.pop(request_id, None)
        if req is not None:
            self._release(req)

    def _expire(self, now: float, outputs: dict[str, RequestOutput]) -> None:
        """Requests still waiting (never started) past their deadline fail."""
        late = [r for r in self._waiting
                if r.deadline is not None and now > r.deadline and not r.suspended]
        for req in late:
            self._waiting.remove(req.request_id)
            outputs[req.request_id] = RequestOutput.failed(
                req.request_id, f"waited {now - req.arrived:.3f}s for a slot, past its deadline")
