"""Functions the serving tests run on workers: a tiny seeded Llama behind the transformers
engine, shared by every call on a device (the engine steps them together)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gpufn
from gpufn.engines import SamplingParams
from gpufn.engines import driver as engine_driver

SMALL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}


def build_engine(max_batch: int = 16) -> Any:
    from gpufn.engines import TransformersEngine
    from gpufn.engines.testing import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(seed=0, **SMALL)
    return TransformersEngine(model, tokenizer, max_batch=max_batch)


@gpufn.model(memory="64MiB")
def tiny_engine() -> Any:
    return build_engine()


@gpufn.gpu(models=[tiny_engine], concurrency=16, memory="4MiB")
def complete(prompt: str, max_tokens: int = 16, stop: tuple[str, ...] = ()) -> Iterator[str]:
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stop), ignore_eos=True)
    yield from engine_driver.text(tiny_engine, prompt, params)


@gpufn.gpu(models=[tiny_engine], concurrency=16, memory="4MiB")
def fails_on(prompt: str, max_tokens: int = 8) -> Iterator[str]:
    """A request whose own logit_bias names a token the model lacks: it fails alone."""
    bias = {10**6: 1.0} if prompt == "bad" else {}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logit_bias=bias)
    yield from engine_driver.text(tiny_engine, prompt, params)


@gpufn.gpu(models=[tiny_engine])
def engine_steps() -> int:
    """How many steps this worker's engine has taken."""
    return engine_driver.driver_for(tiny_engine.get()).steps
