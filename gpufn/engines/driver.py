"""Stepped inference inside a worker: calls of one engine share each step. Each engine of a
worker process has one driver thread (`gpufn.engines.stepping`) that steps its `StepLoop`;
each call's own thread submits its request (`generate`) and waits for its outputs, so a
call joins the running batch between two steps and leaves it alone when it ends. A sharded
model's engine steps in lockstep on its gang (`gpufn.engines.lockstep`)."""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

from gpufn.engines.base import (
    Engine,
    FinishReason,
    Prompt,
    RequestOutput,
    SamplingParams,
)
from gpufn.engines.lockstep import lockstep_driver
from gpufn.engines.stepping import (
    ARBITER,
    IDLE_SECONDS,
    WAIT_SLICE,
    Arbiter,
    Driver,
    RequestFailed,
    Submitted,
)
from gpufn.exceptions import Cancelled
from gpufn.runtime import context as ctxmod

__all__ = ["ARBITER", "IDLE_SECONDS", "WAIT_SLICE", "Arbiter", "Driver", "RequestFailed",
           "Submitted", "chat_pieces", "completion_pieces", "driver_for", "generate", "text"]

_drivers: weakref.WeakKeyDictionary[Any, Driver] = weakref.WeakKeyDictionary()
_drivers_lock = threading.Lock()


def driver_for(engine: Engine, *, sharded: bool = False, **options: Any) -> Driver:
    """This process's driver of `engine` (made on first use; one per engine object).
    `sharded`: the engine of a sharded model (`@gpufn.model(count=N)`); in a gang's call
    its driver is this rank's part of the gang's lockstep (`gpufn.engines.lockstep`)."""
    with _drivers_lock:
        driver = _drivers.get(engine)
        if driver is None:
            driver = _drivers[engine] = _new_driver(engine, sharded, **options)
        return driver


def _new_driver(engine: Engine, sharded: bool, **options: Any) -> Driver:
    ctx = ctxmod.current()
    if sharded and ctx is not None and ctx.world_size > 1:
        return lockstep_driver(engine, ctx.rank, ctx.group, **options)
    return Driver(engine, **options)


def generate(engine: Any, prompt: Prompt, params: SamplingParams | None = None, *,
             priority: int | None = None, preemptible: bool = False,
             request_id: str | None = None) -> Iterator[RequestOutput]:
    """Generate for one request in the step shared by every call of `engine` in this
    process: yields its outputs (new tokens and text deltas) as steps make them; the last
    is finished. `engine`: an `Engine`, or a `gpufn.model` whose instance is one (a
    sharded model's engine steps in lockstep on its gang: requests enter on rank 0).
    `priority` (default: the running call's) decides who joins first when slots are
    full. A cancel of the call (or closing this iterator) leaves the batch at the next
    step. A request the engine fails alone raises `RequestFailed` here."""
    sharded = bool(getattr(engine, "sharded", False))  # a gpufn.model over a gang
    if hasattr(engine, "get") and not hasattr(engine, "step"):
        engine = engine.get()  # a gpufn.model: its resident instance
    ctx = ctxmod.current()
    if priority is None:
        priority = ctx.priority if ctx is not None else 0
    rid = request_id or (f"{ctx.invocation_id}/{ctx.attempt}" if ctx is not None
                         else uuid.uuid4().hex)
    driver = driver_for(engine, sharded=sharded)
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
