"""A client the scheduler forgot for its silence (a partition longer than
GPUFN_CLIENT_TIMEOUT) that comes back and sends its calls again: a call that was stopped
while it ran counts as an attempt (retried, else ConnectionLost saying why), never a
second first run; a dropped queued call runs; the forgotten client is sent nothing."""

from __future__ import annotations

import pytest

from gpufn.wire import protocol as p

from .core_harness import Harness

pytestmark = pytest.mark.timeout(30)


def _attempts(h: Harness, inv: str) -> list[int]:
    return [r.meta.attempt_number for r in h.runs() if r.invocation_id == inv]


@pytest.mark.parametrize("lost", ["silent", "unreachable"])
def test_a_stopped_call_is_an_attempt_when_its_client_comes_back(lost: str) -> None:
    h = Harness(devices=2, client_timeout=20.0, heartbeat_timeout=1000.0)
    w0, w1 = h.start_worker(0), h.start_worker(1)
    # 6 GiB each on 8 GiB devices: one call per device
    once = h.register("once", memory="6GiB")
    twice = h.register("twice", memory="6GiB", retries=1)
    a, b = h.submit(once), h.submit(twice)  # running, one on each device
    c = h.submit(once)  # queued behind them
    assert _attempts(h, a) == [1] and _attempts(h, b) == [1] and _attempts(h, c) == []
    if lost == "silent":
        h.tick(25.0)  # nothing heard from the client: forgotten
    else:
        h.unreachable(b"cli")  # its connection is gone (a send to it failed)
    assert not h.results()  # it is gone: nothing is sent to it
    for w, inv in ((w0, a), (w1, b)):  # the workers stop the two and say so
        h.feed(w, p.Result(inv, False, "Cancelled", "stopped",
                           p.ResultMeta(dispatch_token=h.token(inv))))
    # The link is back: it says Hello again to the scheduler it knew, and resubmits.
    h.hello(b"cli", p.Role.CLIENT, info={"resubmit": 3, "instance": h.core.instance})
    for inv, fid in ((a, once), (b, twice), (c, once)):
        h.feed(b"cli", p.Submit(inv, fid, {}, frames=(b"args",)))
    h.tick(1.0)
    res = h.results()
    assert res[a].error_kind == "ConnectionLost" and "GPUFN_CLIENT_TIMEOUT" in res[a].message
    assert _attempts(h, a) == [1]  # never run again
    assert _attempts(h, b) == [1, 2]  # its retry, as attempt 2
    assert _attempts(h, c) == [1]  # dropped while queued: it runs now, once
    assert b not in res and c not in res
