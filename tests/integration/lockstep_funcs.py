"""A gang's functions for the sharded step loop: the tiny Llama's engine sharded over two
devices (tensor parallel), and a streaming call of it on the gang."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gpufn
from gpufn.engines import driver as engine_driver

from ._lockstep_ranks import build, params


@gpufn.model(memory="64MiB", count=2)
def tp_engine() -> Any:
    return build(True)


@gpufn.gpu(count=2, models=[tp_engine], timeout=240)
def sharded_complete(prompt: str, n: int, stop: tuple[str, ...] = ()) -> Iterator[str]:
    yield from engine_driver.text(tp_engine, prompt, params(n, tuple(stop)))


@gpufn.gpu(count=2, models=[tp_engine], timeout=60, gather=True)
def lockstep_steps() -> tuple[str, int]:
    """Each rank's driver of the engine (its part of the lockstep) and its count of steps."""
    driver = engine_driver.driver_for(tp_engine.get())
    return type(driver).__name__, driver.steps
