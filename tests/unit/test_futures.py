"""CallFuture: a Future whose Condition is made only when a thread waits on it."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from concurrent.futures import Future, InvalidStateError

import pytest

from gpufn.client.futures import CallFuture

pytestmark = pytest.mark.timeout(60)


def test_a_result_set_with_nobody_waiting_needs_no_condition() -> None:
    f: CallFuture[int] = CallFuture()
    seen: list[Future[int]] = []
    f.add_done_callback(seen.append)
    assert not f.done() and f._cond is None
    f.set_result(7)
    assert f.done() and f.result() == 7 and f.result(0) == 7 and f.exception() is None
    assert seen == [f] and f._cond is None  # the callback ran once, and no Condition
    late: list[Future[int]] = []
    f.add_done_callback(late.append)  # after the end: at once, still no Condition
    assert late == [f] and f._cond is None and not f.cancelled() and not f.running()


def test_a_callback_added_once_a_thread_waited_runs_at_the_end_not_before() -> None:
    f: CallFuture[int] = CallFuture()
    with pytest.raises(cf.TimeoutError):
        f.result(0.01)  # a waiter made the Condition
    seen: list[bool] = []
    f.add_done_callback(lambda x: seen.append(x.done()))
    assert seen == []
    f.set_result(1)
    assert seen == [True]


def test_an_exception_is_raised_by_result_and_returned_by_exception() -> None:
    f: CallFuture[int] = CallFuture()
    f.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        f.result()
    assert isinstance(f.exception(), KeyError) and f.done()


@pytest.mark.parametrize("waited", [False, True])
def test_a_future_is_set_once(waited: bool) -> None:
    f: CallFuture[int] = CallFuture()
    if waited:
        with pytest.raises(cf.TimeoutError):
            f.result(0.01)  # makes the Condition: the base class's path from now on
        assert f._cond is not None
    f.set_result(1)
    with pytest.raises(InvalidStateError):
        f.set_result(2)
    with pytest.raises(InvalidStateError):
        f.set_exception(ValueError())
    assert f.result() == 1


def test_a_thread_waiting_in_result_is_woken_by_the_result() -> None:
    f: CallFuture[str] = CallFuture()
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(f.result(10)))
    t.start()
    deadline = time.monotonic() + 5
    while f._cond is None and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.02)  # (it waits in the Condition now)
    f.set_result("done")
    t.join(5)
    assert got == ["done"]


def test_racing_waiters_setters_and_callbacks_lose_nothing() -> None:
    """A waiter that makes the Condition while the result is being set, in every order:
    each waiter returns the value, each callback runs exactly once."""
    for i in range(2000):
        f: CallFuture[int] = CallFuture()
        calls: list[int] = []
        got: list[int] = []
        barrier = threading.Barrier(3)

        def wait(fut: CallFuture[int] = f, out: list[int] = got,
                 b: threading.Barrier = barrier) -> None:
            b.wait()
            out.append(fut.result(5))

        def add(fut: CallFuture[int] = f, out: list[int] = calls,
                b: threading.Barrier = barrier) -> None:
            b.wait()
            fut.add_done_callback(lambda x: out.append(x.result()))

        ts = [threading.Thread(target=wait), threading.Thread(target=add)]
        for t in ts:
            t.start()
        barrier.wait()
        if i % 2:
            time.sleep(0)
        f.set_result(i)
        for t in ts:
            t.join(5)
        assert got == [i] and calls == [i], i


def test_wait_as_completed_cancel_and_asyncio_work_as_with_a_future() -> None:
    fs: list[CallFuture[int]] = [CallFuture() for _ in range(3)]
    threading.Timer(0.05, fs[1].set_result, (1,)).start()
    done, _ = cf.wait(fs, timeout=5, return_when=cf.FIRST_COMPLETED)
    assert done == {fs[1]}
    fs[0].set_result(0)
    assert fs[2].cancel() and fs[2].cancelled() and fs[2].done()
    assert sorted(f.result() for f in cf.as_completed(fs[:2], timeout=5)) == [0, 1]

    async def main() -> int:
        f: CallFuture[int] = CallFuture()
        asyncio.get_running_loop().call_later(0.02, lambda: threading.Thread(
            target=f.set_result, args=(42,)).start())
        return await asyncio.wrap_future(f)

    assert asyncio.run(main()) == 42


def test_a_failing_callback_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    f: CallFuture[int] = CallFuture()
    ran: list[int] = []
    f.add_done_callback(lambda _: 1 / 0)
    f.add_done_callback(lambda x: ran.append(x.result()))
    f.set_result(3)
    assert ran == [3] and "exception calling callback" in caplog.text
    caplog.clear()
    g: CallFuture[int] = CallFuture()
    g.set_result(4)
    g.add_done_callback(lambda _: 1 / 0)  # added after the end: run at once, logged too
    assert "exception calling callback" in caplog.text


def test_get_refuses_a_timeout_that_is_not_seconds() -> None:
    """`.get(timeout=-1)` said "no result after -1s"; now a bad timeout names the fix, and
    0 only looks."""
    from gpufn.api.calls import FunctionCall
    from gpufn.exceptions import InvalidSpec, Timeout

    call: FunctionCall[int] = FunctionCall("inv-1", Future(), "f", None)  # type: ignore[arg-type]
    for bad in (-1, "3", True, float("nan")):
        with pytest.raises(InvalidSpec, match=r"give seconds >= 0"):
            call.get(timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidSpec, match=r"give seconds >= 0"):
            asyncio.run(call.get.aio(timeout=bad))  # type: ignore[arg-type]
    with pytest.raises(Timeout, match="has no result after 0s"):
        call.get(timeout=0)
