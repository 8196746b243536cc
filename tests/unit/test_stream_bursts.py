"""Streamed values in bursts: the worker's outbox packs the values a call yielded since
the last send into one Item (one frame), in order, waking the main loop once per fill;
the client splits them back in order; credit stays counted in values, and the producer
also keeps the bytes of unread values bounded."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import pytest

from gpufn.exceptions import GpufnError
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser


def _values(items: list[p.Item]) -> list[tuple[int, Any]]:
    """(seq, value) of every value the Items hold, as the client reads them."""
    from gpufn.client.items import split

    out = []
    for item in items:
        out += [(seq, ser.loads(frames)) for seq, frames in split(item)]
    return out


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_burst_goes_as_one_item_of_one_frame_and_a_big_value_alone_in_order() -> None:
    from gpufn.worker.streaming import PACK_MAX, ItemOutbox

    woken: list[int] = []
    box = ItemOutbox(lambda: woken.append(1))
    big = b"x" * PACK_MAX
    values: list[Any] = [*range(5), big, *range(5, 9)]
    for seq, v in enumerate(values):
        frames = ser.dumps(v)
        box.add("inv1", 7, seq, frames, ser.payload_bytes(frames))
        box.add("inv2", 3, seq, ser.dumps(-seq), len(ser.dumps(-seq)[0]))  # another call
    assert len(woken) == 1  # told once, however many values came meanwhile
    items = box.drain("inv1")
    # a burst in one frame, the big value alone as its own frames, then a new burst
    assert [len(i.frames) for i in items] == [1, len(ser.dumps(big)), 1]
    assert [i.values() for i in items] == [5, 1, 4]
    assert [i.seq for i in items] == [0, 5, 6]
    assert _values(items) == list(enumerate(values))
    assert all(i.dispatch_token == 7 for i in items)
    # The other call's values wait for the next full drain, which tells again after it.
    rest = box.drain()
    assert _values(rest) == [(s, -s) for s in range(len(values))]
    assert box.drain() == []
    box.add("inv1", 7, 10, ser.dumps(10), len(ser.dumps(10)[0]))
    assert len(woken) == 2


def test_the_first_value_after_a_drain_of_one_call_and_an_empty_drain_wakes_again() -> None:
    from gpufn.worker.streaming import ItemOutbox

    woken: list[int] = []
    box = ItemOutbox(lambda: woken.append(1))
    box.add("inv1", 1, 0, [b"a"], 1)
    assert len(box.drain("inv1")) == 1  # before its Result: nothing left
    assert box.drain() == []  # the main loop's flush finds nothing: told is reset anyway
    box.add("inv2", 1, 0, [b"b"], 1)
    assert len(woken) == 2, "a value after the flush did not wake the main loop"


def test_a_malformed_burst_is_refused_by_the_client() -> None:
    from gpufn.client.items import split

    good = p.Item("inv1", 1, 0, [2, 3], (b"ab" + b"cde",))
    assert [bytes(f[0]) for _, f in split(good)] == [b"ab", b"cde"]
    for bad in (p.Item("inv1", 1, 0, [2, 4], (b"abcde",)),  # sizes past the frame
                p.Item("inv1", 1, 0, [2, 2], (b"abcde",)),  # bytes left over
                p.Item("inv1", 1, 0, [0, 5], (b"abcde",)),
                p.Item("inv1", 1, 0, ["2", 3], (b"abcde",)),  # type: ignore[list-item]
                p.Item("inv1", 1, 0, [2, 3], (b"ab", b"cde"))):  # a burst is one frame
        with pytest.raises(GpufnError, match="malformed"):
            split(bad)


def test_the_worker_sends_bursts_that_the_client_reads_in_order() -> None:
    """Driver (its own thread, real credit) -> outbox -> Items -> ItemQueue -> CallStream."""
    from gpufn.api.calls import CallStream
    from gpufn.client.items import ItemQueue
    from gpufn.runtime.context import CallContext
    from gpufn.worker.executor import Call
    from gpufn.worker.streaming import Driver

    n = 20 * p.STREAM_WINDOW
    queue = ItemQueue()
    ready = threading.Event()
    driver = Driver(lambda m: None, ready.set)
    items: list[p.Item] = []
    credits: list[int] = []

    class Client:  # what CallStream's Credits do: reach the driver (as the scheduler would)
        def credit(self, invocation_id: str, allowed: int) -> None:
            credits.append(allowed)
            driver.grant(invocation_id, 7, allowed)

    class FCall:
        id, _name, _client = "inv1", "gen", Client()

        def _get_end(self) -> None:
            pass

    call = Call("inv1", "gen", lambda: None, (), CallContext("inv1", "gen"), dispatch_token=7)
    done = threading.Event()

    def produce() -> None:
        driver.drive(call, (i for i in range(n)))
        done.set()

    allowed_then: list[int] = []  # the producer's credit when each Item was sent

    def send() -> None:
        for item in driver.items.drain():
            items.append(item)
            allowed_then.append(max([p.STREAM_WINDOW, *credits]))
            queue.put(item)

    def main_loop() -> None:  # the worker's main thread: send whatever is there when woken
        while not (done.is_set() and not ready.is_set()):
            if ready.wait(0.05):
                ready.clear()
                send()
        send()
        queue.end()

    threads = [threading.Thread(target=produce, daemon=True),
               threading.Thread(target=main_loop, daemon=True)]
    for t in threads:
        t.start()
    stream: CallStream[int] = CallStream(FCall(), queue)  # type: ignore[arg-type]
    got = list(stream)
    for t in threads:
        t.join(10)
    assert got == list(range(n))
    assert sum(i.values() for i in items) == n and len(items) < n  # some came as bursts
    assert [i.seq for i in items] == sorted(i.seq for i in items)
    assert credits == sorted(credits) and credits[-1] <= n + p.STREAM_WINDOW
    # The producer never ran ahead of the consumer's credit (counted in values): each
    # Item's last value was allowed by a Credit sent before it (the first window by none).
    assert all(i.seq + i.values() <= a for i, a in zip(items, allowed_then, strict=True))
    assert len(credits) <= 2 * n // (p.STREAM_WINDOW // 4)  # not a Credit every few values


def test_a_consumer_credits_in_values_once_per_burst_and_while_values_wait() -> None:
    from gpufn.api.calls import CREDIT_MOST, CallStream
    from gpufn.client.items import ItemQueue

    credits: list[int] = []

    class Client:
        def credit(self, invocation_id: str, allowed: int) -> None:
            credits.append(allowed)

    class Call:
        id, _name, _client = "inv1", "gen", Client()

    w = p.STREAM_WINDOW
    items = ItemQueue()
    vals = [pickle.dumps(i, protocol=5) for i in range(w)]
    items.put(p.Item("inv1", 1, 0, [len(v) for v in vals], (b"".join(vals),)))
    stream: CallStream[int] = CallStream(Call(), items)  # type: ignore[arg-type]
    got = [next(stream) for _ in range(CREDIT_MOST)]
    assert got == list(range(CREDIT_MOST))
    # Values still wait here, but half a window was read: the producer hears of it.
    assert credits == [CREDIT_MOST + w]
    got += [next(stream) for _ in range(w - CREDIT_MOST)]
    assert got == list(range(w)) and credits == [CREDIT_MOST + w, 2 * w]


def test_a_producer_of_big_values_keeps_few_unread() -> None:
    from gpufn.runtime.context import CallContext
    from gpufn.worker.executor import Call
    from gpufn.worker.streaming import Driver

    sent: list[p.Message] = []
    driver = Driver(sent.append)
    size = p.STREAM_BYTES // 4 + 1
    blob = b"x" * size

    def gen() -> Any:
        for _ in range(10 * p.STREAM_WINDOW):
            yield blob

    call = Call("inv1", "gen", lambda: None, (), CallContext("inv1", "gen"), dispatch_token=7)
    t = threading.Thread(target=lambda: _drive(driver, call, gen()), daemon=True)
    t.start()
    _until(lambda: len(sent) >= 4)
    time.sleep(0.3)
    assert len(sent) == 4, "the unread bytes were not bounded"  # the 4th crosses the bound
    driver.grant("inv1", 7, p.STREAM_WINDOW + 2)  # the consumer read two of them
    _until(lambda: len(sent) >= 6)
    time.sleep(0.3)
    assert len(sent) == 6
    assert driver.interrupt("inv1", 7)
    t.join(10)


def _drive(driver: Any, call: Any, gen: Any) -> None:
    try:
        driver.drive(call, gen)
    except BaseException:
        pass


def test_a_fast_producer_s_small_values_never_pile_into_one_unbounded_item() -> None:
    """Values yielded faster than the main loop drains go as bursts of at most ITEM_BYTES
    each, so the first values reach the consumer without waiting for the rest."""
    from gpufn.worker.streaming import ITEM_BYTES, PACK_MAX, ItemOutbox

    box = ItemOutbox(lambda: None)
    value = b"v" * (PACK_MAX // 2)
    frames = ser.dumps(value)
    size = ser.payload_bytes(frames)
    n = 3 * ITEM_BYTES // size + 1
    for seq in range(n):
        box.add("inv", 1, seq, frames, size)
    items = box.drain()
    assert len(items) >= 3
    assert all(sum(i.sizes) <= ITEM_BYTES for i in items)
    assert sum(i.values() for i in items) == n and items[0].seq == 0


def test_a_value_under_64_kib_joins_the_burst_and_one_of_64_kib_goes_alone() -> None:
    """The bound the docs give (docs/performance.md, Streams): a one-frame value of
    64 KiB or more goes alone."""
    from gpufn.worker.streaming import ItemOutbox

    box = ItemOutbox(lambda: None)
    for seq, size in enumerate((65535, 1, 65536, 1)):
        box.add("inv", 1, seq, [b"v" * size], size)
    items = box.drain()
    assert [(i.seq, i.sizes) for i in items] == [(0, [65535, 1]), (2, []), (3, [])]
    assert [len(i.frames[0]) for i in items] == [65536, 65536, 1]


def test_a_call_s_values_after_its_own_drain_come_in_the_next() -> None:
    """Draining one call (before its Result) closes its open burst: a value of it added
    later starts a new one, which the next drain takes, not one already sent."""
    from gpufn.worker.streaming import ItemOutbox

    box = ItemOutbox(lambda: None)
    box.add("inv1", 7, 0, ser.dumps(0), len(ser.dumps(0)[0]))
    assert _values(box.drain("inv1")) == [(0, 0)]
    box.add("inv1", 7, 1, ser.dumps(1), len(ser.dumps(1)[0]))
    assert _values(box.drain()) == [(1, 1)]


def test_a_burst_grows_to_one_mib_exactly_and_no_further() -> None:
    from gpufn.worker.streaming import ItemOutbox

    box = ItemOutbox(lambda: None)
    sizes = [32768] * 32 + [1, 1]  # 32 fill 1 MiB exactly
    for seq, size in enumerate(sizes):
        box.add("inv", 1, seq, [b"v" * size], size)
    items = box.drain()
    assert [(i.seq, i.sizes) for i in items] == [(0, [32768] * 32), (32, [1, 1])]
