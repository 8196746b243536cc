"""The driver thread of one engine in a worker process: it steps the engine's `StepLoop`
while requests wait or run, and hands each request's outputs to its call's thread. Engines
on one device take turns step by step, the highest priority first (`Arbiter`), so a
high-priority model's tokens do not wait behind a full batch of another model."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque

from gpufn.engines.base import Engine, Prompt, RequestOutput, SamplingParams
from gpufn.engines.loop import StepLoop
from gpufn.exceptions import GpufnError

log = logging.getLogger("gpufn.engines")

WAIT_SLICE = 0.05  # a call's thread wakes this often, so a cancel lands between steps
IDLE_SECONDS = 30.0  # a driver thread with nothing to do for this long ends (a new request restarts it)


class Arbiter:
    """Whose step runs next on this process's device: the waiting engine of highest
    priority, first come first within a priority. A step is never interrupted. An engine
    that steps again right after its step keeps a claim at its priority while it hands its
    outputs over, so a lower-priority engine woken by the release does not slip a step in
    between (which thread wakes first is up to the GIL); a claim ends at its owner's next
    `acquire` or `withdraw`, and after `CLAIM_SECONDS` in any case."""

    CLAIM_SECONDS = 1.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._queue: list[tuple[int, int]] = []  # (-priority, ticket)
        self._tickets = itertools.count()
        self._claims: dict[int, tuple[int, float]] = {}  # owner -> (priority, until)

    def acquire(self, priority: int, owner: object = None) -> None:
        with self._cond:
            self._claims.pop(id(owner), None)
            me = (-priority, next(self._tickets))
            heapq.heappush(self._queue, me)
            while self._busy or self._queue[0] != me or self._outranked(priority):
                self._cond.wait(self.CLAIM_SECONDS / 4)
            heapq.heappop(self._queue)
            self._busy = True

    def release(self, owner: object = None, again: int | None = None) -> None:
        """The step ended; `again`: its owner steps again at this priority."""
        with self._cond:
            self._busy = False
            if again is not None:
                self._claims[id(owner)] = (again, time.monotonic() + self.CLAIM_SECONDS)
            self._cond.notify_all()

    def withdraw(self, owner: object) -> None:
        """`owner` will not step again soon: its claim ends."""
        with self._cond:
            if self._claims.pop(id(owner), None) is not None:
                self._cond.notify_all()

    def _outranked(self, priority: int) -> bool:
        now = time.monotonic()
        return any(p > priority and until > now for p, until in self._claims.values())


ARBITER = Arbiter()  # one device per worker process: one arbiter for its engines


# what `submit` queues for the driver thread: id, prompt, params, priority, preemptible, deadline
Submitted = tuple[str, Prompt, SamplingParams, int, bool, float | None]


class RequestFailed(GpufnError):
    """A request the engine failed alone (its own error; the batch went on)."""


class _Stream:
    """One request's outputs, filled by the driver thread, read by the call's thread."""

    def __init__(self) -> None:
        self.outputs: deque[RequestOutput] = deque()
        self.cond = threading.Condition()
        self.done = False

    def put(self, out: RequestOutput) -> None:
        with self.cond:
            self.outputs.append(out)
            self.done = self.done or out.finished
            self.cond.notify()


class Driver:
    """The step loop of one engine in this process, driven by its own thread."""

    def __init__(self, engine: Engine, max_batch: int | None = None,
                 kv_budget_bytes: int | None = None, arbiter: Arbiter | None = None) -> None:
        batch = max_batch or int(getattr(engine, "max_batch", 32))
        self.loop = StepLoop(engine, max_batch=batch, kv_budget_bytes=kv_budget_bytes)
        self.arbiter = arbiter or ARBITER
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._inbox: list[Submitted] = []
        self._cancels: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._priorities: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.batch_sizes: deque[int] = deque(maxlen=1000)  # running requests per step, lately

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
               priority: int = 0, preemptible: bool = False,
               deadline: float | None = None) -> _Stream:
        stream = _Stream()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request {request_id!r} is already being generated")
            self._streams[request_id] = stream
            self._priorities[request_id] = priority
            self._inbox.append((request_id, prompt, params, priority, preemptible, deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="gpufn-engine-steps")
                self._thread.start()
            self._work.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._streams:
                self._cancels.append(request_id)
                self._work.notify()

    # -- the driver thread -------------------------------------------------------------------

    def _run(self) -> None:
        while (taken := self._take(IDLE_SECONDS)) is not None:
            self._advance(*taken, time.monotonic())

    def _take(self, wait: float) -> tuple[list[Submitted], list[str], int] | None:
        """The requests and cancels that came in, and the priority to step at; waits up
        to `wait` seconds for work, then None (the thread ends: a new request restarts it)."""
        with self._lock:
            idle_since = time.monotonic()
            while not (self._inbox or self._cancels or self.loop.has_work()):
                if time.monotonic() - idle_since >= wait:
                    if wait >= IDLE_SECONDS:
                        self._thread = None
                    return None
                self._work.wait(min(1.0, wait))
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            return inbox, cancels, max(self._priorities.values(), default=0)

    def _advance(self, inbox: list[Submitted], cancels: list[str], priority: int,
                 now: float) -> None:
        """Apply what came in to the loop, then step it once if it has work."""
        for rid, prompt, params, prio, preemptible, deadline in inbox:
            try:
                self.loop.submit(rid, prompt, params, priority=prio, preemptible=preemptible,
                                 now=now, deadline=deadline)
            except Exception as e:  # refused alone: it can never run here
                self._deliver(RequestOutput.failed(rid, f"{type(e).__name__}: {e}"))
        for rid in cancels:
            self.loop.cancel(rid)
        if self.loop.has_work():
            self._step(priority, now)
        else:
            self.arbiter.withdraw(self)

    def _step(self, priority: int, now: float) -> None:
        self.arbiter.acquire(priority, self)
        again: int | None = None
        try:
            result = self.loop.step(now)
            again = priority if self.loop.has_work() else None
        except Exception as e:  # the engine itself broke: every request in it fails
            log.exception("engine step failed")
            for rid in list(self._streams):
                self._deliver(RequestOutput.failed(rid, f"the engine failed: {e}"))
                self.loop.cancel(rid)
            return
        finally:
            self.arbiter.release(self, again)
        self.steps += 1
        self.batch_sizes.append(len(self.loop.running))
        for out in result.outputs.values():
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._priorities.pop(out.request_id, None)
        if stream is not None:
            stream.put(out)
