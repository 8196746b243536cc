"""The app the HTTP gateway tests deploy (as `t`): plain, failing, slow, streaming, batched
and gang functions, each with a signature the gateway checks arguments against."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gpufn


def _mark(marker: str, text: str) -> None:
    if marker:
        Path(marker).write_text(text)


@gpufn.gpu
def echo(x: Any, *, scale: int = 1, note: str = "") -> dict[str, Any]:
    """Its arguments back, as JSON."""
    return {"x": x, "scale": scale, "note": note}


@gpufn.gpu
def noop() -> None:
    return None


@gpufn.gpu
def touch(marker: str) -> str:
    _mark(marker, "ran")
    return "ran"


@gpufn.gpu
def tensor() -> Any:
    import torch

    return torch.zeros(2)


@gpufn.gpu
def fail(message: str) -> None:
    raise ValueError(message)


@gpufn.gpu
def sleepy(seconds: float, marker: str = "", started: str = "") -> float:
    """Sleeps in short steps (a cancel lands at once); `marker` is written by its finally,
    `started` when it starts (a call under a lease is not in the scheduler's status)."""
    _mark(started, "started")
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.02)
        return seconds
    finally:
        _mark(marker, "finally")


@gpufn.gpu(concurrency=1)
def blocker(seconds: float) -> float:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)
    return seconds


@gpufn.gpu
def count(n: int, delay: float = 0.0, fail_at: int = -1, marker: str = "") -> Iterator[int]:
    """0 .. n-1, one every `delay` seconds; raises at `fail_at`; `marker` is written by its
    finally (when the stream ends, fails or is cancelled)."""
    try:
        for i in range(n):
            if i == fail_at:
                raise RuntimeError(f"boom at {i}")
            yield i
            if delay:
                time.sleep(delay)
    finally:
        _mark(marker, "finally")


@gpufn.gpu
def tensors(n: int) -> Iterator[Any]:
    import torch

    yield 1
    yield torch.ones(n)


@gpufn.gpu(batch_size=8, batch_wait_ms=300)
def double(x: list[int]) -> list[int]:
    """Batched: a list per argument in, a list of outputs out."""
    return [2 * v for v in x]


@gpufn.gpu(count=2, gather=True)
def ranks() -> int:
    return gpufn.context().rank


@gpufn.gpu(count=2, spmd=False)
def whole(x: int, as_tensor: bool = False) -> Any:
    """One process over both devices (its helper reads and writes the JSON itself)."""
    if as_tensor:
        import torch

        return torch.zeros(1)
    return {"x": x, "devices": len(gpufn.context().devices)}
