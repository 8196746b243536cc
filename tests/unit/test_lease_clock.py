"""The worker's clock for leased calls' timeouts (worker/lease_clock.py): pure, no
processes."""

from __future__ import annotations

import threading

import pytest

from gpufn.exceptions import Timeout
from gpufn.wire import protocol as p
from gpufn.worker.lease_clock import RECHECK_SECONDS, LeaseClock, timed_out, within_timeout

pytestmark = pytest.mark.timeout(30)


def test_only_calls_with_a_timeout_are_timed() -> None:
    clock = LeaseClock(grace=2.0)
    clock.started("a", "lease:1", "f", None, 10.0, 1)
    assert clock.next_at() is None and clock.due(1e9) == ([], [])
    assert clock.ended("a") is None


def test_a_call_is_due_at_its_timeout_and_not_after_it_ended() -> None:
    clock = LeaseClock(grace=2.0)
    clock.started("b", "lease:1", "f", 5.0, 10.0, 7)  # (the one not due comes first)
    clock.started("a", "lease:1", "f", 1.5, 10.0, dispatch_token=7)
    assert clock.next_at() == 11.5
    assert clock.due(11.49) == ([], [])
    stop, stuck = clock.due(11.5)
    assert [(c.invocation_id, c.lease_id, c.dispatch_token) for c in stop] == [("a", "lease:1", 7)]
    assert stuck == []
    ended = clock.ended("a")
    assert ended is not None and ended.interrupted is None
    assert clock.next_at() == 15.0 and clock.due(12.0) == ([], [])


def test_an_interrupt_that_landed_waits_a_grace_then_the_call_is_reported_each_grace() -> None:
    clock = LeaseClock(grace=2.0)
    clock.started("a", "lease:1", "f", 1.0, 10.0, 1)
    (c,), _ = clock.due(11.0)
    clock.interrupted(c, landed=True, now=11.0)
    assert clock.due(11.5) == ([], []) and clock.next_at() == 13.0
    stop, stuck = clock.due(13.0)
    assert stop == [] and [s.invocation_id for s in stuck] == ["a"]
    assert clock.due(14.9) == ([], [])  # reported: said again a grace later
    assert clock.next_at() == 15.0 and [s.invocation_id for s in clock.due(15.0)[1]] == ["a"]
    ended = clock.ended("a")
    assert ended is not None and ended.interrupted == 11.0
    assert clock.next_at() is None


def test_an_interrupt_that_found_the_call_not_running_yet_is_tried_again_soon() -> None:
    clock = LeaseClock(grace=2.0)
    clock.started("a", "lease:1", "f", 1.0, 10.0, 1)
    (c,), _ = clock.due(11.0)
    clock.interrupted(c, landed=False, now=11.0)
    assert clock.next_at() == pytest.approx(11.0 + RECHECK_SECONDS)
    assert clock.due(11.0 + RECHECK_SECONDS / 2) == ([], [])
    assert [x.invocation_id for x in clock.due(11.0 + RECHECK_SECONDS)[0]] == ["a"]


def test_the_error_says_what_ran_long_and_how() -> None:
    clock = LeaseClock(grace=2.0)
    clock.started("a", "lease:1", "embed", 1.5, 10.0, 1)
    c = clock.ended("a")
    assert c is not None
    late = timed_out(c, "vm:0", ran=2.25)  # ended by itself, past its timeout
    assert isinstance(late, Timeout)
    assert str(late) == ("embed call a ran 2.2s, longer than its timeout of 1.5s. "
                         "Raise timeout= if it needs longer.")
    c.interrupted = 11.5
    assert str(timed_out(c, "vm:0", ran=1.6)) == (
        "embed call a ran longer than its timeout of 1.5s on vm:0; it was interrupted. "
        "Raise timeout= if it needs longer.")
    assert str(clock.stuck(c, "vm:0")) == (
        "embed call a ran longer than its timeout of 1.5s on vm:0 and did not stop within "
        "2s of being interrupted; its worker was restarted. Raise timeout= if it needs longer.")


def _timed(interrupted: float | None = None) -> object:
    clock = LeaseClock(grace=2.0)
    clock.started("a", "lease:1", "f", 1.5, 10.0, 1)
    c = clock.ended("a")
    assert c is not None
    c.interrupted = interrupted
    return c


def test_a_call_within_its_timeout_answers_as_it_ended() -> None:
    for ok, ran in ((True, 1.5), (False, 0.2), (True, None)):
        r = p.Result("a", ok, "" if ok else "ValueError", "", p.ResultMeta(duration=ran,
                                                                          retryable=not ok))
        assert within_timeout(r, _timed(), "vm:0") is r  # type: ignore[arg-type]
        assert r.meta.retryable is (not ok)


def test_a_call_past_its_timeout_fails_with_timeout_never_retried() -> None:
    """Interrupted (whatever it then raised, even an exception its Retries(on=...)
    matches), or ended by itself past its timeout (even with a value)."""
    cases = [(p.Result("a", False, "", "raised", p.ResultMeta(duration=1.6, retryable=True),
                       (b"exc",)), 11.5, "it was interrupted"),
             (p.Result("a", True, "", "", p.ResultMeta(duration=1.51), (b"value",)), None,
              "ran 1.5s, longer than its timeout of 1.5s"),
             (p.Result("a", True, "", "", p.ResultMeta(duration=0.1)), 11.5, "interrupted")]
    for r, interrupted, said in cases:
        got = within_timeout(r, _timed(interrupted), "vm:0")  # type: ignore[arg-type]
        assert (got.invocation_id, got.ok, got.error_kind, got.frames) == ("a", False,
                                                                          "Timeout", ())
        assert said in got.message and got.meta.retryable is False
        assert got.meta is r.meta  # what the run measured goes with it


def test_threads_may_start_end_and_look_at_once() -> None:
    clock = LeaseClock(grace=1.0)
    stop = threading.Event()

    def look() -> None:
        while not stop.is_set():
            clock.due(1e9)
            clock.next_at()

    t = threading.Thread(target=look)
    t.start()
    try:
        for i in range(5000):
            clock.started(str(i), "lease:1", "f", 1.0, 0.0, 1)
            clock.ended(str(i))
    finally:
        stop.set()
        t.join(10)
    assert clock.next_at() is None
