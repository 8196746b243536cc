"""Stepped inference over a sharded model's gang: rank 0's driver (`Leader`) plans each step
(the requests that came in, the cancels, the clock) and broadcasts the plan over the gang's
group; every rank applies it to its own `StepLoop` and steps, so each step is one collective
forward on every rank, and the outputs its callers get leave from rank 0. The other ranks'
drivers (`Follower`) only follow: their calls (the gang's twins of rank 0's) wait for the
same request ids to end, their values discarded as a gang's are."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpufn.engines.base import Engine, Prompt, RequestOutput, SamplingParams
from gpufn.engines.stepping import IDLE_SECONDS, Driver, Submitted, _Stream

log = logging.getLogger("gpufn.engines")

EARLY_KEPT = 1024  # outputs of requests whose twin call has not come yet, kept per follower


@dataclass(frozen=True)
class StepPlan:
    """One step of the gang, as rank 0 decided it; `stop`: rank 0 has nothing to do."""

    submits: tuple[Submitted, ...] = ()
    cancels: tuple[str, ...] = ()
    priority: int = 0
    now: float = 0.0
    stop: bool = False


class Leader(Driver):
    """Rank 0: a `Driver` that broadcasts each step's plan before it applies it."""

    def __init__(self, engine: Engine, group: Any = None, **options: Any) -> None:
        super().__init__(engine, **options)
        self.group = group
        self.resting = False  # told the followers it has nothing to do (no collective under way)

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams, **options: Any) -> _Stream:
        if not params.greedy and params.seed is None:  # every rank must draw the same tokens
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        return super().submit(request_id, prompt, params, **options)

    def _run(self) -> None:
        _failing_all(self, self._lead)

    def _lead(self) -> None:
        stopped = False
        while True:
            taken = self._take(0.0)
            if taken is None:
                if not stopped:
                    _broadcast(StepPlan(stop=True), self.group)
                    stopped = self.resting = True
                taken = self._take(IDLE_SECONDS)
                if taken is None:
                    return
            stopped = self.resting = False
            inbox, cancels, priority = taken
            now = time.monotonic()
            _broadcast(StepPlan(tuple(inbox), tuple(cancels), priority, now), self.group)
            self._advance(inbox, cancels, priority, now)


class Follower(Driver):
    """Rank > 0: steps as rank 0's plans say. A call here registers its request id (the
    twin of rank 0's) and gets the same outputs; it submits and cancels nothing itself."""

    def __init__(self, engine: Engine, group: Any = None, **options: Any) -> None:
        super().__init__(engine, **options)
        self.group = group
        self._early: OrderedDict[str, list[RequestOutput]] = OrderedDict()

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams, **options: Any) -> _Stream:
        stream = _Stream()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request {request_id!r} is already being generated")
            for out in self._early.pop(request_id, []):  # it ran before this twin came
                stream.put(out)
            if not stream.done:
                self._streams[request_id] = stream
            if self._thread is None or not self._thread.is_alive():
                self._thread = _start(self)
        return stream

    def cancel(self, request_id: str) -> None:
        with self._lock:  # rank 0's plan carries the gang's cancel; this twin stops waiting
            self._streams.pop(request_id, None)

    def _run(self) -> None:
        _failing_all(self, self._follow)

    def _follow(self) -> None:
        while True:
            plan = _broadcast(None, self.group)
            if plan.stop:
                with self._lock:
                    if not self._streams:  # no twin waits: rest until one comes
                        self._thread = None
                        return
                continue
            self._advance(list(plan.submits), list(plan.cancels), plan.priority, plan.now)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if stream is None:
                self._early.setdefault(out.request_id, []).append(out)
                while len(self._early) > EARLY_KEPT:
                    self._early.popitem(last=False)
                return
            if out.finished:
                self._streams.pop(out.request_id, None)
        stream.put(out)


def _failing_all(driver: Driver, run: Callable[[], None]) -> None:
    """Run a lockstep thread; if the gang's collectives fail (a rank died, the group went),
    every request waiting here fails with the reason instead of waiting for ever."""
    try:
        run()
    except Exception as e:
        log.exception("the gang's lockstep failed")
        with driver._lock:
            waiting = list(driver._streams)
            driver._thread = None
        for rid in waiting:
            driver._deliver(RequestOutput.failed(rid, f"the gang's lockstep failed: {e}"))
            driver.loop.cancel(rid)


def _start(driver: Driver) -> Any:
    import threading

    thread = threading.Thread(target=driver._run, daemon=True, name="gpufn-engine-lockstep")
    thread.start()
    return thread


def _broadcast(plan: StepPlan | None, group: Any) -> StepPlan:
    """Rank 0's plan, on every rank of `group` (the gang's; None: the default group)."""
    import torch.distributed as dist

    box: list[Any] = [plan]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    got = box[0]
    assert isinstance(got, StepPlan)
    return got


def lockstep_driver(engine: Engine, rank: int, group: Any = None, **options: Any) -> Driver:
    """This rank's part of the gang's lockstep over `engine` (a sharded model's engine,
    identical on every rank): the leader on rank 0, a follower elsewhere."""
    return (Leader if rank == 0 else Follower)(engine, group=group, **options)
