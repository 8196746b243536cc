"""Shared pieces of the engine tests: one tiny model per process, single-threaded torch
(the machine is shared), and drivers that run requests alone or joining at given steps."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpufn.engines.base import RequestOutput, SamplingParams  # noqa: E402
from gpufn.engines.testing import tiny_model_and_tokenizer  # noqa: E402
from gpufn.engines.transformers_engine import TransformersEngine  # noqa: E402


@cache
def model_and_tokenizer() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer(seed=0)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine(max_batch: int = 32, **options: Any) -> TransformersEngine:
    model, tok = model_and_tokenizer()
    return TransformersEngine(model, tok, max_batch=max_batch, **options)


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: Any
    params: SamplingParams
    priority: int = 0
    join_at: int = 0  # the step before which it is added


@dataclass
class Result:
    outputs: list[RequestOutput]

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]


def drive(eng: TransformersEngine, reqs: Sequence[Req], max_steps: int = 10_000,
          on_step: Any = None) -> dict[str, Result]:
    """Run `reqs` to the end, each added before step `join_at`; `on_step(step, eng)` runs
    before each step (to abort or preempt)."""
    results = {r.rid: Result([]) for r in reqs}
    pending = sorted(reqs, key=lambda r: r.join_at)
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0].join_at <= step:
            r = pending.pop(0)
            eng.add_request(r.rid, r.prompt, r.params, r.priority)
        if on_step is not None:
            on_step(step, eng)
        for out in eng.step():
            results.setdefault(out.request_id, Result([])).outputs.append(out)
        step += 1
        assert step < max_steps, "the engine did not finish"
    return results


def alone(eng: TransformersEngine, r: Req) -> Result:
    return drive(eng, [Req(r.rid, r.prompt, r.params)])[r.rid]
