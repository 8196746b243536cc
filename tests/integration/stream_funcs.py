"""Generator, async and retried functions the streaming and call-form tests run remotely."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import gpufn


@gpufn.gpu
def count(n: int, delay: float = 0.0) -> Iterator[int]:
    for i in range(n):
        if delay:
            time.sleep(delay)
        yield i


@gpufn.gpu
def produce(progress: str, marker: str, n: int = 10_000) -> Iterator[int]:
    """Writes how many values it produced before each yield; its finally leaves a marker."""
    try:
        for i in range(n):
            Path(progress).write_text(str(i + 1))
            yield i
    finally:
        Path(marker).write_text("stopped")


@gpufn.gpu
def fails_after(n: int) -> Iterator[int]:
    yield from range(n)
    raise KeyError(f"gave up after {n}")


@gpufn.gpu(count=2)
def gang_stream(n: int) -> Iterator[tuple[int, int]]:
    import torch
    import torch.distributed as dist

    ctx = gpufn.context()
    for i in range(n):
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t, group=ctx.group)  # every rank steps in lockstep
        yield ctx.rank, int(t.item()) + i


@gpufn.gpu
async def async_double(x: int, delay: float = 0.0) -> dict[str, object]:
    await asyncio.sleep(delay)
    return {"value": 2 * x, "inv": gpufn.context().invocation_id, "pid": os.getpid()}


@gpufn.gpu(concurrency=4)
async def async_nap(seconds: float) -> tuple[float, int, int]:
    """How long it slept, and the worker process and event loop it ran on."""
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    return time.monotonic() - t0, os.getpid(), id(asyncio.get_running_loop())


@gpufn.gpu
async def async_wait_forever(started: str, marker: str) -> None:
    Path(started).write_text("started")
    try:
        await asyncio.sleep(3600)
    finally:
        Path(marker).write_text("cancelled")


@gpufn.gpu
async def async_tokens(n: int) -> AsyncIterator[str]:
    for i in range(n):
        await asyncio.sleep(0)
        yield f"tok{i}"
    if n < 0:
        yield "never"


@gpufn.gpu
async def async_gen_fails(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i
    raise ConnectionError("async stream broke")


@gpufn.gpu
def add(x: int, y: int = 0, scale: int = 1) -> int:
    return (x + y) * scale


@gpufn.gpu
def touch(directory: str, name: object) -> None:
    Path(directory, str(name)).write_text("done")


@gpufn.gpu(retries=gpufn.Retries(max_retries=3, backoff=2.0, initial_delay=0.2,
                                 on=(ConnectionError,)))
def flaky(counter: str, fail_times: int) -> int:
    """Raises ConnectionError the first `fail_times` times (counted in a file)."""
    path = Path(counter)
    n = int(path.read_text()) if path.exists() else 0
    path.write_text(str(n + 1))
    if n < fail_times:
        raise ConnectionError(f"attempt {n + 1} failed")
    return n + 1


@gpufn.gpu(retries=gpufn.Retries(max_retries=3, initial_delay=0.0, on=(ConnectionError,)))
def wrong_error(counter: str) -> None:
    path = Path(counter)
    n = int(path.read_text()) if path.exists() else 0
    path.write_text(str(n + 1))
    raise ValueError("not retried")


@gpufn.model(memory="1MiB")
def tiny_table() -> dict[str, int]:
    return {"answer": 42}


@gpufn.gpu(models=[tiny_table])
async def async_uses_model(key: str) -> int:
    await asyncio.sleep(0)
    return tiny_table.get()[key]


@gpufn.gpu(models=[tiny_table])
async def async_gen_uses_model(key: str, n: int) -> AsyncIterator[int]:
    for i in range(n):
        await asyncio.sleep(0)
        yield tiny_table.get()[key] + i
