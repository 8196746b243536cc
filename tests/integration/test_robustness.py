"""Regression tests for failure modes found in review: reused thread ids, malformed
input, a client the scheduler forgot, cancels racing dispatch, async cancellation."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
import zmq

import gpufn
from gpufn.scheduler.core import SchedulerConfig
from gpufn.scheduler.server import SchedulerServer
from gpufn.wire import protocol as p

from ._waits import running_ids, settled_counters, wait_for, wait_idle
from .funcs import sleepy, square

pytestmark = pytest.mark.timeout(120)


def test_blocking_remote_from_successive_pool_threads(cluster: gpufn.Client) -> None:
    for _ in range(3):  # each pool has a new thread, which may reuse an old thread id
        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            assert ex.submit(square.remote, 6).result(timeout=20) == 36
            assert time.monotonic() - t0 < 5


def test_malformed_messages_do_not_stop_the_scheduler() -> None:
    server = SchedulerServer("127.0.0.1", 0, SchedulerConfig())
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(server.address)
    try:
        s.send_multipart([p.BATCH_TAG, msgpack.packb({"not": "a list"}), b"x"])
        s.send_multipart(p.encode(p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, 5, 1)))  # type: ignore[arg-type]
        s.send_multipart(p.encode(p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, "", 1)))
        s.send_multipart(p.encode(p.Register("f", "c", "f", {"count": "2"}, [], (b"x",))))
        s.send_multipart(p.encode(p.Submit("i", "f", {}, frames=(b"a",))))
        s.send_multipart(p.encode(p.StatusRequest(1)))
        replies: list[p.Message] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(isinstance(m, p.StatusReply) for m in replies):
            if s.poll(200):
                replies += p.decode_all(s.recv_multipart())
        assert t.is_alive()
        assert any(isinstance(m, p.StatusReply) for m in replies)
        errors = [m for m in replies if isinstance(m, (p.Error, p.Welcome)) and not getattr(m, "ok", False)]
        assert any("count='2' must be an integer" in m.message for m in errors)  # type: ignore[union-attr]
    finally:
        server.stop()
        t.join(5)
        s.close(0)
        ctx.term()
        server.close()


def test_a_forgotten_client_reconnects_and_sends_its_calls_again(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    client = fresh_cluster(GPUFN_CPU_DEVICES=1, GPUFN_CLIENT_TIMEOUT=1)
    observer = gpufn.Client(client.address, client.token)  # pings: never forgotten
    try:
        def forgotten() -> bool:
            return observer.status(10)["clients"] == 1  # only the observer is known
        assert square.remote(3) == 9
        pings = client.ping_seconds
        client.ping_seconds = 3600.0  # from its next ping on, the client goes silent
        wait_for(forgotten, 20, "the scheduler to forget the silent client")
        calls = [sleepy.spawn(0.05) for _ in range(5)]  # refused: it says Hello again
        client.ping_seconds = pings  # alive while they run, however slow the machine is
        assert [c.get(timeout=30) for c in calls] == [0.05] * 5
        client.ping_seconds = 3600.0
        wait_for(forgotten, 20, "the scheduler to forget the client again")
        assert square.remote(4) == 16  # the blocking path re-announces itself too
        assert client.status()["counters"]["succeeded"] >= 7
    finally:
        observer.close()


def test_cancel_right_after_dispatch_is_not_lost(cluster: gpufn.Client, tmp_path: Path) -> None:
    @gpufn.gpu(concurrency=4)
    def slow(marker: str) -> str:
        for _ in range(100):
            time.sleep(0.02)
        Path(marker).touch()
        return "finished"

    before = cluster.status()["counters"]
    calls = [slow.spawn(str(tmp_path / f"m{i}")) for i in range(4)]
    for c in calls:
        c.cancel()
    for c in calls:
        with pytest.raises(gpufn.Cancelled):
            c.get(timeout=10)
    wait_idle(cluster, "test_cancel_right_after_dispatch_is_not_lost.<locals>.slow")
    assert not list(tmp_path.iterdir())  # stopped, not run to the end
    assert cluster.status()["counters"]["restarts"] == before["restarts"]  # nobody was killed


def test_cancelling_an_async_map_cancels_its_calls(cluster: gpufn.Client) -> None:
    async def consume() -> list[float]:
        return [x async for x in sleepy.map.aio([0.3] * 20)]

    before = settled_counters(cluster)
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(consume(), timeout=0.5))
    wait_idle(cluster)
    after = settled_counters(cluster)
    # The calls not started are dropped where they wait: at the scheduler, under a
    # lease at a worker, or in the client (never sent); only those running ran on.
    ran = after["succeeded"] - before["succeeded"]
    assert ran <= 8, f"{ran} of the 20 calls ran after the map was cancelled"


def test_spmd_false_after_a_cancel_returns_its_own_value(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    client = fresh_cluster(GPUFN_CPU_DEVICES=2)

    @gpufn.gpu(count=2, spmd=False, timeout=120)
    def echo_multi(x: str, seconds: float) -> str:
        time.sleep(seconds)
        return x

    assert echo_multi.remote("warm", 0.0) == "warm"
    a = echo_multi.spawn("A", 3.0)
    wait_for(lambda: a.id in running_ids(client), 20, "the call to run")
    a.cancel()
    with pytest.raises(gpufn.Cancelled):
        a.get(timeout=10)
    assert echo_multi.remote("B", 0.0) == "B"
