"""Scheduler pieces of streaming, from_id and Retries, driven through the core harness;
the worker's retryable judgement; the Retries spec."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gpufn.exceptions import Cancelled, InvalidSpec
from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec, Retries, make_spec, retry_delay
from gpufn.worker.executor import retryable

from .core_harness import Harness


def _raised(h: Harness, worker: bytes, inv: str, retryable: bool = True,
            error_type: str = "ConnectionError") -> None:
    meta = p.ResultMeta(dispatch_token=h.token(inv), duration=0.1, error_type=error_type,
                        retryable=retryable)
    h.feed(worker, p.Result(inv, False, "", "boom", meta, (b"exc",)))


def _one_device(**options: object) -> tuple[Harness, bytes, str]:
    h = Harness(devices=1)
    w = h.start_worker(0)
    fid = h.register("f", **options)
    return h, w, fid


def test_retry_or_fail_requeues_with_backoff_until_retries_run_out() -> None:
    h, w, fid = _one_device(retries=Retries(2, backoff=3.0, initial_delay=1.0, on=ConnectionError))
    inv = h.submit(fid)
    assert len(h.runs(w)) == 1
    _raised(h, w, inv)
    rec = h.core.invocations[inv]
    assert rec.state is InvState.QUEUED and rec.not_before == pytest.approx(h.now + 1.0)
    h.tick(0.5)
    assert len(h.runs(w)) == 1, "ran again before its backoff"
    h.tick(0.6)
    assert len(h.runs(w)) == 2 and h.runs(w)[-1].meta.attempt_number == 2
    _raised(h, w, inv)
    assert rec.not_before == pytest.approx(h.now + 3.0)  # initial_delay * backoff ** 1
    h.tick(3.1)
    assert len(h.runs(w)) == 3
    _raised(h, w, inv)  # the third failure: no retry left
    res = h.results()[inv]
    assert not res.ok and res.meta.attempts == 3 and res.meta.error_type == "ConnectionError"
    assert h.core.counters.retried == 2


def test_not_retryable_or_int_retries_fail_at_once() -> None:
    h, w, fid = _one_device(retries=Retries(3, on=ConnectionError))
    inv = h.submit(fid)
    _raised(h, w, inv, retryable=False, error_type="ValueError")
    assert not h.results()[inv].ok and len(h.runs(w)) == 1
    h2, w2, fid2 = _one_device(retries=3)  # an int retries lost workers only
    inv2 = h2.submit(fid2)
    run = h2.runs(w2)[0]
    assert run.meta.retry_on is None
    _raised(h2, w2, inv2, retryable=False)
    assert not h2.results()[inv2].ok


def test_a_streaming_call_is_never_retried_after_an_item() -> None:
    h, w, fid = _one_device(retries=Retries(3, initial_delay=0.0))
    inv = h.submit(fid)
    h.feed(w, p.Item(inv, h.token(inv), 0, frames=(b"v0",)))
    _raised(h, w, inv)
    assert not h.results()[inv].ok and len(h.runs(w)) == 1


def test_items_pass_through_in_order_and_credits_reach_the_worker() -> None:
    h, w, fid = _one_device()
    inv = h.submit(fid)
    tok = h.token(inv)
    for i in range(3):
        h.feed(w, p.Item(inv, tok, i, frames=(f"v{i}".encode(),)))
    h.feed(w, p.Item(inv, tok + 99, 3, frames=(b"stale",)))  # another dispatch's: dropped
    got = [s.msg for s in h.of_type(p.Item) if s.peer == b"cli"]
    assert [m.seq for m in got] == [0, 1, 2] and got[2].frames == (b"v2",)
    h.feed(b"cli", p.Credit(inv, 0, 20))
    credits = [s for s in h.of_type(p.Credit) if s.peer == w]
    assert len(credits) == 1 and credits[0].msg.allowed == 20 and credits[0].msg.dispatch_token == tok
    h.finish(w, inv)
    assert h.core.invocations.get(inv) is None and h.results()[inv].ok


def test_the_scheduler_counts_every_value_of_a_burst_and_relays_it_whole() -> None:
    h, w, fid = _one_device()
    inv = h.submit(fid)
    tok = h.token(inv)
    h.feed(w, p.Item(inv, tok, 0, [2, 2, 2], (b"v0v1v2",)))
    h.feed(w, p.Item(inv, tok, 3, frames=(b"v3",)))
    got = [s.msg for s in h.of_type(p.Item) if s.peer == b"cli"]
    assert [(m.seq, m.sizes, m.frames) for m in got] == [
        (0, [2, 2, 2], (b"v0v1v2",)), (3, [], (b"v3",))]
    assert h.core.invocations[inv].items == 4


def test_clients_may_not_send_items_and_strangers_may_not_credit() -> None:
    h, _w, fid = _one_device()
    inv = h.submit(fid)
    out = h.feed(b"cli", p.Item(inv, h.token(inv), 0, frames=(b"forged",)))
    assert not [s for s in h.of_type(p.Item) if s.peer == b"cli"]
    assert [s.msg for s in out if isinstance(s.msg, p.Error)]
    h.hello(b"other", p.Role.CLIENT)
    h.feed(b"other", p.Credit(inv, 0, 99))
    assert not h.of_type(p.Credit)


def test_attach_gets_a_live_call_result_and_a_kept_one() -> None:
    h, w, fid = _one_device()
    inv = h.submit(fid, keep=True)
    assert h.core.invocations[inv].spec == h.core.functions[fid].spec  # keep is no spec option
    h.hello(b"other", p.Role.CLIENT)
    h.feed(b"other", p.Attach(inv))
    h.finish(w, inv)
    assert h.results(b"other")[inv].ok and h.results()[inv].ok
    h.hello(b"late", p.Role.CLIENT)
    h.feed(b"late", p.Attach(inv))  # finished: answered from the kept results
    assert h.results(b"late")[inv].frames == (b"value",)
    plain = h.submit(fid)  # not spawned: not kept
    h.finish(w, plain)
    h.feed(b"late", p.Attach(plain))
    assert not h.results(b"late")[plain].ok
    assert "knows no call" in h.results(b"late")[plain].message


def test_retry_delay_and_retries_spec() -> None:
    spec = make_spec(retries=Retries(5, backoff_coefficient=2.0, initial_delay=1.0, max_delay=5.0,
                                     on=(ConnectionError, TimeoutError)))
    assert spec.retries == 5
    assert spec.retry_on == ("builtins.ConnectionError", "builtins.TimeoutError")
    assert [retry_delay(spec, n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert GpuSpec.from_wire(spec.to_wire()) == spec
    assert Retries(1).on == (Exception,)
    with pytest.raises(InvalidSpec):
        Retries(1, on=("ConnectionError",))  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec):
        Retries(-1)
    with pytest.raises(InvalidSpec):
        Retries(1, backoff=0.5)


class _Mine(ConnectionResetError):
    pass


def test_retryable_matches_along_the_mro_and_never_gpufn_errors() -> None:
    on = ["builtins.ConnectionError"]
    assert retryable(_Mine("x"), on)
    assert not retryable(ValueError("x"), on)
    assert retryable(ValueError("x"), ["builtins.Exception"])
    assert not retryable(Cancelled("x"), ["builtins.Exception"])
    assert not retryable(ConnectionError("x"), None)


# --------------------------------------------------------------------------- the worker's driver


def _call(rank: int = 0) -> Any:
    from gpufn.runtime.context import CallContext
    from gpufn.worker.executor import Call

    return Call("inv1", "gen", lambda: None, (), CallContext("inv1", "gen", rank=rank),
                dispatch_token=7)


def _drive_in_thread(driver: Any, call: Any, value: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(driver.drive(call, value))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_driver_sends_a_window_then_waits_for_credit_and_stops_on_cancel() -> None:
    from gpufn.worker.streaming import Driver

    sent: list[p.Message] = []
    produced: list[int] = []
    closed = threading.Event()

    def gen() -> Any:
        try:
            for i in range(1000):
                produced.append(i)
                yield i
        finally:
            closed.set()

    driver = Driver(sent.append)
    call = _call()
    t, out = _drive_in_thread(driver, call, gen())
    deadline = time.monotonic() + 10
    while len(sent) < p.STREAM_WINDOW and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(sent) == len(produced) == p.STREAM_WINDOW  # blocked before producing more
    assert [m.seq for m in sent] == list(range(p.STREAM_WINDOW))  # type: ignore[attr-defined]
    driver.grant("inv1", 7, p.STREAM_WINDOW + 4)
    while len(sent) < p.STREAM_WINDOW + 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(sent) == p.STREAM_WINDOW + 4
    driver.grant("inv1", 99, 500)  # another dispatch's credit: ignored
    time.sleep(0.2)
    assert len(sent) == p.STREAM_WINDOW + 4
    assert driver.interrupt("inv1", 7)
    t.join(10)
    assert closed.is_set() and isinstance(out[0], Cancelled)
    assert call.meta["items"] == p.STREAM_WINDOW + 4


def test_driver_other_ranks_send_nothing_and_coroutines_run_on_one_loop() -> None:
    import asyncio

    from gpufn.worker.streaming import Driver

    sent: list[p.Message] = []
    driver = Driver(sent.append)
    t, out = _drive_in_thread(driver, _call(rank=1), iter_gen(100))
    t.join(10)
    assert out == [None] and not sent  # rank 1 ran in lockstep without sending

    async def loop_id() -> int:
        await asyncio.sleep(0)
        return id(asyncio.get_running_loop())

    assert driver.drive(_call(), loop_id()) == driver.drive(_call(), loop_id())


def iter_gen(n: int) -> Any:
    yield from range(n)


def test_worker_core_turns_credits_into_grants_and_never_inlines_generators() -> None:
    from gpufn.wire import serialization as ser
    from gpufn.worker.core import Execute, Grant, WorkerCore

    core = WorkerCore("n:0")
    assert core.handle(p.Credit("i", 3, 40)) == [Grant("i", 3, 40)]
    code_id, frames = ser.dump_code(iter_gen, "iter_gen")
    core.handle(p.LoadCode(code_id, "iter_gen", tuple(frames)))
    actions = core.handle(p.Run("i", "f", code_id, "iter_gen", 1, p.RunMeta(inline=True), ()))
    assert isinstance(actions[-1], Execute) and actions[-1].inline is False


def _until_true(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_driver_interrupt_takes_its_own_dispatch_or_any_and_credit_for_any() -> None:
    """A cancel names the dispatch it stops (0 or none: whichever runs); one for another
    dispatch or an unknown call stops nothing. A Credit with dispatch 0 counts for the
    running one."""
    from gpufn.worker.streaming import Driver

    sent: list[p.Message] = []
    driver = Driver(sent.append)
    t, out = _drive_in_thread(driver, _call(), iter_gen(10_000))
    assert _until_true(lambda: len(sent) == p.STREAM_WINDOW)
    driver.grant("inv1", 0, p.STREAM_WINDOW + 3)
    assert _until_true(lambda: len(sent) == p.STREAM_WINDOW + 3)
    assert not driver.is_async("inv1") and not driver.is_async("inv2")
    assert not driver.interrupt("inv2")  # no such call
    assert not driver.interrupt("inv1", 99)  # another dispatch of it
    time.sleep(0.2)
    assert t.is_alive() and not out
    assert driver.interrupt("inv1")  # no dispatch named: the running one
    t.join(10)
    assert isinstance(out[0], Cancelled)
    assert not driver.interrupt("inv1")  # ended: nothing to stop


def test_driver_streams_an_async_generator_and_closes_it_when_cancelled() -> None:
    import asyncio

    from gpufn.wire import serialization as ser
    from gpufn.worker.streaming import Driver

    async def agen(n: int, closed: threading.Event) -> Any:
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield i
        finally:
            closed.set()

    sent: list[p.Message] = []
    driver = Driver(sent.append)
    call, closed = _call(), threading.Event()
    assert driver.drive(call, agen(5, closed)) is None
    assert [ser.loads(m.frames) for m in sent] == list(range(5))  # type: ignore[attr-defined]
    assert call.meta["items"] == 5 and call.meta["items_per_s"] > 0 and closed.is_set()
    # Cancelled while it waits for credit: aclose runs its finally before drive returns
    # (the generator is kept referenced here, so nothing else would close it).
    sent.clear()
    call, closed = _call(), threading.Event()
    gen = agen(10_000, closed)
    t, out = _drive_in_thread(driver, call, gen)
    assert _until_true(lambda: len(sent) == p.STREAM_WINDOW)
    assert driver.is_async("inv1")
    assert driver.interrupt("inv1", 7)
    t.join(10)
    assert isinstance(out[0], Cancelled) and closed.is_set()
    assert call.meta["items"] == p.STREAM_WINDOW


def test_driver_cancels_a_coroutine_while_it_awaits() -> None:
    import asyncio

    from gpufn.worker.streaming import Driver

    started, closed = threading.Event(), threading.Event()

    async def slow() -> int:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            closed.set()
        return 1

    driver = Driver(lambda m: None)
    t, out = _drive_in_thread(driver, _call(), slow())
    assert started.wait(10)
    assert driver.interrupt("inv1", 7)
    t.join(10)
    assert not t.is_alive() and isinstance(out[0], Cancelled) and closed.wait(5)


def test_a_generator_whose_cleanup_raises_still_ends_cancelled_with_its_meta() -> None:
    """The generator's own close (its finally) failing does not replace why the stream
    ended, nor lose the call's stream meta."""
    from gpufn.worker.streaming import Driver

    def gen() -> Any:
        try:
            yield from range(10_000)
        finally:
            raise ValueError("cleanup failed")

    sent: list[p.Message] = []
    driver = Driver(sent.append)
    call = _call()
    t, out = _drive_in_thread(driver, call, gen())
    assert _until_true(lambda: len(sent) == p.STREAM_WINDOW)
    assert driver.interrupt("inv1", 7)
    t.join(10)
    assert isinstance(out[0], Cancelled)
    assert call.meta["items"] == p.STREAM_WINDOW and call.meta["first_item_s"] >= 0


def test_a_stream_of_no_values_has_no_rate() -> None:
    from gpufn.worker.streaming import Driver

    call = _call()
    assert Driver(lambda m: None).drive(call, iter_gen(0)) is None
    assert call.meta == {"items": 0, "first_item_s": None, "items_per_s": None}


def _waits(flow: Any, seq: int, for_s: float = 0.3) -> tuple[bool, threading.Event]:
    """Whether `flow.wait_credit(seq)` is still waiting after `for_s` (in a thread; the
    event is set when it returns or raises)."""
    done = threading.Event()

    def run() -> None:
        try:
            flow.wait_credit(seq)
        except Cancelled:
            pass
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return not done.wait(for_s), done


def test_unread_bytes_stop_the_producer_from_exactly_stream_bytes() -> None:
    """Values unread holding STREAM_BYTES or more stop the producer (the first value
    may always go); one byte less does not; a Credit that reads them lets it on."""
    from gpufn.worker.streaming import _Flow

    flow = _Flow(7)
    flow.sent(p.STREAM_BYTES - 1)
    waits, _ = _waits(flow, 1)
    assert not waits, "one byte under STREAM_BYTES unread stopped the producer"
    flow.sent(1)  # now exactly STREAM_BYTES unread
    waits, done = _waits(flow, 2)
    assert waits, "the producer went on with STREAM_BYTES unread"
    flow.grant(p.STREAM_WINDOW + 1)  # the consumer read the first value
    assert done.wait(5)
    assert (flow.read, flow.read_bytes) == (1, p.STREAM_BYTES - 1)
    flow.cancel()


def test_credit_is_waited_for_past_the_window_and_a_cancel_wins_over_room() -> None:
    from gpufn.worker.streaming import _Flow

    flow = _Flow(7)
    waits, done = _waits(flow, p.STREAM_WINDOW + 1)  # beyond the window, not only at it
    assert waits
    flow.grant(p.STREAM_WINDOW + 2)
    assert done.wait(5)
    flow.cancel()
    with pytest.raises(Cancelled):
        flow.wait_credit(0)  # room enough, but the consumer closed the stream


def test_a_producer_waiting_for_credit_or_for_its_bytes_to_be_read_does_not_spin() -> None:
    from gpufn.worker.streaming import _Flow

    by_count, by_bytes = _Flow(7), _Flow(8)
    by_bytes.sent(p.STREAM_BYTES)
    cpu = time.process_time()
    waits = [_waits(by_count, p.STREAM_WINDOW, 1.0)[0], _waits(by_bytes, 1, 1.0)[0]]
    used = time.process_time() - cpu
    by_count.cancel()
    by_bytes.cancel()
    assert waits == [True, True]
    assert used < 0.25, f"{used:.2f} s of CPU in 2 s of waiting"


def test_what_needs_driving() -> None:
    from gpufn.worker.streaming import needs_driving

    async def coro() -> None:
        pass

    async def agen() -> Any:
        yield 1

    c = coro()
    assert needs_driving(iter_gen(1)) and needs_driving(c) and needs_driving(agen())
    c.close()
    assert not needs_driving([1, 2]) and not needs_driving(iter([1]))


def test_a_stream_s_meta_rate_is_its_values_over_its_time() -> None:
    from gpufn.worker.streaming import Driver

    call = _call()
    t0 = time.perf_counter()
    Driver(lambda m: None).drive(call, iter_gen(50))
    wall = time.perf_counter() - t0
    assert call.meta["items"] == 50 and 0 <= call.meta["first_item_s"] <= wall
    assert call.meta["items_per_s"] >= 50 / wall  # counted over the stream's own time


def test_a_yielded_value_over_the_payload_limit_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufn.exceptions import PayloadTooLarge
    from gpufn.wire import serialization as ser
    from gpufn.worker.streaming import Driver

    monkeypatch.setenv("GPUFN_MAX_PAYLOAD", "1000")

    def gen() -> Any:
        yield b"small"
        yield b"x" * 2000

    sent: list[p.Message] = []
    with pytest.raises(PayloadTooLarge, match="a value yielded by gen"):
        Driver(sent.append).drive(_call(), gen())
    assert [ser.loads(m.frames) for m in sent] == [b"small"]  # type: ignore[attr-defined]


def test_a_coroutine_sees_its_call_s_models() -> None:
    from gpufn.runtime.context import CallContext
    from gpufn.runtime.models import call_models
    from gpufn.worker.executor import Call
    from gpufn.worker.streaming import Driver

    async def names() -> dict[str, str]:
        return call_models()

    call = Call("inv1", "f", lambda: None, (), CallContext("inv1", "f"), dispatch_token=7,
                models={"llm": "key-1"})
    assert Driver(lambda m: None).drive(call, names()) == {"llm": "key-1"}


def test_what_never_runs_inline() -> None:
    import functools

    from gpufn.worker.streaming import is_special

    async def coro() -> None:
        pass

    async def agen() -> Any:
        yield 1

    def plain() -> int:
        return 1

    @functools.wraps(coro)
    def wrapped() -> Any:
        return coro()

    assert is_special(iter_gen) and is_special(coro) and is_special(agen)
    assert is_special(wrapped)  # by what it wraps
    assert not is_special(plain)
