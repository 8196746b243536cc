"""The worker's executor in one process: real functions run inline or on its threads,
their arguments unpickled and values pickled, errors, cancels, batches, relays, the host
memory a call declares and the processes it leaves behind (`worker/executor.py`)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpufn.exceptions import (
    Cancelled,
    GpufnError,
    ModelLoadError,
    SerializationError,
    kind_of,
)
from gpufn.runtime import context as ctxmod
from gpufn.wire import jsonwire
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.worker import executor as exmod
from gpufn.worker.core import Unused
from gpufn.worker.executor import Call, Executor, retryable
from gpufn.worker.host.memory_watch import Reports
from gpufn.worker.output import OutputRouter

pytestmark = pytest.mark.timeout(30)


class Done:
    """The executor's on_done: every Result it gets, and a wait for the next."""

    def __init__(self) -> None:
        self.results: list[p.Result] = []
        self._cv = threading.Condition()

    def __call__(self, msg: p.Message) -> None:
        assert isinstance(msg, p.Result)
        with self._cv:
            self.results.append(msg)
            self._cv.notify_all()

    def wait(self, n: int = 1, timeout: float = 10.0) -> list[p.Result]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.results) >= n, timeout), self.results
            return list(self.results)


@pytest.fixture
def done() -> Done:
    return Done()


@pytest.fixture
def ex(done: Done) -> Iterator[Executor]:
    e = Executor(OutputRouter(), done)
    yield e
    e.pool.shutdown(wait=False, cancel_futures=True)


def args(*a: Any, **k: Any) -> tuple[Any, ...]:
    return tuple(ser.dumps((a, k)))


def call(fn: Callable[..., Any], frames: tuple[Any, ...] | None = None, inv: str = "i1",
         rank: int = 0, world: int = 1, **kw: Any) -> Call:
    context = ctxmod.CallContext(inv, fn.__name__, rank=rank, world_size=world)
    return Call(inv, fn.__name__, fn, args() if frames is None else frames, context, **kw)


def run(ex: Executor, c: Call) -> p.Result:
    got: list[p.Message] = []
    ex.run_inline(c, got.append)
    assert len(got) == 1 and isinstance(got[0], p.Result)
    return got[0]


def value(r: p.Result) -> Any:
    assert r.ok, (r.error_kind, r.message)
    return ser.loads(r.frames)


def add(a: int, b: int = 0) -> int:
    return a + b


# ------------------------------------------------------------------ a plain call


def test_an_inline_call_answers_its_own_on_done_else_the_executors(
        ex: Executor, done: Done) -> None:
    r = run(ex, call(add, args(2, b=3), dispatch_token=9))
    assert value(r) == 5 and r.invocation_id == "i1"
    assert r.meta.dispatch_token == 9 and r.meta.rank is None
    assert r.meta.duration is not None and 0 < r.meta.duration < 5
    assert done.results == []
    ex.run_inline(call(add, args(1)))
    assert [value(x) for x in done.results] == [1]
    assert ex.running() == []


def test_a_call_sees_its_context_and_output_only_while_it_runs(ex: Executor) -> None:
    seen: list[Any] = []

    def look() -> str:
        seen.append(ctxmod.context())
        seen.append(ex.running())
        ex.router.write("stdout", "said\n", open(os.devnull, "w"))  # noqa: SIM115
        return "ok"

    c = call(look, inv="i7")
    assert value(run(ex, c)) == "ok"
    assert seen == [c.context, ["i7"]]
    with pytest.raises(GpufnError):
        ctxmod.context()
    assert ex.router.drain("i7") == [p.Output("i7", "stdout", "said\n")]


def test_a_threaded_call_runs_on_the_pool_and_answers_the_executor(
        ex: Executor, done: Done) -> None:
    ex.submit(call(lambda: threading.current_thread().name, inv="t"))
    (r,) = done.wait()
    assert value(r).startswith("gpufn-call")


def test_a_rank_of_a_gang_says_its_rank_and_only_the_hooks_fields_are_copied(
        ex: Executor) -> None:
    def hooks(c: Call) -> None:
        c.meta.update(group_inits=2, group_init_s=0.5, comm_error=True, items=3,
                      first_item_s=0.1, items_per_s=30.0, other="not copied")

    c = call(add, args(1), rank=2, world=4)
    c.prepare = lambda: hooks(c)
    r = run(ex, c)
    assert value(r) == 1 and r.meta.rank == 2
    m = r.meta
    assert (m.group_inits, m.group_init_s, m.comm_error, m.items, m.first_item_s,
            m.items_per_s) == (2, 0.5, True, 3, 0.1, 30.0)
    assert not hasattr(m, "other")
    r0 = run(ex, call(add, args(1), rank=0, world=2))
    assert r0.meta.rank == 0


def test_prepare_runs_in_the_calls_thread_first_and_finish_maps_the_value(
        ex: Executor) -> None:
    order: list[str] = []
    me = threading.get_ident()

    def fn() -> int:
        order.append("fn")
        return 10

    c = call(fn)
    c.prepare = lambda: order.append(f"prepare {threading.get_ident() == me}")
    c.finish = lambda v: v * 2
    assert value(run(ex, c)) == 20 and order == ["prepare True", "fn"]


def test_a_value_left_unused_answers_ok_with_no_frames(ex: Executor) -> None:
    r = run(ex, call(lambda: Unused.VALUE))
    assert r.ok and r.frames == () and r.meta.duration is not None


# ------------------------------------------------------------------ what fails


def test_arguments_that_cannot_be_unpickled_fail_as_a_serialization_error(
        ex: Executor) -> None:
    r = run(ex, call(add, (b"not a pickle",)))
    assert not r.ok and r.error_kind == kind_of(SerializationError)
    assert "the arguments of add could not be unpickled on the worker" in r.message
    assert "Is a module the arguments need missing on the worker?" in r.message
    r = run(ex, call(add, ()))
    assert r.error_kind == kind_of(SerializationError) and "empty payload" in r.message


def test_a_value_that_cannot_be_pickled_fails_with_what_to_return(ex: Executor) -> None:
    r = run(ex, call(lambda: threading.Lock()))
    assert not r.ok and r.error_kind == kind_of(SerializationError)
    assert "cannot be pickled" in r.message and "Return tensors, arrays" in r.message


def test_a_value_over_the_payload_limit_fails_as_such(
        ex: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_MAX_PAYLOAD", "1KiB")
    r = run(ex, call(lambda: b"x" * 2048))
    assert not r.ok and r.error_kind == "PayloadTooLarge" and "the value returned by" in r.message
    assert value(run(ex, call(lambda: b"x" * 100))) == b"x" * 100


def test_a_user_exception_comes_back_pickled_with_its_type_and_traceback(
        ex: Executor) -> None:
    def boom() -> None:
        raise KeyError("missing")

    r = run(ex, call(boom))
    assert not r.ok and r.error_kind == "" and r.message == "'missing'"
    assert r.meta.error_type == "KeyError" and "boom" in r.meta.traceback
    assert r.meta.retryable is False and r.meta.rank is None
    e = ser.load_exception(r.frames, "KeyError", r.message, r.meta.traceback, "here")
    assert isinstance(e, KeyError)


def test_on_error_sees_the_exception_and_its_own_failure_is_swallowed(ex: Executor) -> None:
    seen: list[BaseException] = []

    def fail() -> None:
        raise ValueError("first")

    c = call(fail)
    c.on_error = seen.append
    assert run(ex, c).meta.error_type == "ValueError"
    assert [str(e) for e in seen] == ["first"]

    def broken(e: BaseException) -> None:
        raise RuntimeError("the hook broke")

    c = call(fail)
    c.on_error = broken
    r = run(ex, c)
    assert r.meta.error_type == "ValueError" and r.message == "first"


def test_a_gang_ranks_error_names_its_rank_once(ex: Executor) -> None:
    def fail(*a: Any) -> Callable[[], None]:
        def f() -> None:
            raise ValueError(*a)
        return f

    r = run(ex, call(fail("bad input"), rank=1, world=4))
    assert r.message == "[rank 1 of 4] bad input" and r.meta.rank == 1
    assert not r.meta.comm_error
    e = ser.load_exception(r.frames, "ValueError", r.message, r.meta.traceback, "here")
    assert "raised on rank 1 of 4" in getattr(e, "__notes__", [])
    assert run(ex, call(fail(), rank=3, world=4)).message == "[rank 3 of 4]"
    assert run(ex, call(fail("[rank 0 of 4] x"), rank=1, world=4)).message == "[rank 0 of 4] x"
    assert run(ex, call(fail(7), rank=1, world=4)).message == "7"  # not text: left as is
    assert run(ex, call(fail("alone"))).message == "alone"  # one device: no rank


def test_a_peers_failure_is_marked_a_comm_error_only_in_a_gang(ex: Executor) -> None:
    def lost() -> None:
        raise Cancelled("the gang was aborted")

    assert run(ex, call(lost, rank=1, world=2)).meta.comm_error is True
    assert not run(ex, call(lost)).meta.comm_error


@pytest.mark.parametrize("error", [ModelLoadError("no weights"), GpufnError("gpufn's own")])
def test_gpufns_own_errors_keep_their_kind(ex: Executor, error: GpufnError) -> None:
    def fail() -> None:
        raise error

    r = run(ex, call(fail, retry_on=["builtins.Exception"]))
    if isinstance(error, ModelLoadError):
        assert r.error_kind == kind_of(ModelLoadError) and r.frames == ()
    else:  # a GpufnError the user raised: pickled, but never retryable
        assert r.error_kind == "" and r.meta.retryable is False
    assert str(error) in r.message


def test_running_out_of_host_memory_fails_as_out_of_memory(ex: Executor) -> None:
    def hungry() -> None:
        raise MemoryError("no more")

    import torch

    c = call(hungry)
    c.context.device = torch.device("cpu")  # as a worker gives it
    r = run(ex, c)
    assert not r.ok and r.error_kind == "OutOfMemory" and r.frames == ()
    assert "hungry call i1" in r.message


class Flaky(Exception):
    pass


class FlakierStill(Flaky):
    pass


def test_retryable_matches_the_named_classes_along_the_mro() -> None:
    name = f"{Flaky.__module__}.{Flaky.__qualname__}"
    assert retryable(Flaky(), [name]) and retryable(FlakierStill(), [name])
    assert retryable(ValueError(), ["builtins.Exception"])
    assert not retryable(ValueError(), [name])
    assert not retryable(Flaky(), None) and not retryable(Flaky(), [])
    assert not retryable(Cancelled("x"), ["builtins.Exception"])


def test_a_retryable_failure_is_marked_so(ex: Executor) -> None:
    def fail() -> None:
        raise FlakierStill("again")

    r = run(ex, call(fail, retry_on=[f"{Flaky.__module__}.{Flaky.__qualname__}"]))
    assert r.meta.retryable is True
    assert run(ex, call(fail, retry_on=["builtins.KeyError"])).meta.retryable is False


# ------------------------------------------------------------------ cancels


def test_a_cancel_before_the_start_refuses_that_dispatch_only(ex: Executor) -> None:
    assert ex.interrupt("i1", dispatch_token=2) is False  # not running: remembered
    r = run(ex, call(add, args(1), dispatch_token=3))  # a later dispatch runs
    assert value(r) == 1
    r = run(ex, call(add, args(1), dispatch_token=2))
    assert not r.ok and r.error_kind == kind_of(Cancelled)
    assert r.message == "add call i1 was cancelled before it started"
    assert r.meta.dispatch_token == 2
    assert value(run(ex, call(add, args(1), dispatch_token=2))) == 1  # taken once
    ex.interrupt("i1")  # 0: any dispatch
    assert run(ex, call(add, args(1), dispatch_token=5)).error_kind == kind_of(Cancelled)


def test_take_cancelled_and_forget_cancels(ex: Executor) -> None:
    ex.interrupt("a", 1)
    ex.interrupt("b", 0)
    assert not ex.take_cancelled("a", 2) and not ex.take_cancelled("c", 1)
    assert ex.take_cancelled("a", 1) and not ex.take_cancelled("a", 1)
    ex.forget_cancels(older_than=60)
    assert "b" in ex._cancelled
    time.sleep(0.02)
    ex.forget_cancels(older_than=0.01)
    assert ex._cancelled == {}


def test_a_running_call_is_interrupted_in_its_thread(ex: Executor, done: Done) -> None:
    started = threading.Event()

    def spin() -> None:
        started.set()
        while True:
            time.sleep(0.001)

    ex.submit(call(spin, inv="s", dispatch_token=4))
    assert started.wait(10)
    assert ex.running() == ["s"]
    assert ex.interrupt("s", dispatch_token=3) is False  # another dispatch's cancel
    assert ex.interrupt("s", dispatch_token=4) is True
    (r,) = done.wait()  # raised in the user's code: the scheduler knows it cancelled it
    assert not r.ok and r.meta.error_type == "Cancelled" and r.meta.dispatch_token == 4
    assert ex.running() == []
    assert ex.take_cancelled("s", 3)  # the other dispatch's was remembered for it


def test_a_timeout_interrupt_raises_timeout_and_is_never_remembered(ex: Executor,
                                                                      done: Done) -> None:
    """A leased call past its timeout is interrupted with Timeout (worker/lease_clock.py);
    one not running is not remembered (unlike a cancel), so it cannot refuse a later run."""
    from gpufn.exceptions import Timeout

    assert ex.interrupt("t", dispatch_token=4, exc=Timeout) is False
    assert not ex.take_cancelled("t", 4)
    started = threading.Event()

    def spin() -> None:
        started.set()
        while True:
            time.sleep(0.001)

    ex.submit(call(spin, inv="t", dispatch_token=4))
    assert started.wait(10)
    assert ex.interrupt("t", dispatch_token=4, exc=Timeout) is True
    (r,) = done.wait()
    assert not r.ok and r.meta.error_type == "Timeout" and r.meta.dispatch_token == 4
    assert ex.running() == []


# ------------------------------------------------------------------ JSON callers


def test_a_json_call_gets_a_json_value_or_a_json_error(ex: Executor) -> None:
    r = run(ex, call(add, tuple(jsonwire.dump_call([2], {"b": 5}))))
    assert jsonwire.load_value(r.frames) == 7

    r = run(ex, call(lambda a: {1, 2}, tuple(jsonwire.dump_call([1], {}))))
    assert not r.ok and r.error_kind == "NotJSONSerializable"

    def fail(a: int) -> None:
        raise ValueError("json caller")

    r = run(ex, call(fail, tuple(jsonwire.dump_call([1], {}))))
    assert not r.ok and r.frames == () and r.meta.error_type == "ValueError"


# ------------------------------------------------------------------ batches


def batch(*inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[int]]:
    frames: list[Any] = []
    counts = []
    for f in inputs:
        frames.extend(f)
        counts.append(len(f))
    return tuple(frames), counts


def items(r: p.Result) -> list[Any]:
    """Each input's answer: its value, or (kind, message) when it failed."""
    assert r.ok and r.meta.batch_items is not None
    out, i = [], 0
    for it in r.meta.batch_items:
        n = it["n"]
        f = r.frames[i:i + n]
        i += n
        if it["ok"]:
            out.append(jsonwire.load_value(f) if f and jsonwire.is_json(f) else ser.loads(f))
        else:
            out.append((it["error_kind"] or it.get("type"), it["message"]))
    assert i == len(r.frames)
    return out


def test_a_batch_gets_one_list_per_argument_and_answers_each_input(ex: Executor) -> None:
    got: list[Any] = []

    def double(xs: list[int], scale: list[int]) -> list[Any]:
        got.append((xs, scale))
        return [x * s for x, s in zip(xs, scale, strict=True)]

    frames, counts = batch(args(1, scale=2), args(3, scale=10), args(5, scale=1))
    r = run(ex, call(double, frames, batch=counts))
    assert got == [([1, 3, 5], [2, 10, 1])]
    assert items(r) == [2, 30, 5]


def test_a_batch_input_that_cannot_be_read_fails_alone(ex: Executor) -> None:
    frames, counts = batch(args(1), (b"junk",), args(3))
    r = run(ex, call(lambda xs: [x + 1 for x in xs], frames, batch=counts))
    out = items(r)
    assert out[0] == 2 and out[2] == 4
    assert out[1][0] == kind_of(SerializationError)
    assert "this input of <lambda> could not be unpickled on the worker" in out[1][1]
    frames, counts = batch((b"junk",), (b"junk",))
    ran: list[int] = []

    def never(xs: list[int]) -> list[int]:
        ran.append(1)
        return []

    r = run(ex, call(never, frames, batch=counts))
    assert ran == [] and [o[0] for o in items(r)] == [kind_of(SerializationError)] * 2


def test_a_batch_whose_inputs_differ_in_shape_fails_saying_so(ex: Executor) -> None:
    frames, counts = batch(args(1), args(1, 2))
    r = run(ex, call(lambda *a: list(a), frames, batch=counts))
    assert not r.ok and "passed different arguments" in r.message


def test_a_batched_function_must_return_one_output_per_input(ex: Executor) -> None:
    frames, counts = batch(args(1), args(2))
    r = run(ex, call(lambda xs: xs[:1], frames, batch=counts))
    assert not r.ok and r.message.endswith("must return a list of 2 outputs, one per input "
                                           "in order; it returned a list of 1")
    r = run(ex, call(lambda xs: 3, frames, batch=counts))
    assert r.message.endswith("it returned a int")
    assert items(run(ex, call(lambda xs: tuple(xs), frames, batch=counts))) == [1, 2]


def test_a_batch_output_that_is_an_exception_or_cannot_be_sent_fails_its_input_only(
        ex: Executor) -> None:
    frames, counts = batch(args(1), args(2), args(3), tuple(jsonwire.dump_call([4], {})),
                           tuple(jsonwire.dump_call([5], {})), tuple(jsonwire.dump_call([6], {})))

    def mixed(xs: list[int]) -> list[Any]:
        return [ValueError("one"), threading.Lock(), 3, ValueError("four"), {5}, 6]

    r = run(ex, call(mixed, frames, batch=counts))
    out = items(r)
    assert out[0] == ("ValueError", "one")
    assert out[1][0] == kind_of(SerializationError) and "cannot be pickled" in out[1][1]
    assert out[2] == 3
    assert out[3] == ("ValueError", "four") and r.meta.batch_items is not None
    assert r.meta.batch_items[3]["n"] == 0 and r.meta.batch_items[0]["n"] > 0
    assert out[4][0] == "NotJSONSerializable"
    assert out[5] == 6 and jsonwire.is_json(r.frames[-2:])


# ------------------------------------------------------------------ relays


def test_a_relayed_call_passes_its_frames_through_untouched(ex: Executor) -> None:
    seen: list[tuple[Any, ...]] = []

    def relay(frames: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(frames)
        return tuple(ser.dumps("from elsewhere"))

    prepared: list[int] = []
    c = call(add, args(1), relay=relay)
    c.prepare = lambda: prepared.append(1)
    r = run(ex, c)
    assert value(r) == "from elsewhere" and seen == [args(1)] and prepared == [1]
    assert c.json is False
    c = call(add, tuple(jsonwire.dump_call([1], {})), relay=lambda f: f)
    run(ex, c)
    assert c.json is True


def test_a_relay_that_fails_or_returns_too_much_fails_the_call(
        ex: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(frames: tuple[Any, ...]) -> tuple[Any, ...]:
        raise RuntimeError("the helper died")

    r = run(ex, call(add, args(1), relay=broken))
    assert not r.ok and r.message == "the helper died"
    monkeypatch.setenv("GPUFN_MAX_PAYLOAD", "1KiB")
    r = run(ex, call(add, args(1), relay=lambda f: (b"x" * 4096,)))
    assert r.error_kind == "PayloadTooLarge"


# ------------------------------------------------------------------ the host


def test_a_calls_declared_host_memory_is_reported_while_it_runs(ex: Executor) -> None:
    r_fd, w_fd = os.pipe()
    try:
        ex.reports = Reports(w_fd)
        said: list[bytes] = []

        def look() -> int:
            said.append(os.read(r_fd, 100))
            return 1

        c = call(look, host_memory=5000)
        assert value(run(ex, c)) == 1
        assert said == [b"5000 0\n"] and os.read(r_fd, 100) == b"0 0\n"
        run(ex, call(lambda: 1))  # declares nothing: nothing said
        os.set_blocking(r_fd, False)
        with pytest.raises(BlockingIOError):
            os.read(r_fd, 100)
    finally:
        os.close(r_fd)
        os.close(w_fd)


def test_processes_a_call_left_running_are_stopped_after_its_result(ex: Executor) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    other = subprocess.Popen(["sleep", "30"])  # this thread's, before the call: kept
    try:
        def leave_one() -> int:
            procs.append(subprocess.Popen(["sleep", "30"]))
            return procs[0].pid

        r = run(ex, call(leave_one))
        assert value(r) == procs[0].pid
        assert procs[0].wait(timeout=15) is not None
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        for pr in procs:
            pr.kill()
            pr.wait()


def test_batched_arguments_and_failure_helpers_leave_the_call_meta_clean(ex: Executor) -> None:
    frames, counts = batch(args(1), args(2))
    c = call(lambda xs: xs, frames, batch=counts)
    run(ex, c)
    assert "batch_bad" not in c.meta and "batch_json" not in c.meta
    assert exmod._oom(MemoryError()) and not exmod._oom(ValueError())


# ------------------------------------------------------------------ what the mutants found


def test_an_argument_that_cannot_be_read_leaves_no_running_call(ex: Executor) -> None:
    run(ex, call(add, (b"not a pickle",)))
    assert ex.running() == []


def test_a_cancelled_dispatch_leaves_a_running_dispatch_of_the_same_call_alone(
        ex: Executor, done: Done) -> None:
    started, release = threading.Event(), threading.Event()

    def wait() -> str:
        started.set()
        release.wait(10)
        return "first"

    ex.submit(call(wait, inv="x", dispatch_token=1))
    assert started.wait(10)
    ex.interrupt("x", dispatch_token=2)  # meant for a later dispatch, not started
    r = run(ex, call(wait, inv="x", dispatch_token=2))
    assert r.error_kind == kind_of(Cancelled)
    assert ex.running() == ["x"]  # the first dispatch is still registered (and cancellable)
    release.set()
    assert value(done.wait()[0]) == "first"


def test_a_value_of_exactly_the_payload_limit_passes(
        ex: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"y" * 3000
    size = sum(len(f) for f in ser.dumps(payload))
    monkeypatch.setenv("GPUFN_MAX_PAYLOAD", str(size))
    assert value(run(ex, call(lambda: payload))) == payload
    monkeypatch.setenv("GPUFN_MAX_PAYLOAD", str(size - 1))
    assert run(ex, call(lambda: payload)).error_kind == "PayloadTooLarge"


def test_a_call_made_without_a_dispatch_token_says_the_first() -> None:
    c = call(add)
    assert c.dispatch_token == 1 and c.shm_owner == 0 and c.host_memory == 0


def test_every_kind_of_ending_measures_its_duration(ex: Executor) -> None:
    def fail() -> None:
        raise ValueError("x")

    frames, counts = batch(args(1))
    ends = [run(ex, call(add, args(1))), run(ex, call(fail)),
            run(ex, call(add, (b"junk",))),
            run(ex, call(add, args(1), relay=lambda f: tuple(ser.dumps(1)))),
            run(ex, call(lambda xs: xs, frames, batch=counts)),
            run(ex, call(lambda: Unused.VALUE))]
    for r in ends:
        assert r.meta.duration is not None and 0 <= r.meta.duration < 5, r


def test_a_rank_error_with_several_arguments_keeps_them_all(ex: Executor) -> None:
    def fail() -> None:
        raise ValueError("text", 5, "more")

    r = run(ex, call(fail, rank=2, world=3))
    e = ser.load_exception(r.frames, "ValueError", r.message, r.meta.traceback, "here")
    assert e.args == ("[rank 2 of 3] text", 5, "more")

    def fail_number_first() -> None:
        raise ValueError(5, "text")

    r = run(ex, call(fail_number_first, rank=2, world=3))
    e = ser.load_exception(r.frames, "ValueError", r.message, r.meta.traceback, "here")
    assert e.args == (5, "text")  # the first is not text: nothing to prefix


def test_a_note_that_cannot_be_added_does_not_hide_the_error(ex: Executor) -> None:
    def fail() -> None:
        e = ValueError("odd")
        e.__notes__ = "not a list"  # type: ignore[assignment]  # add_note raises TypeError
        raise e

    r = run(ex, call(fail, rank=1, world=2))
    assert r.message == "[rank 1 of 2] odd" and r.meta.error_type == "ValueError"


def test_without_torch_only_a_memory_error_is_out_of_memory() -> None:
    import sys

    code = ("import sys; from gpufn.worker import executor as x; "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "assert x._oom(MemoryError()) and not x._oom(ValueError()); "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


MiB = 2**20


@pytest.fixture
def shm_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A 1 MiB threshold; the names listed are unlinked after the test."""
    from gpufn.wire import shm

    monkeypatch.setenv("GPUFN_SHM_THRESHOLD", "1MiB")
    names: list[str] = []
    yield names
    for n in names:
        shm._unlink(n)


@pytest.mark.parametrize(("world", "attempt", "reused"),
                         [(1, 1, True), (2, 1, False), (1, 2, False)])
def test_only_a_first_attempt_on_one_device_answers_in_its_argument_files(
        ex: Executor, shm_files: list[str], world: int, attempt: int, reused: bool) -> None:
    """One run on one device writes its result into an argument file of its caller's
    pool that it no longer views; a gang's rank or a retry writes a new file."""
    import torch

    from gpufn.wire import shm

    caller = os.getppid()  # another live process: its pool's files are borrowed, not ours
    pool = shm.Pool(64 * MiB, idle_s=30.0)
    pool.pid = caller
    out = shm.Outgoing(caller, MiB, pool=pool)
    frames = tuple(ser.dumps(((torch.ones(MiB // 2),), {}), out))
    shm_files.extend(out.names)
    assert len(out.names) == 1
    c = call(lambda x: x * 2, frames, rank=0, world=world, shm_owner=caller)
    c.context.attempt = attempt
    r = run(ex, c)
    shm_files.extend(r.meta.shm or [])
    assert r.meta.shm is not None and len(r.meta.shm) == 1
    assert (r.meta.shm == out.names) is reused
    assert r.meta.shm_freed == (None if reused else out.names)  # the caller's pool takes it back
    assert torch.equal(value(r), torch.full((MiB // 2,), 2.0))


def test_a_result_goes_through_shared_memory_only_for_a_caller_that_takes_it(
        ex: Executor, shm_files: list[str]) -> None:
    import torch

    big = torch.ones(MiB // 2)  # 2 MiB, over the 1 MiB threshold
    r = run(ex, call(lambda: big))  # no shm_owner: a caller elsewhere
    assert r.meta.shm is None and torch.equal(value(r), big)
    assert run(ex, call(lambda: [1, 2], shm_owner=os.getpid())).meta.shm is None
    r = run(ex, call(lambda: big, shm_owner=os.getpid()))
    shm_files.extend(r.meta.shm or [])
    assert r.meta.shm is not None and torch.equal(value(r), big)


class BrokenRouter(OutputRouter):
    def started(self, inv: str) -> None:
        raise RuntimeError("the router broke")


def test_a_failure_outside_the_users_code_still_answers_the_call(done: Done) -> None:
    ex = Executor(BrokenRouter(), done)
    try:
        r = run(ex, call(add, args(1)))
        assert not r.ok and r.message == "the router broke" and r.meta.dispatch_token == 1
        assert ex.running() == []
    finally:
        ex.pool.shutdown(wait=False)


def test_an_async_call_is_interrupted_through_its_driver(ex: Executor, done: Done) -> None:
    import asyncio

    started = threading.Event()

    async def waits() -> None:
        started.set()
        await asyncio.sleep(20)

    ex.submit(call(waits, inv="a"))
    assert started.wait(10)
    deadline = time.monotonic() + 5
    while not ex.driver.is_async("a"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ex.interrupt("a") is True
    (r,) = done.wait()
    assert not r.ok and "Cancelled" in (r.error_kind, r.meta.error_type)


def test_an_executor_without_a_supervisor_tells_nothing_on_stdout(
        ex: Executor, capfd: pytest.CaptureFixture[str]) -> None:
    assert ex.reports.fd < 0
    run(ex, call(add, args(1), host_memory=4096))
    assert capfd.readouterr().out == ""


def test_a_torch_out_of_memory_error_is_out_of_memory(ex: Executor) -> None:
    import torch

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    c = call(oom)
    c.context.device = torch.device("cpu")
    r = run(ex, c)
    assert r.error_kind == "OutOfMemory"


def test_a_rank_tag_looks_at_the_first_argument_only(ex: Executor) -> None:
    def fail() -> None:
        raise ValueError("text", "[rank 9 of 9] quoted")

    r = run(ex, call(fail, rank=1, world=2))
    e = ser.load_exception(r.frames, "ValueError", r.message, r.meta.traceback, "here")
    assert e.args == ("[rank 1 of 2] text", "[rank 9 of 9] quoted")
