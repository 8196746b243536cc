"""Calls of one model step together on a worker (continuous batching): concurrent
requests each get exactly their alone text, in far fewer steps than tokens; a failing
request fails alone; a cancelled one leaves the batch."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator

import pytest

import gpufn
from gpufn.engines import SamplingParams
from gpufn.engines import driver as engine_driver

from ..conftest import cluster_with
from .serving_funcs import build_engine, complete, engine_steps, fails_on, paced

pytestmark = pytest.mark.timeout(300)

PROMPTS = [("The quick brown fox", 12, ()), ("Hello! How are", 20, ()),
           ("Numbers: 0 1 2", 6, ()), ("Models are loaded once", 16, (" the",)),
           ("GPUs decode many", 9, ()), ("To be or not", 24, ()),
           ("def add(a, b):", 14, ("\n",)), ("A journey of a thousand", 11, ()),
           ("Le petit chat", 18, ()), ("Call me Ishmael.", 7, ()),
           ("The rain in Spain", 22, ()), ("Water boils at", 13, ()),
           ("Please write a short poem", 17, ()), ("It was the best of", 8, ()),
           ("Continuous batching lets", 19, ()), ("In the beginning", 10, ())]


@pytest.fixture(scope="module")
def one_device() -> Iterator[gpufn.Client]:
    with cluster_with(GPUFN_CPU_DEVICES=1) as client:
        yield client


def _alone() -> list[str]:
    """Each prompt's text generated alone, in this process (one request at a time)."""
    engine = build_engine()
    out = []
    for prompt, n, stop in PROMPTS:
        params = SamplingParams(max_tokens=n, stop=tuple(stop), ignore_eos=True)
        out.append("".join(engine_driver.text(engine, prompt, params)))
    return out


def test_sixteen_concurrent_requests_each_get_their_alone_text(one_device: gpufn.Client) -> None:
    alone = _alone()
    list(complete.remote_gen("warm", 1))  # the model loaded, the code on the worker
    before = engine_steps.remote()
    calls = [complete.spawn(prompt, n, stop) for prompt, n, stop in PROMPTS]
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        texts = list(pool.map(lambda c: "".join(c.stream()), calls))
    steps = engine_steps.remote() - before
    assert texts == alone
    tokens = sum(n for _, n, _ in PROMPTS)
    assert steps < tokens / 2, f"{steps} steps for {tokens} tokens: the calls did not share steps"


def test_each_running_request_holds_its_kv_bytes_in_the_ledger(one_device: gpufn.Client) -> None:
    # The calls are paced (0.1 s a token) so that they are surely running while the test
    # looks: unpaced, the tiny model finishes sixteen requests before a fast machine's
    # first status answer (CI saw 0 bytes held).
    list(complete.remote_gen("warm", 1))
    idle = one_device.status()["devices"][0]["used"]  # the model alone
    calls = [paced.spawn(f"request {i}", 40, 0.1) for i in range(4)]
    held, deadline = 0, time.monotonic() + 60
    while held < 4 * 4 * 2**20 and time.monotonic() < deadline:
        held = max(held, one_device.status()["devices"][0]["used"] - idle)
        time.sleep(0.02)
    for call in calls:
        call.cancel()
    # Each running call holds its sequence's KV bytes (memory="4MiB") in the device's ledger.
    assert held >= 4 * 4 * 2**20, f"the ledger held {held} bytes for the running calls"
    deadline = time.monotonic() + 30
    while one_device.status()["devices"][0]["used"] > idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert one_device.status()["devices"][0]["used"] == idle, "cancelled calls kept their bytes"


def test_a_request_whose_kv_cannot_fit_is_refused_at_once(one_device: gpufn.Client) -> None:
    with pytest.raises(gpufn.Unschedulable, match="memory"):
        list(complete.with_options(memory="64GiB").remote_gen("too big", 4))


def test_a_failing_request_fails_alone(one_device: gpufn.Client) -> None:
    good = [fails_on.spawn(f"ok {i}", 12) for i in range(4)]
    bad = fails_on.spawn("bad", 12)
    with pytest.raises(gpufn.GpufnError, match=r"logit_bias|token"):
        list(bad.stream())
    assert all(len("".join(c.stream())) > 0 for c in good)


def test_a_cancelled_request_leaves_the_batch(one_device: gpufn.Client) -> None:
    long = complete.spawn("The quick brown fox", 400)
    stream = long.stream()
    next(stream)
    short = complete.spawn("Hello! How are", 5)
    t0 = time.monotonic()
    assert len("".join(short.stream())) > 0
    assert time.monotonic() - t0 < 60
    long.cancel()
    with pytest.raises(gpufn.GpufnError):
        for _ in stream:
            pass
