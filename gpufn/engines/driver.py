"""Stepped inference inside a worker: calls of one engine share each step. Each engine of a
worker process has one driver thread that steps its `StepLoop` while requests wait or
run; each call's own thread submits its request (`generate`) and waits for its outputs,
so a call joins the running batch between two steps and leaves it alone when it ends.
Engines on one device take turns step by step, the highest priority first (`Arbiter`),
so a high-priority model's tokens do not wait behind a full batch of another model."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

from gpufn.engines.base import (
    Engine,
    FinishReason,
    Prompt,
    RequestOutput,
    SamplingParams,
)
from gpufn.engines.loop import StepLoop
from gpufn.exceptions import Cancelled, GpufnError
from gpufn.runtime import context as ctxmod

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
        self._inbox: list[tuple[str, Prompt, SamplingParams, int, bool, float | None]] = []
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
        while True:
            with self._lock:
                idle_since = time.monotonic()
                while not (self._inbox or self._cancels or self.loop.has_work()):
                    if time.monotonic() - idle_since > IDLE_SECONDS:
                        self._thread = None
                        return
                    self._work.wait(1.0)
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                priority = max(self._priorities.values(), default=0)
            now = time.monotonic()
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


_drivers: weakref.WeakKeyDictionary[Any, Driver] = weakref.WeakKeyDictionary()
_drivers_lock = threading.Lock()


def driver_for(engine: Engine, **options: Any) -> Driver:
    """This process's driver of `engine` (made on first use; one per engine object)."""
    with _drivers_lock:
        driver = _drivers.get(engine)
        if driver is None:
            driver = _drivers[engine] = Driver(engine, **options)
        return driver


def generate(engine: Any, prompt: Prompt, params: SamplingParams | None = None, *,
             priority: int | None = None, preemptible: bool = False,
             request_id: str | None = None) -> Iterator[RequestOutput]:
    """Generate for one request in the step shared by every call of `engine` in this
    process: yields its outputs (new tokens and text deltas) as steps make them; the last
    is finished. `engine`: an `Engine`, or a `gpufn.model` whose instance is one.
    `priority` (default: the running call's) decides who joins first when slots are
    full. A cancel of the call (or closing this iterator) leaves the batch at the next
    step. A request the engine fails alone raises `RequestFailed` here."""
    if hasattr(engine, "get") and not hasattr(engine, "step"):
        engine = engine.get()  # a gpufn.model: its resident instance
    ctx = ctxmod.current()
    if priority is None:
        priority = ctx.priority if ctx is not None else 0
    rid = request_id or (f"{ctx.invocation_id}/{ctx.attempt}" if ctx is not None
                         else uuid.uuid4().hex)
    driver = driver_for(engine)
    stream = driver.submit(rid, prompt, params or SamplingParams(), priority=priority,
                           preemptible=preemptible)
    finished = False
    try:
        while True:
            with stream.cond:
                while not stream.outputs:
                    stream.cond.wait(WAIT_SLICE)  # short waits let a cancel land
                out = stream.outputs.popleft()
            if out.finished:
                finished = True
                if out.finish_reason is FinishReason.ERROR:
                    raise RequestFailed(out.error or "the engine failed this request")
                if out.finish_reason is FinishReason.ABORT:
                    raise Cancelled(f"request {rid} was aborted")
            yield out
            if finished:
                return
    finally:
        if not finished:
            driver.cancel(rid)


def text(engine: Any, prompt: Prompt, params: SamplingParams | None = None,
         **options: Any) -> Iterator[str]:
    """`generate`, as text deltas (what a plain streaming function yields)."""
    for out in generate(engine, prompt, params, **options):
        if out.text:
            yield out.text


def chat_pieces(engine: Any, prompt: Prompt, params: SamplingParams | None = None,
                **options: Any) -> Iterator[str | dict[str, Any]]:
    """`generate` in the shape a `@gpufn.chat_model` function yields: text pieces, then a
    dict with `usage` and `finish_reason`."""
    last: RequestOutput | None = None
    for out in generate(engine, prompt, params, **options):
        if out.text:
            yield out.text
        last = out
    if last is not None:
        yield {"usage": {"prompt_tokens": last.prompt_tokens,
                         "completion_tokens": last.completion_tokens},
               "finish_reason": (last.finish_reason or FinishReason.STOP).value}


def completion_pieces(engine: Any, prompt: Prompt, params: SamplingParams | None = None, *,
                      echo: bool = False, max_tokens: int | None = None,
                      **options: Any) -> Iterator[dict[str, Any]]:
    """`generate` in the shape a `@gpufn.completion_model` function yields (docs/api.md):
    with `echo`, first the prompt itself with its tokens' logprobs (None for the first),
    then each step's text, tokens and, when `params.logprobs` is set, their logprobs;
    last `finish_reason` and `usage`. `max_tokens=0` (log-likelihood of the prompt alone)
    scores the prompt and generates nothing."""
    params = params or SamplingParams()
    if echo or max_tokens == 0:
        params = _with(params, prompt_logprobs=params.logprobs or 0)
    last: RequestOutput | None = None
    for out in generate(engine, prompt, params, **options):
        if last is None and (echo or max_tokens == 0) and out.prompt_logprobs is not None:
            yield _echoed(engine, prompt, out)
        last = out
        if max_tokens == 0:
            break  # the prompt was scored; nothing is generated
        item: dict[str, Any] = {"text": out.text}
        if out.logprobs is not None:
            item["tokens"] = [lp.chosen.token for lp in out.logprobs]
            item["token_logprobs"] = [lp.chosen.logprob for lp in out.logprobs]
            item["top_logprobs"] = [{t.token: t.logprob for t in lp.top} for lp in out.logprobs]
        if out.text or out.logprobs:
            yield item
    if last is not None:
        done = max_tokens == 0
        yield {"finish_reason": "length" if done else
               (last.finish_reason or FinishReason.STOP).value,
               "usage": {"prompt_tokens": last.prompt_tokens,
                         "completion_tokens": 0 if done else last.completion_tokens}}


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


def _echoed(engine: Any, prompt: Prompt, out: RequestOutput) -> dict[str, Any]:
    """The prompt as a completion's echo: its text, tokens and their logprobs."""
    if hasattr(engine, "get") and not hasattr(engine, "step"):
        engine = engine.get()
    tokenizer = engine.tokenizer
    ids = engine.prompt_ids(prompt)
    lps = out.prompt_logprobs or ()
    tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    return {"text": "".join(tokens) if not isinstance(prompt, str) else prompt,
            "tokens": tokens,
            "token_logprobs": [lp.chosen.logprob if lp is not None else None for lp in lps],
            "top_logprobs": [({t.token: t.logprob for t in lp.top} if lp is not None else None)
                             for lp in lps]}
