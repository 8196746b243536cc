"""Functions the integration tests run remotely (importable by workers: by reference)."""

from __future__ import annotations

import os
import time

import gpufn


@gpufn.gpu(memory="1GiB")
def square(x: int) -> int:
    return x * x


@gpufn.gpu
def where() -> dict[str, object]:
    ctx = gpufn.context()
    return {"pid": os.getpid(), "device": str(ctx.device), "rank": ctx.rank,
            "world": ctx.world_size, "inv": ctx.invocation_id, "attempt": ctx.attempt}


@gpufn.gpu
def fail(x: int) -> int:
    if x == 3:
        raise ValueError(f"bad input {x}")
    return x


@gpufn.gpu
def sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@gpufn.gpu
def echo(x: object) -> object:
    return x


@gpufn.gpu
def noop() -> None:
    return None
