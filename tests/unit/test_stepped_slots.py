"""A device's slots with stepped engines: the calls of a function declared with a
concurrency above the slots (one engine's batch) hold one slot together, so another
model's calls and plain calls still start beside a full batch, and plain calls are
still bounded by the slots."""

from __future__ import annotations

import pytest

from tests.unit.core_harness import Harness

pytestmark = pytest.mark.timeout(60)


def _running(h: Harness, fid_runs: list[str]) -> int:
    started = {r.invocation_id for r in h.runs()}
    return sum(1 for i in fid_runs if i in started)


def test_a_full_batch_holds_one_slot_and_plain_calls_keep_their_bound() -> None:
    h = Harness(devices=1, slots_per_device=4)
    h.start_worker(0)
    batch = h.register("batch", concurrency=32)
    high = h.register("high", concurrency=4)
    plain = h.register("plain", concurrency=4)
    lows = [h.submit(batch) for _ in range(32)]
    assert _running(h, lows) == 32  # the whole batch, above the 4 slots
    highs = [h.submit(high, priority=10)]
    assert _running(h, highs) == 1, "another model's call waited behind a full batch"
    plains = [h.submit(plain) for _ in range(4)]
    # 4 slots: the batch holds one, the high call one, so two plain calls start.
    assert _running(h, plains) == 2
    more = [h.submit(batch) for _ in range(2)]
    assert _running(h, more) == 0  # the batch's own bound: its concurrency
