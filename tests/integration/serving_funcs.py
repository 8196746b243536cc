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
def paced(prompt: str, max_tokens: int, pause: float) -> Iterator[str]:
    """`complete` whose caller takes `pause` seconds over each token: the call stays
    running long enough for anyone to look at what it holds."""
    import time

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for text in engine_driver.text(tiny_engine, prompt, params):
        yield text
        time.sleep(pause)


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



def build_full_engine(seed: int, max_batch: int) -> Any:
    """The tiny Llama at its full size (12M parameters): steps bound by compute, not by
    Python, so two engines' turns show in their latencies."""
    from gpufn.engines import TransformersEngine
    from gpufn.engines.testing import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(seed=seed)
    return TransformersEngine(model, tokenizer, max_batch=max_batch)


@gpufn.model(memory="64MiB")
def high_engine() -> Any:
    return build_full_engine(0, 4)


@gpufn.model(memory="64MiB")
def other_engine() -> Any:
    return build_full_engine(1, 32)


@gpufn.gpu(models=[other_engine], concurrency=32, memory="16MiB")
def complete_other(prompt: str, max_tokens: int = 16) -> Iterator[str]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    yield from engine_driver.text(other_engine, prompt, params)


@gpufn.gpu(models=[high_engine], concurrency=4, memory="16MiB")
def timed(prompt: str, max_tokens: int) -> Iterator[tuple[str, float]]:
    """Each token with the worker's clock when its step handed it to this call."""
    import time

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for out in engine_driver.generate(high_engine, prompt, params):
        yield out.text, time.monotonic()


@gpufn.gpu(models=[other_engine, high_engine])
def two_engine_steps() -> tuple[int, int, list[int]]:
    """How many steps this worker's two engines have taken, and the other's latest batches."""
    other = engine_driver.driver_for(other_engine.get())
    high = engine_driver.driver_for(high_engine.get())
    return other.steps, high.steps, list(other.batch_sizes)[-5:]


@gpufn.gpu(models=[tiny_engine], concurrency=16, memory="4MiB")
def complete_whole(prompt: str, max_tokens: int = 16) -> Iterator[str]:
    """Streams its whole text as one value when the request ends (nothing before)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    yield "".join(engine_driver.text(tiny_engine, prompt, params))


@gpufn.gpu(models=[tiny_engine])
def engine_batch() -> int:
    """How many requests this worker's engine stepped in its latest step."""
    sizes = engine_driver.driver_for(tiny_engine.get()).batch_sizes
    return sizes[-1] if sizes else 0
