"""Two models on one device share it step by step, by priority (issue 31 item 6): a
high-priority model's inter-token latency, while the other model runs a full batch of
low-priority requests, stays within 2x of its latency alone (both measured here)."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

import gpufn

from ..conftest import cluster_with
from .serving_funcs import complete_other, timed, two_engine_steps

pytestmark = pytest.mark.timeout(600)

TOKENS = 48  # the high-priority request's length
LOW_BATCH = 32  # the other model's full batch (its engine's max_batch)


@pytest.fixture(scope="module")
def one_device() -> Iterator[gpufn.Client]:
    with cluster_with(GPUFN_CPU_DEVICES=1) as client:
        yield client


def _itl(prompt: str) -> tuple[float, float]:
    """One high-priority request: its median gap between tokens on the worker's clock,
    and its mean gap as the caller received them (after the first token), in seconds."""
    worker: list[float] = []
    caller: list[float] = []
    for _, t in timed.with_options(priority=10).remote_gen(prompt, TOKENS):
        worker.append(t)
        caller.append(time.monotonic())
    assert len(worker) == TOKENS
    gaps = [b - a for a, b in itertools.pairwise(worker[1:])]
    return statistics.median(gaps), (caller[-1] - caller[1]) / (TOKENS - 2)


class LowBatch:
    """`LOW_BATCH` long low-priority streams of the other model, read as they come."""

    def __init__(self) -> None:
        self.calls = [complete_other.with_options(priority=0).spawn(f"low {i}", 1000)
                      for i in range(LOW_BATCH)]
        self.started = threading.Semaphore(0)
        self.tokens = [0] * LOW_BATCH
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True)
                        for i in range(LOW_BATCH)]
        for t in self.threads:
            t.start()

    def _read(self, i: int) -> None:
        try:
            for _ in self.calls[i].stream():
                self.tokens[i] += 1
                if self.tokens[i] == 1:
                    self.started.release()
        except gpufn.GpufnError:
            pass  # cancelled at the end

    def wait_running(self) -> None:
        for _ in range(LOW_BATCH):
            assert self.started.acquire(timeout=120), "the low-priority batch never filled"

    def stop(self) -> int:
        for c in self.calls:
            c.cancel()
        for t in self.threads:
            t.join(60)
        return sum(self.tokens)


def test_a_high_priority_model_keeps_its_latency_beside_a_full_low_batch(
        one_device: gpufn.Client) -> None:
    list(timed.remote_gen("warm", 2))  # both models loaded, the code on the worker
    list(complete_other.remote_gen("warm", 2))
    alone, shared, alone_caller, shared_caller = [], [], [], []
    for r in range(3):  # alone and shared interleaved: the machine's load hits both
        for i in range(2):
            w, c = _itl(f"Hello! How are {r}{i}")
            alone.append(w)
            alone_caller.append(c)
        low = LowBatch()
        low.wait_running()
        assert two_engine_steps.remote()[2][-1] == LOW_BATCH  # the other engine's batch is full
        for i in range(2):
            w, c = _itl(f"The quick brown fox {r}{i}")
            shared.append(w)
            shared_caller.append(c)
        assert not any(c.done() for c in low.calls), "the high call did not run beside the batch"
        low.stop()
    ratio = statistics.median(shared) / statistics.median(alone)
    caller_ratio = statistics.median(shared_caller) / statistics.median(alone_caller)
    print(f"inter-token latency beside a full batch: {ratio:.2f}x alone on the worker, "
          f"{caller_ratio:.2f}x as received ({statistics.median(alone) * 1e3:.1f} ms alone)")
    assert ratio <= 2.0, (alone, shared)
    # As the caller receives them the gaps also carry the machine's noise (transport,
    # other processes on 2 cores): a generous bound there, the 2x one above.
    assert caller_ratio <= 3.0, (alone_caller, shared_caller)
