"""The serverless call path through real processes: client -> scheduler -> worker."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import threading
import time

import pytest
import torch

import gpufn

from ..conftest import wait_ready
from ._waits import running_ids, settled_counters, wait_for, wait_idle
from .funcs import echo, fail, noop, sleepy, square, where

pytestmark = pytest.mark.timeout(90)


def test_remote_map_spawn(cluster: gpufn.Client) -> None:
    assert square.remote(7) == 49
    assert list(square.map(range(1000))) == [x * x for x in range(1000)]
    call = square.spawn(3)
    assert isinstance(call.id, str) and call.get(timeout=10) == 9 and call.done()
    assert list(square.starmap([(2,), (3,)])) == [4, 9]
    assert sorted(square.map(range(50), order_outputs=False)) == [x * x for x in range(50)]


def test_runs_in_a_worker_with_a_context(cluster: gpufn.Client) -> None:
    info = where.remote()
    assert info["pid"] != os.getpid() and info["device"] == "cpu"
    assert (info["rank"], info["world"]) == (0, 1) and isinstance(info["inv"], str)
    with pytest.raises(gpufn.GpufnError, match="only available inside"):
        where.local()


def test_functions_defined_in_the_test_body_pickle_by_value(cluster: gpufn.Client) -> None:
    offset = 5

    @gpufn.gpu
    def add(x: int) -> int:
        return x + offset

    assert add.remote(1) == 6


GLOBAL_LIST = [1]


def test_a_global_list_mutated_in_place_reaches_the_worker(cluster: gpufn.Client) -> None:
    """Code is not pickled again while nothing it reads changed, but a global mutated in
    place between two calls is seen by the second (as with .local())."""

    @gpufn.gpu
    def read_list() -> list[int]:
        return list(GLOBAL_LIST)

    assert read_list.remote() == [1]
    GLOBAL_LIST.append(2)
    try:
        assert read_list.remote() == [1, 2] == read_list.local()
        GLOBAL_LIST[0] = 5
        assert read_list.remote() == [5, 2]
    finally:
        GLOBAL_LIST[:] = [1]
    assert read_list.remote() == [1]


GLOBAL_TENSOR = torch.zeros(2)


def test_a_global_tensor_rebound_at_the_same_version_reaches_the_worker(
        cluster: gpufn.Client) -> None:
    """A new tensor bound to the same global name has the same `_version` (0) as the one
    before: the code is pickled again all the same, and the worker reads the new one."""
    global GLOBAL_TENSOR

    @gpufn.gpu
    def read_tensor() -> float:
        return float(GLOBAL_TENSOR.sum())

    assert read_tensor.remote() == 0.0
    old = GLOBAL_TENSOR
    try:
        GLOBAL_TENSOR = torch.ones(2)
        assert GLOBAL_TENSOR._version == old._version
        assert read_tensor.remote() == 2.0 == read_tensor.local()
    finally:
        GLOBAL_TENSOR = old
    assert read_tensor.remote() == 0.0


def test_exception_keeps_type_and_remote_traceback(cluster: gpufn.Client) -> None:
    with pytest.raises(ValueError, match="bad input 3") as e:
        fail.remote(3)
    cause = e.value.__cause__
    assert cause is not None and "remote traceback of fail" in str(cause)
    assert 'raise ValueError(f"bad input {x}")' in str(cause)


def test_unimportable_exception_becomes_remote_error(cluster: gpufn.Client) -> None:
    @gpufn.gpu
    def raise_private() -> None:
        import sys
        import tempfile
        import textwrap

        d = tempfile.mkdtemp()
        with open(os.path.join(d, "only_on_worker.py"), "w") as f:
            f.write(textwrap.dedent("""
                class WorkerOnlyError(Exception):
                    pass
            """))
        sys.path.insert(0, d)
        import only_on_worker

        raise only_on_worker.WorkerOnlyError("from the worker")

    with pytest.raises(gpufn.RemoteError) as e:
        raise_private.remote()
    assert e.value.type_name == "WorkerOnlyError" and "from the worker" in e.value.message
    assert "only_on_worker" in e.value.traceback


def test_unpicklable_argument_fails_at_the_call_site(cluster: gpufn.Client) -> None:
    before = settled_counters(cluster)["submitted"]
    with pytest.raises(gpufn.SerializationError, match="positional argument 0 \\(lock\\)"):
        echo.remote(threading.Lock())
    assert settled_counters(cluster)["submitted"] == before  # nothing was sent


def test_large_tensors_round_trip(cluster: gpufn.Client) -> None:
    t = torch.randn(1024, 1024)  # 4 MiB
    back = echo.remote(t)
    assert torch.equal(back, t)
    data = os.urandom(3_000_000)
    assert echo.remote(data) == data


def test_output_reaches_the_caller_with_a_prefix(cluster: gpufn.Client, capfd: pytest.CaptureFixture[str]) -> None:
    @gpufn.gpu
    def chatty(x: int) -> int:
        import logging
        import sys

        print(f"hello {x}")
        print("to stderr", file=sys.stderr)
        logging.getLogger("user").warning("a warning")
        return x

    call = chatty.spawn(42)
    assert call.get(timeout=30) == 42
    tag = f"[{chatty.name} {call.id}]"
    out = err = ""

    def arrived() -> bool:  # output may trail the result by a message
        nonlocal out, err
        o, e = capfd.readouterr()
        out, err = out + o, err + e
        return f"{tag} hello 42" in out and f"{tag} to stderr" in err and "a warning" in err
    wait_for(arrived, 10, "the call's output")


def test_async_twins(cluster: gpufn.Client) -> None:
    async def main() -> tuple[int, list[int], int]:
        one = await square.remote.aio(5)
        many = [x async for x in square.map.aio(range(20))]
        call = square.spawn(6)
        six = await call.get.aio(timeout=10)
        return one, many, six

    one, many, six = asyncio.run(main())
    assert one == 25 and many == [x * x for x in range(20)] and six == 36


def test_map_return_exceptions_and_first_failure(cluster: gpufn.Client) -> None:
    out = list(fail.map(range(6), return_exceptions=True))
    assert out[:3] == [0, 1, 2] and isinstance(out[3], ValueError) and out[4:] == [4, 5]
    with pytest.raises(ValueError, match="bad input 3"):
        list(fail.map(range(6)))


def test_an_ordered_map_raises_its_first_failure_in_input_order(cluster: gpufn.Client) -> None:
    """Input 7 fails after input 12 did: the map yields inputs 0-6 and then raises input
    7's error, saying which input and call it was (it raised input 12's, after whichever
    inputs had come by then: a different error from run to run)."""
    @gpufn.gpu
    def two_fail(x: int) -> int:
        if x == 7:
            time.sleep(1.0)
            raise ValueError("bad 7")
        if x == 12:
            raise ValueError("bad 12")
        time.sleep(0.02)
        return x

    got: list[int] = []
    with pytest.raises(ValueError, match="bad 7") as e:
        for v in two_fail.map(range(40)):
            got.append(v)
    assert got == list(range(7))
    assert any(n.startswith("(input 7 of ") and "two_fail.map, call " in n for n in e.value.__notes__)
    got = []  # unordered: the first to fail, as it comes
    with pytest.raises(ValueError, match="bad 12"):
        for v in two_fail.map(range(40), order_outputs=False):
            got.append(v)
    assert 7 not in got


def test_map_failure_cancels_what_has_not_started(cluster: gpufn.Client) -> None:
    @gpufn.gpu
    def slow_fail(x: int) -> int:
        time.sleep(0.05)
        if x == 0:
            raise RuntimeError("first one fails")
        return x

    before = settled_counters(cluster)
    with pytest.raises(RuntimeError, match="first one fails"):
        list(slow_fail.map(range(200)))
    wait_idle(cluster)
    after = settled_counters(cluster)
    # Calls that did not run: cancelled at the scheduler or at a worker (under a lease),
    # or while they waited in the client for a lease (never sent: not counted there).
    never_sent = 200 - (after["submitted"] - before["submitted"])
    assert after["cancelled"] - before["cancelled"] + never_sent > 100
    assert after["succeeded"] - before["succeeded"] < 100


def test_unschedulable_fails_fast(cluster: gpufn.Client) -> None:
    t0 = time.monotonic()
    with pytest.raises(gpufn.Unschedulable, match="too little") as e:
        square.with_options(memory="1TiB").remote(1)
    assert time.monotonic() - t0 < 2 and "Devices:" in str(e.value)
    with pytest.raises(gpufn.Unschedulable, match="no device matches type"):
        square.with_options(type="H100").remote(1)


def test_get_timeout_is_gpufn_timeout(cluster: gpufn.Client) -> None:
    call = sleepy.spawn(1.0)
    with pytest.raises(gpufn.Timeout, match="still queued or running"):
        call.get(timeout=0.05)
    assert call.get(timeout=30) == 1.0


def test_nested_remote_calls_from_a_worker(cluster: gpufn.Client) -> None:
    @gpufn.gpu
    def outer(x: int) -> int:
        return square.remote(x) + 1

    assert outer.remote(4) == 17


def test_cancel_a_running_call(cluster: gpufn.Client) -> None:
    @gpufn.gpu
    def spin() -> None:
        while True:
            time.sleep(0.01)

    call = spin.spawn()
    wait_for(lambda: call.id in running_ids(cluster), 20, "the call to run")
    assert call.cancel()
    with pytest.raises(gpufn.Cancelled):
        call.get(timeout=10)
    # the worker interrupted the function and serves again
    assert [square.remote(2) for _ in range(4)] == [4] * 4


def test_timeout_kills_and_restarts_the_worker(cluster: gpufn.Client) -> None:
    @gpufn.gpu(timeout=1)
    def stuck() -> None:
        time.sleep(60)

    before = {d["key"]: d["pid"] for d in cluster.status()["devices"]}
    t0 = time.monotonic()
    with pytest.raises(gpufn.Timeout, match="timeout of 1s"):
        stuck.remote()
    assert time.monotonic() - t0 < 10
    st = wait_ready(cluster)
    after = {d["key"]: d["pid"] for d in st["devices"]}
    assert sum(before[k] != after[k] for k in before) == 1  # exactly one worker replaced
    assert sum(d["restarts"] for d in st["devices"]) >= 1
    assert list(square.map(range(10))) == [x * x for x in range(10)]


@gpufn.gpu
def sleepy_started(marker: str, seconds: float) -> float:
    """Writes its worker's pid to `marker` once its code runs, then sleeps."""
    pathlib.Path(marker).write_text(str(os.getpid()))
    time.sleep(seconds)
    return seconds


def test_worker_killed_mid_call_gives_worker_lost_then_recovers(
        cluster: gpufn.Client, tmp_path: pathlib.Path) -> None:
    # Killed once its code runs: killed after its dispatch but before that, its worker's
    # journal says it never started, and it runs again as if first sent.
    marker = tmp_path / "started"
    call = sleepy_started.spawn(str(marker), 30)
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int(marker.read_text())
    assert any(r["id"] == call.id for d in cluster.status()["devices"] if d["pid"] == pid
               for r in d["running"])
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(gpufn.WorkerLost, match="retries=N"):
        call.get(timeout=20)
    wait_ready(cluster)
    assert square.remote(3) == 9


def test_retries_run_the_call_again_elsewhere(cluster: gpufn.Client) -> None:
    @gpufn.gpu(retries=1)
    def die_once(marker: str) -> str:
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return f"attempt {gpufn.context().attempt}"

    import tempfile

    for x in range(3):  # dispatch tokens are scheduler-wide: make them differ from 1
        assert square.remote(x) == x * x
    assert where.remote()["attempt"] == 1
    marker = os.path.join(tempfile.mkdtemp(), "died")
    call = die_once.spawn(marker)
    assert call.get(timeout=60) == "attempt 2"
    assert call.result_meta()["attempts"] == 2
    wait_ready(cluster)


def test_noop_is_cheap_enough(cluster: gpufn.Client) -> None:
    noop.remote()
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        noop.remote()
        times.append(time.perf_counter() - t0)
    # Not a benchmark (see bench/overhead.py, ~1 ms): a bound 50x looser, which a polling
    # loop or a per-call reconnect on the call path would still break.
    assert sorted(times)[len(times) // 2] < 0.05, f"median no-op round trip {sorted(times)[25]:.3f}s"
