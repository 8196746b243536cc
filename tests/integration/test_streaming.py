"""Generator functions stream their values: in order, under backpressure, cancelled when
the consumer stops, raising a mid-stream error where it happened; from a gang too."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest

import gpufn
from gpufn.api.calls import CREDIT_MOST
from gpufn.wire import protocol as p

from .stream_funcs import async_gen_fails, async_tokens, count, fails_after, gang_stream, produce

WINDOW = p.STREAM_WINDOW


def _wait_for(check, timeout: float = 30.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.02)


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_values_arrive_in_order_with_stream_meta(cluster: gpufn.Client) -> None:
    assert list(count.remote_gen(100)) == list(range(100))
    call = count.spawn(40)
    assert list(call.stream()) == list(range(40))
    meta = call.result_meta()
    assert meta["items"] == 40 and meta["first_item_s"] >= 0 and meta["items_per_s"] > 0
    with pytest.raises(gpufn.InvalidSpec, match="remote_gen"):
        count.remote(3)
    with pytest.raises(gpufn.InvalidSpec, match="stream"):
        call.get()


def test_first_value_arrives_long_before_the_generator_ends(cluster: gpufn.Client) -> None:
    list(count.remote_gen(1))  # warm: code loaded on a worker
    t0 = time.monotonic()
    stream = count.remote_gen(8, 0.25)
    first = next(stream)
    t_first = time.monotonic() - t0
    rest = list(stream)
    t_all = time.monotonic() - t0
    assert [first, *rest] == list(range(8))
    assert t_all >= 2.0 and t_first < t_all / 2, (t_first, t_all)


def test_a_slow_consumer_blocks_the_producer(cluster: gpufn.Client, tmp_path: Path) -> None:
    progress, marker = tmp_path / "progress", tmp_path / "stopped"
    stream = produce.remote_gen(str(progress), str(marker), 10_000)
    assert next(stream) == 0
    # The producer fills the window, then waits: it never runs ahead of the consumer.
    _wait_for(lambda: _read_int(progress) >= WINDOW, what="the window to fill")
    time.sleep(0.5)  # time in which an unbounded producer would run far ahead
    assert _read_int(progress) == WINDOW
    # CREDIT_MOST read in all (a Credit is sent by then, values waiting or not): the
    # producer may run to CREDIT_MOST + WINDOW
    for _ in range(CREDIT_MOST - 1):
        next(stream)
    _wait_for(lambda: _read_int(progress) >= CREDIT_MOST + WINDOW, what="the producer to move on")
    time.sleep(0.5)
    assert _read_int(progress) == CREDIT_MOST + WINDOW
    assert not marker.exists()
    stream.close()
    _wait_for(marker.exists, what="the generator's finally block")


def test_break_and_garbage_collection_cancel_the_generator(cluster: gpufn.Client,
                                                           tmp_path: Path) -> None:
    for i, _v in enumerate(produce.remote_gen(str(tmp_path / "p1"), str(tmp_path / "m1"))):
        if i == 3:
            break
    gc.collect()
    _wait_for((tmp_path / "m1").exists, what="cancel on break")
    stream = produce.remote_gen(str(tmp_path / "p2"), str(tmp_path / "m2"))
    next(stream)
    del stream
    gc.collect()
    _wait_for((tmp_path / "m2").exists, what="cancel on garbage collection")
    assert _read_int(tmp_path / "p2") <= 1 + WINDOW
    assert list(count.remote_gen(3)) == [0, 1, 2]  # the workers serve on


def test_an_error_after_some_values_is_raised_there(cluster: gpufn.Client) -> None:
    got = []
    with pytest.raises(KeyError, match="gave up after 3"):
        for v in fails_after.remote_gen(3):
            got.append(v)
    assert got == [0, 1, 2]
    call = fails_after.spawn(2)
    stream = call.stream()
    assert [next(stream), next(stream)] == [0, 1]
    with pytest.raises(KeyError):
        next(stream)


def test_async_iteration_and_async_generators(cluster: gpufn.Client) -> None:
    async def main() -> tuple[list[int], list[str], list[int]]:
        a = [v async for v in count.remote_gen.aio(5)]
        b = [t async for t in async_tokens.remote_gen.aio(4)]
        c: list[int] = []
        with pytest.raises(ConnectionError, match="async stream broke"):
            async for v in async_gen_fails.remote_gen.aio(2):
                c.append(v)
        return a, b, c

    a, b, c = asyncio.run(main())
    assert a == list(range(5)) and b == ["tok0", "tok1", "tok2", "tok3"] and c == [0, 1]
    assert list(async_tokens.remote_gen(2)) == ["tok0", "tok1"]


def test_gang_streams_rank_zero_values(cluster: gpufn.Client) -> None:
    pytest.importorskip("torch")
    call = gang_stream.spawn(6)
    values = list(call.stream())
    assert values == [(0, 3 + i) for i in range(6)]  # rank 0's; all_reduce of ranks 1 + 2
    meta = call.result_meta()
    assert meta["items"] == 6 and len(meta["devices"]) == 2


def test_generator_options_refused_at_decoration() -> None:
    def gen():  # type: ignore[no-untyped-def]
        yield 1

    with pytest.raises(gpufn.InvalidSpec, match="batched"):
        gpufn.gpu(batch_size=4)(gen)
    with pytest.raises(gpufn.InvalidSpec, match="spmd"):
        gpufn.gpu(count=2, spmd=False)(gen)
    with pytest.raises(gpufn.InvalidSpec, match="batched"):
        count.with_options(batch_size=2)
