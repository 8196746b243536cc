"""A worker killed mid-batch (issue 31): its engine's requests are lost together, and each
call fails or retries alone under the streaming rules (docs/api.md): a call with retries
that streamed nothing yet runs again and completes with its alone text; one that had
streamed values ends with `WorkerLost` (never restarted mid-stream); one without retries
fails `WorkerLost`. Nothing hangs, and the restarted worker serves again."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

import gpufn
from gpufn.engines import SamplingParams
from gpufn.engines import driver as engine_driver

from ..conftest import cluster_with, wait_ready
from .serving_funcs import build_engine, complete, complete_whole, engine_batch

pytestmark = pytest.mark.timeout(300)

N = 1000  # tokens each request asks for: all are mid-generation when the worker dies
WHOLE = ["The quick brown fox", "Hello! How are", "Numbers: 0 1 2", "To be or not"]


@pytest.fixture(scope="module")
def one_device() -> Iterator[gpufn.Client]:
    with cluster_with(GPUFN_CPU_DEVICES=1) as client:
        yield client


@pytest.fixture(scope="module")
def alone() -> dict[str, str]:
    """Each whole-text prompt's text generated alone, in this process."""
    engine = build_engine()
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    return {p: "".join(engine_driver.text(engine, p, params)) for p in WHOLE}


def _rest(stream: Iterator[str]) -> tuple[str, Any]:
    """Read a stream to its end: ('ok', text) or ('error', the exception)."""
    try:
        return "ok", "".join(stream)
    except gpufn.GpufnError as e:
        return "error", e


def test_a_worker_killed_mid_batch_fails_or_retries_each_call_alone(
        one_device: gpufn.Client, alone: dict[str, str]) -> None:
    list(complete.remote_gen("warm", 1))  # the model loaded, the code on the worker
    retried = complete.with_options(retries=2)
    streaming = [retried.spawn(f"stream {i}", N) for i in range(4)]
    bare = [complete.spawn(f"bare {i}", N) for i in range(4)]  # retries=0
    whole = [complete_whole.with_options(retries=2).spawn(p, N) for p in WHOLE]
    bare_whole = complete_whole.spawn("Water boils at", N)  # retries=0, streamed nothing
    streams = [c.stream() for c in streaming + bare]
    for s in streams:
        next(s)  # each has streamed a value: the batch is generating
    deadline = time.monotonic() + 60  # the calls reach the engine in their own time
    while (batch := engine_batch.remote()) < len(streams) + len(whole) + 1:
        assert time.monotonic() < deadline, f"{batch} requests in the batch"
        time.sleep(0.05)
    pid = one_device.status()["devices"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    with cf.ThreadPoolExecutor(len(streams) + len(whole) + 1) as pool:
        ends = [pool.submit(_rest, s) for s in [*streams, bare_whole.stream()]]
        wholes = [pool.submit(_rest, c.stream()) for c in whole]
        got = [f.result(timeout=200) for f in ends]  # nothing hangs
        texts = [f.result(timeout=200) for f in wholes]
    for kind, err in got[:4]:  # retries, but it had streamed: never restarted mid-stream
        assert kind == "error" and isinstance(err, gpufn.WorkerLost), err
        assert "streamed" in str(err), err
    for kind, err in got[4:]:  # no retries
        assert kind == "error" and isinstance(err, gpufn.WorkerLost), err
        assert "after 1 attempt(s)" in str(err), err
    assert "Set retries=N" in str(got[-1][1])  # the one that streamed nothing says the fix
    # Streamed nothing yet, with retries: run again on the restarted worker, each exact.
    assert texts == [("ok", alone[p]) for p in WHOLE]
    assert all(c.result_meta()["attempts"] == 2 for c in whole)
    wait_ready(one_device)
    assert one_device.status()["devices"][0]["pid"] != pid
    assert len("".join(complete.remote_gen("after", 4))) > 0  # the new worker serves
