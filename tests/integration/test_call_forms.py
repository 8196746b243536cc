"""Every kind of Python function and the rest of the call API: async def (interleaved
with concurrency=k, cancelled), map(kwargs=), for_each, spawn_map, gather,
FunctionCall.from_id from another process, and Retries with backoff."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gpufn

from .funcs import fail
from .stream_funcs import (
    add,
    async_double,
    async_nap,
    async_wait_forever,
    flaky,
    touch,
    wrong_error,
)

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(check, timeout: float = 30.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.02)


def test_async_def_returns_its_value_with_its_context(cluster: gpufn.Client) -> None:
    out = async_double.remote(21)
    assert out["value"] == 42 and isinstance(out["inv"], str) and out["inv"]
    calls = [async_double.spawn(i, 0.05) for i in range(4)]
    outs = gpufn.gather(*calls)
    assert [o["value"] for o in outs] == [0, 2, 4, 6]
    assert len({o["inv"] for o in outs}) == 4  # each call sees its own gpufn.context()


def test_async_calls_interleave_with_concurrency(cluster: gpufn.Client) -> None:
    async_nap.remote(0.01)  # warm
    n = 8  # 4 per device at concurrency=4 on the 2 devices
    t0 = time.monotonic()
    naps = list(async_nap.map([2.0] * n))
    took = time.monotonic() - t0
    assert all(1.9 < t < 4.0 for t, _, _ in naps)
    loops: dict[int, set[int]] = {}
    for _, pid, loop in naps:
        loops.setdefault(pid, set()).add(loop)
    assert all(len(ids) == 1 for ids in loops.values()), "one event loop per worker"
    # One after another that is >= 8 s on each device; interleaved on one loop, ~2 s.
    assert took < 5.0, f"{n} naps of 2 s took {took:.1f}s: they did not interleave"


def test_cancel_cancels_the_async_task(cluster: gpufn.Client, tmp_path: Path) -> None:
    started, marker = tmp_path / "started", tmp_path / "cancelled"
    call = async_wait_forever.spawn(str(started), str(marker))
    _wait_for(started.exists, what="the coroutine to start")
    call.cancel()
    _wait_for(marker.exists, what="the task's finally block")
    with pytest.raises(gpufn.Cancelled):
        call.get(timeout=30)
    assert async_double.remote(1)["value"] == 2  # the loop serves on


def test_map_kwargs_for_each_spawn_map_gather(cluster: gpufn.Client, tmp_path: Path) -> None:
    assert list(add.map([1, 2, 3], kwargs={"scale": 10})) == [10, 20, 30]
    assert list(add.map([1, 2], [3, 4], kwargs={"scale": 2})) == [8, 12]
    assert touch.for_each([str(tmp_path)] * 3, ["a", "b", "c"]) is None  # type: ignore[func-returns-value]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="bad input 3"):
        fail.for_each(range(5))
    fail.for_each(range(5), ignore_exceptions=True)
    calls = add.spawn_map(range(5), kwargs={"y": 1})
    assert len(calls) == 5 and all(isinstance(c, gpufn.FunctionCall) for c in calls)
    assert gpufn.gather(*calls) == [1, 2, 3, 4, 5]
    assert gpufn.FunctionCall.gather(*calls[:2]) == [1, 2]
    with pytest.raises(ValueError, match="bad input 3"):
        gpufn.gather(*fail.spawn_map(range(5)))


_ATTACH = textwrap.dedent("""
    import sys
    from pathlib import Path
    import gpufn
    gpufn.connect(sys.argv[1], token=sys.argv[2])
    call = gpufn.FunctionCall.from_id(sys.argv[3])
    Path(sys.argv[4]).write_text("attached")
    try:
        print(repr(call.get(timeout=60)))
    except gpufn.GpufnError as e:
        print("error", type(e).__name__, e)
""")


def _attach(c: gpufn.Client, call_id: str, flag: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _ATTACH, c.address, c.token, call_id, str(flag)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)


def test_from_id_collects_a_result_in_another_process(cluster: gpufn.Client, tmp_path: Path) -> None:
    from .funcs import sleepy

    call = sleepy.spawn(3.0)
    live = _attach(cluster, call.id, tmp_path / "a1")  # attaches while it runs
    out, _ = live.communicate(timeout=120)
    assert call.get() == 3.0 and out.strip() == "3.0"
    late = _attach(cluster, call.id, tmp_path / "a2")  # after it ended: the kept result
    out, _ = late.communicate(timeout=120)
    assert out.strip() == "3.0"
    unknown = _attach(cluster, "no-such-call", tmp_path / "a3")
    out, _ = unknown.communicate(timeout=120)
    assert out.startswith("error GpufnError") and "knows no call" in out
    assert gpufn.FunctionCall.from_id(call.id).get(timeout=30) == 3.0  # in this process too


def test_retries_on_a_raised_exception_with_backoff(cluster: gpufn.Client, tmp_path: Path) -> None:
    t0 = time.monotonic()
    call = flaky.spawn(str(tmp_path / "c1"), 2)
    assert call.get(timeout=60) == 3
    took = time.monotonic() - t0
    assert call.result_meta()["attempts"] == 3
    assert took >= 0.2 + 0.4, f"retried after {took:.2f}s: no backoff"  # 0.2 s, then 0.4 s
    with pytest.raises(ConnectionError, match="attempt 4 failed"):
        flaky.remote(str(tmp_path / "c2"), 10)  # 1 run + 3 retries, then the last error
    assert (tmp_path / "c2").read_text() == "4"
    with pytest.raises(ValueError, match="not retried"):
        wrong_error.remote(str(tmp_path / "c3"))  # not in on=(ConnectionError,)
    assert (tmp_path / "c3").read_text() == "1"


def test_async_functions_reach_their_models(cluster: gpufn.Client) -> None:
    from .stream_funcs import async_gen_uses_model, async_uses_model

    assert async_uses_model.remote("answer") == 42
    assert list(async_gen_uses_model.remote_gen("answer", 3)) == [42, 43, 44]
