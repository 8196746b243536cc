"""Session and prefix affinity: calls naming a key follow the device that last ran it
while that device is not much busier than the least busy one that could take them."""

from __future__ import annotations

from gpufn.scheduler.placement.affinity import SLACK, Affinity
from gpufn.wire import protocol as p
from tests.unit.core_harness import Harness


def _device_of(h: Harness, inv: str) -> str:
    run = next(s for s in h.sent if isinstance(s.msg, p.Run) and s.msg.invocation_id == inv)
    return h.core.device_of(run.peer).key  # type: ignore[union-attr]


def test_calls_with_a_key_follow_its_device() -> None:
    h = Harness(devices=4)
    for i in range(4):
        h.start_worker(i)
    f = h.register("chat", concurrency=16)
    first = h.submit(f, affinity="session-a")
    home = _device_of(h, first)
    again = [h.submit(f, affinity="session-a") for _ in range(SLACK)]
    assert {_device_of(h, i) for i in again} == {home}
    others = [h.submit(f) for _ in range(6)]  # no key: spread by load
    assert len({_device_of(h, i) for i in others}) > 1


def test_a_key_whose_device_is_too_busy_goes_elsewhere() -> None:
    h = Harness(devices=2)
    for i in range(2):
        h.start_worker(i)
    f = h.register("chat", concurrency=16)
    home = _device_of(h, h.submit(f, affinity="s"))
    placed = [_device_of(h, h.submit(f, affinity="s")) for _ in range(12)]
    # The key's device took calls until it ran SLACK (or concurrency/4) more than the other.
    assert placed[0] == home and any(d != home for d in placed)
    busy = {k: len(h.core.devices[k].running) for k in h.core.devices}
    assert max(busy.values()) - min(busy.values()) <= max(SLACK, 16 // 4) + 1


def test_the_book_is_bounded_and_ignores_empty_keys() -> None:
    book = Affinity(max_keys=3)
    book.ran("f", "", "d0")
    for i in range(5):
        book.ran("f", f"k{i}", f"d{i}")
    assert len(book._where) == 3 and ("f", "k0") not in book._where
