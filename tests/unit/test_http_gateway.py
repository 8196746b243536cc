"""The HTTP gateway's parts below its routes, on a real event loop: a call cancelled when
its HTTP client leaves, a generator's values under its credit window, spawned calls'
views, the SSE response, the token pool and its reaper, the directory of deployed apps.

The scheduler connection is `Conn`: a stand-in for `gpufn.client.Client` with the methods
the gateway uses, whose futures and value queue are the client's real ones. It lets each
test decide when a Result, a value or a reply arrives and see each cancel, credit and
close; the routes over a real scheduler are tests/integration/test_http*.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import time
from concurrent.futures import Future
from typing import Any

import pytest

from gpufn.client.items import ItemQueue
from gpufn.exceptions import AuthenticationError, ConnectionLost, GpufnError, NotFound, Timeout
from gpufn.http import calls, directory, events, pool
from gpufn.http.errors import HTTPError
from gpufn.wire import jsonwire
from gpufn.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


class Conn:
    """What the gateway calls on a scheduler connection, recorded."""

    def __init__(self, address: str = "tcp://sched:1", user: str | None = None,
                 admin: bool = False) -> None:
        self.address = address
        self.info = type("Info", (), {"user": user, "admin": admin})()
        self.closed = False
        self.submitted: dict[str, Future[p.Result]] = {}
        self.streams: dict[str, ItemQueue] = {}
        self.cancels: list[tuple[str, str]] = []
        self.credits: list[tuple[str, int]] = []
        self.requests: list[p.Message] = []
        self.forgotten: list[int] = []
        self.replies: dict[type, Any] = {}  # message type -> reply data, or a GpufnError
        self._ids = itertools.count(1)
        self.close_calls = 0

    def new_id(self) -> str:
        return f"inv{next(self._ids)}"

    def submit(self, sub: p.Submit, name: str) -> Future[p.Result]:
        fut: Future[p.Result] = Future()
        self.submitted[sub.invocation_id] = fut
        return fut

    def submit_stream(self, sub: p.Submit, name: str) -> tuple[Future[p.Result], ItemQueue]:
        items = ItemQueue()
        self.streams[sub.invocation_id] = items
        fut = self.submit(sub, name)
        fut.add_done_callback(items.end)
        return fut, items

    def cancel(self, invocation_id: str, reason: str = "") -> None:
        self.cancels.append((invocation_id, reason))

    def credit(self, invocation_id: str, allowed: int) -> None:
        self.credits.append((invocation_id, allowed))

    def request(self, make: Any) -> tuple[int, Future[Any]]:
        rid = next(self._ids)
        msg = make(rid)
        self.requests.append(msg)
        fut: Future[Any] = Future()
        reply = self.replies.get(type(msg))
        if isinstance(reply, Exception):
            fut.set_exception(reply)
        elif reply is not None:
            fut.set_result(reply(msg) if callable(reply) else reply)
        return rid, fut

    def forget(self, request_id: int) -> None:
        self.forgotten.append(request_id)

    def close(self) -> None:
        self.close_calls += 1
        self.closed = True


def entry(conn: Conn | None = None, owner: str = "alice") -> pool.Entry:
    return pool.Entry(conn or Conn(), owner)  # type: ignore[arg-type]


def result(inv: str, value: Any = None, ok: bool = True, kind: str = "", message: str = "",
           **meta: Any) -> p.Result:
    frames = tuple(jsonwire.dump_value(value, "v")) if ok else ()
    return p.Result(inv, ok, kind, message, p.ResultMeta(**meta), frames=frames)


class Receive:
    """An ASGI `receive` whose disconnect comes when the test says; it records whether
    its waiter was cancelled."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.cancelled = False
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        try:
            await self.gone.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return {"type": "http.disconnect"}


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# --------------------------------------------------------------------------- one call


def test_submit_sends_json_arguments_to_the_targets_function_and_keeps_only_when_asked() -> None:
    target = directory._target("app", {"name": "f", "interface": {}}, 3, True)
    e = entry()
    sub = calls.submit(e, target, [1, "x"], {"k": [2]}, {"priority": 2})
    assert sub.invocation_id == "inv1" and sub.function_id == p.app_alias("app", "f", 3)
    assert sub.options == {"priority": 2} and sub.keep is False
    assert jsonwire.load_call(sub.frames) == ((1, "x"), {"k": [2]})
    assert calls.submit(e, target, [], {}, {}, keep=True).keep is True


def test_a_call_without_a_disconnect_watch_is_answered() -> None:
    async def scenario() -> None:
        e = entry()
        sub = calls.submit(e, directory._target("a", {"name": "f"}, 1, False), [], {}, {})
        task = asyncio.ensure_future(calls.call(e, sub, "a.f", None))
        await settle()
        e.client.submitted[sub.invocation_id].set_result(result(sub.invocation_id, 7))
        res = await task
        assert res.ok and jsonwire.load_value(res.frames) == 7
        assert e.client.cancels == []

    asyncio.run(scenario())


def test_a_call_answered_first_stops_watching_for_the_client_leaving() -> None:
    async def scenario() -> None:
        e, rx = entry(), Receive()
        sub = calls.submit(e, directory._target("a", {"name": "f"}, 1, False), [], {}, {})
        task = asyncio.ensure_future(calls.call(e, sub, "a.f", rx))
        await settle()
        assert not task.done()
        e.client.submitted[sub.invocation_id].set_result(result(sub.invocation_id, 1))
        assert (await task).ok
        await settle()
        assert rx.cancelled and e.client.cancels == []

    asyncio.run(scenario())


def test_a_client_leaving_first_cancels_the_call_on_its_worker() -> None:
    async def scenario() -> None:
        e, rx = entry(), Receive()
        sub = calls.submit(e, directory._target("a", {"name": "f"}, 1, False), [], {}, {})
        task = asyncio.ensure_future(calls.call(e, sub, "a.f", rx))
        await settle()
        rx.gone.set()
        with pytest.raises(calls.ClientGone):
            await task
        assert e.client.cancels == [(sub.invocation_id, "the HTTP client disconnected")]
        assert not e.client.submitted[sub.invocation_id].cancelled()  # the client's own future

    asyncio.run(scenario())


def test_until_gone_returns_the_work_or_cancels_it_when_the_client_leaves() -> None:
    async def scenario() -> None:
        async def work(ev: asyncio.Event, log: list[str]) -> int:
            try:
                await ev.wait()
                return 5
            finally:
                log.append("done")

        ev, log, rx = asyncio.Event(), [], Receive()
        task = asyncio.ensure_future(calls.until_gone(work(ev, log), rx))
        await settle()
        ev.set()
        assert await task == 5 and log == ["done"]
        await settle()
        assert rx.cancelled  # the disconnect watch is stopped

        ev, log, rx = asyncio.Event(), [], Receive()
        task = asyncio.ensure_future(calls.until_gone(work(ev, log), rx))
        await settle()
        rx.gone.set()
        with pytest.raises(calls.ClientGone):
            await task
        assert log == ["done"]  # the work was cancelled and its finally ran before the raise

        # until_gone itself cancelled (the server shutting down): both tasks stop
        ev, log, rx = asyncio.Event(), [], Receive()
        task = asyncio.ensure_future(calls.until_gone(work(ev, log), rx))
        await settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle()
        assert log == ["done"] and rx.cancelled

    asyncio.run(scenario())


def test_an_answer_splices_the_value_and_names_the_call() -> None:
    body = calls.answer(result("c9", {"a": [1, 2]}))
    assert json.loads(body) == {"result": {"a": [1, 2]}, "call_id": "c9"}
    gathered = p.Result("g", True, "", "", p.ResultMeta(gather=[2, 2, 2]), frames=(
        *jsonwire.dump_value(1, "v"), *jsonwire.dump_value("two", "v"),
        *jsonwire.dump_value([3], "v")))
    assert json.loads(calls.value(gathered)) == [1, "two", [3]]
    with pytest.raises(HTTPError) as failed:
        calls.value(result("c", ok=False, kind="Timeout", message="too slow"))
    assert (failed.value.status, failed.value.type) == (504, "Timeout")
    pickled = p.Result("c", True, "", "", p.ResultMeta(), frames=(b"\x80\x05K\x01.",))
    with pytest.raises(HTTPError) as not_json:
        calls.value(pickled)
    assert (not_json.value.status, not_json.value.type) == (500, "SerializationError")


# --------------------------------------------------------------------------- streams


def _item(inv: str, seq: int, value: Any) -> p.Item:
    return p.Item(inv, 1, seq, frames=tuple(jsonwire.dump_value(value, "v")))


def test_a_streams_values_come_in_order_under_its_credit_window() -> None:
    async def scenario() -> None:
        e = entry()
        sub = calls.submit(e, directory._target("a", {"name": "g"}, 1, False), [], {}, {})
        stream = calls.Stream(e, sub, "a.g")
        n = 2 * calls.CREDIT_EVERY + 1
        items = e.client.streams[sub.invocation_id]
        for i in range(n):
            items.put(_item(sub.invocation_id, i, i * 10))
        e.client.submitted[sub.invocation_id].set_result(result(sub.invocation_id))
        got = [json.loads(v) async for v in stream.values()]
        assert got == [i * 10 for i in range(n)]
        inv = sub.invocation_id
        assert e.client.credits == [(inv, calls.CREDIT_EVERY + p.STREAM_WINDOW),
                                    (inv, 2 * calls.CREDIT_EVERY + p.STREAM_WINDOW)]
        assert stream.error() is None and e.client.cancels == []
        assert stream.result is not None and stream.result.ok

    assert calls.CREDIT_EVERY == p.STREAM_WINDOW // 4
    asyncio.run(scenario())


def test_a_stream_whose_call_failed_says_why_after_its_values() -> None:
    async def scenario() -> None:
        for exc, kind in ((Timeout("over"), "Timeout"), (RuntimeError("odd"), "GpufnError")):
            e = entry()
            sub = calls.submit(e, directory._target("a", {"name": "g"}, 1, False), [], {}, {})
            stream = calls.Stream(e, sub, "a.g")
            e.client.streams[sub.invocation_id].put(_item(sub.invocation_id, 0, "v"))
            e.client.submitted[sub.invocation_id].set_exception(exc)
            assert [v async for v in stream.values()] == [b'"v"']
            assert stream.result is not None and not stream.result.ok
            assert (stream.result.error_kind, stream.result.message) == (kind, str(exc))
            err = stream.error()
            assert err is not None and err.type == kind
            assert e.client.cancels == []  # ended: nothing to cancel

        e = entry()  # a failed Result (not an exception) is the error too
        sub = calls.submit(e, directory._target("a", {"name": "g"}, 1, False), [], {}, {})
        stream = calls.Stream(e, sub, "a.g")
        e.client.submitted[sub.invocation_id].set_result(
            result(sub.invocation_id, ok=False, kind="Cancelled", message="stop"))
        assert [v async for v in stream.values()] == []
        err = stream.error()
        assert err is not None and err.type == "Cancelled"

    asyncio.run(scenario())


def test_a_value_out_of_order_is_refused_and_the_call_cancelled() -> None:
    async def scenario() -> None:
        e = entry()
        sub = calls.submit(e, directory._target("a", {"name": "g"}, 1, False), [], {}, {})
        stream = calls.Stream(e, sub, "a.g")
        e.client.streams[sub.invocation_id].put(_item(sub.invocation_id, 1, "late"))
        with pytest.raises(HTTPError) as bad:
            async for _ in stream.values():
                pass
        assert bad.value.status == 500 and "arrived where value 0" in bad.value.message
        assert e.client.cancels == [(sub.invocation_id, "the HTTP client closed the stream")]

    asyncio.run(scenario())


def test_closing_a_stream_early_cancels_the_remote_generator() -> None:
    async def scenario() -> None:
        e = entry()
        sub = calls.submit(e, directory._target("a", {"name": "g"}, 1, False), [], {}, {})
        stream = calls.Stream(e, sub, "a.g")
        e.client.streams[sub.invocation_id].put(_item(sub.invocation_id, 0, 1))
        gen = stream.values()
        assert await gen.__anext__() == b"1"
        await gen.aclose()
        assert e.client.cancels == [(sub.invocation_id, "the HTTP client closed the stream")]

    asyncio.run(scenario())


# --------------------------------------------------------------------------- spawned calls


def _spawned(fut: Future[p.Result] | None = None) -> calls.Spawned:
    return calls.Spawned("c1", "alice", "a.f", fut or Future(), entry=None,  # type: ignore[arg-type]
                         created=100.0)


def _done(res: p.Result | None = None, exc: BaseException | None = None) -> Future[p.Result]:
    fut: Future[p.Result] = Future()
    if exc is not None:
        fut.set_exception(exc)
    else:
        assert res is not None
        fut.set_result(res)
    return fut


def test_a_spawned_call_is_lost_only_when_its_connection_closed_first() -> None:
    assert not _spawned().lost()
    assert _spawned(_done(exc=ConnectionLost("gone"))).lost()
    assert not _spawned(_done(exc=Timeout("slow"))).lost()
    assert not _spawned(_done(result("c1", 1))).lost()
    assert not _spawned().unknown()  # still out
    assert not _spawned(_done(exc=ConnectionLost("gone"))).unknown()


def test_a_spawned_calls_view_in_each_state() -> None:
    def view(s: calls.Spawned, running: bool | None = None) -> dict[str, Any]:
        status, body = s.view(running)
        assert status == 200
        out: dict[str, Any] = json.loads(body)
        assert (out.pop("call_id"), out.pop("function"), out.pop("created")) == ("c1", "a.f", 100.0)
        return out

    assert view(_spawned(), False) == {"state": "queued"}
    assert view(_spawned(), True) == {"state": "running"}
    assert view(_spawned(), None) == {"state": "pending"}
    assert view(_spawned(_done(result("c1", [1, "a"])))) == {"state": "done", "result": [1, "a"]}
    pickled = p.Result("c1", True, "", "", p.ResultMeta(), frames=(b"\x80\x05K\x01.",))
    assert view(_spawned(_done(pickled)))["error"]["type"] == "SerializationError"
    assert view(_spawned(_done(exc=ConnectionLost("the gateway's connection closed")))) == {
        "state": "failed", "error": {"type": "ConnectionLost",
                                     "message": "the gateway's connection closed"}}
    assert view(_spawned(_done(result("c1", ok=False, kind="Cancelled", message="by you")))) == {
        "state": "cancelled", "error": {"type": "Cancelled", "message": "by you"}}
    failed = view(_spawned(_done(result("c1", ok=False, message="boom", error_type="KeyError"))))
    assert failed == {"state": "failed", "error": {"type": "KeyError", "message": "boom",
                                                   "remote": True}}


def test_a_finished_spawned_result_is_kept_under_the_default_bounds_and_forgotten_on_ask(
        ) -> None:
    assert (calls.KEEP_CALLS, calls.KEEP_BYTES) == (4096, 256 * 2**20)

    async def scenario() -> None:
        book = calls.SpawnBook()
        e = entry()
        fut: Future[p.Result] = Future()
        book.add(calls.Spawned("c1", "alice", "a.f", fut, e), asyncio.get_running_loop())
        fut.set_result(p.Result("c1", True, "", "", frames=(b"x" * 5000,)))
        await settle()
        assert list(book.calls) == ["c1"] and book.finished_bytes == 5000
        lost: Future[p.Result] = Future()  # no Result: counts no bytes
        book.add(calls.Spawned("c2", "alice", "a.f", lost, e), asyncio.get_running_loop())
        lost.set_exception(ConnectionLost("gone"))
        await settle()
        assert list(book.calls) == ["c1", "c2"] and book.finished_bytes == 5000
        book.forget("c2")
        book.forget("nope")
        assert book.finished_bytes == 5000
        book.forget("c1")
        assert book.finished_bytes == 0 and not book.calls

    asyncio.run(scenario())


# --------------------------------------------------------------------------- SSE


def test_an_event_is_named_only_when_asked() -> None:
    assert events.event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert events.event(b"[]", "end") == b"event: end\ndata: []\n\n"


def test_an_event_stream_sends_every_event_then_ends() -> None:
    async def scenario() -> None:
        sent: list[dict[str, Any]] = []

        async def gen() -> Any:
            for i in range(3):
                yield events.event(str(i).encode())

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        rx = Receive()
        await events.EventStream(gen(), 201, {"X-Call": "c1"})({"type": "http"}, rx, send)
        start = sent[0]
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        assert start["type"] == "http.response.start" and start["status"] == 201
        assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
        assert headers["x-call"] == "c1" and headers["content-type"].startswith(
            "text/event-stream")
        assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
        assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
        assert rx.cancelled  # the disconnect watch stopped with the stream

    asyncio.run(scenario())


def test_a_client_leaving_stops_an_event_stream_waiting_for_its_next_value() -> None:
    async def scenario() -> None:
        closed: list[str] = []
        never = asyncio.Event()

        async def gen() -> Any:
            try:
                yield b"data: 0\n\n"
                await never.wait()
                yield b"data: 1\n\n"
            finally:
                closed.append("finally")

        sent: list[dict[str, Any]] = []

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        rx = Receive()
        task = asyncio.ensure_future(events.EventStream(gen())({"type": "http"}, rx, send))
        await settle(10)
        assert sent[0]["status"] == 200 and [m.get("body") for m in sent[1:]] == [b"data: 0\n\n"]
        t0 = time.monotonic()
        rx.gone.set()
        await asyncio.wait_for(task, 5)
        assert time.monotonic() - t0 < 1 and closed == ["finally"]
        assert len(sent) == 2  # no end of body for a client that left

    asyncio.run(scenario())


def test_a_stream_stopped_at_a_yield_is_closed_before_the_response_returns() -> None:
    """A slow client: the send of a value blocks, the generator waits at its yield; when
    the client leaves, the generator's finally (which cancels the remote call) has run by
    the time the response returns, not whenever the generator is collected."""

    async def scenario() -> None:
        closed: list[str] = []

        async def gen() -> Any:
            try:
                for i in range(10):
                    yield f"data: {i}\n\n".encode()
            finally:
                closed.append("finally")

        blocked = asyncio.Event()

        async def send(msg: dict[str, Any]) -> None:
            if msg.get("body"):
                blocked.set()
                await asyncio.Event().wait()  # the client reads nothing

        rx = Receive()
        task = asyncio.ensure_future(events.EventStream(gen())({"type": "http"}, rx, send))
        await asyncio.wait_for(blocked.wait(), 5)
        rx.gone.set()
        await asyncio.wait_for(task, 5)
        assert closed == ["finally"]

        class Values:  # an async iterator with no aclose
            def __init__(self) -> None:
                self.left = 2

            def __aiter__(self) -> Values:
                return self

            async def __anext__(self) -> bytes:
                if not self.left:
                    raise StopAsyncIteration
                self.left -= 1
                return b"data: x\n\n"

        sent: list[dict[str, Any]] = []

        async def record(msg: dict[str, Any]) -> None:
            sent.append(msg)

        await events.EventStream(Values())({"type": "http"}, Receive(), record)
        assert [m.get("body") for m in sent[1:]] == [b"data: x\n\n", b"data: x\n\n", b""]

    asyncio.run(scenario())


def test_wait_disconnect_reads_past_other_messages() -> None:
    async def scenario() -> None:
        msgs = iter([{"type": "http.request"}, {"type": "http.request"},
                     {"type": "http.disconnect"}])
        count = 0

        async def receive() -> dict[str, Any]:
            nonlocal count
            count += 1
            return next(msgs)

        await events.wait_disconnect(receive)
        assert count == 3

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the token pool


def test_ask_answers_the_reply_and_forgets_the_request() -> None:
    async def scenario() -> None:
        conn = Conn()
        conn.replies[p.AppCommand] = {"apps": []}
        assert await pool.ask(conn, lambda rid: p.AppCommand(rid, "list", {})) == {  # type: ignore[arg-type]
            "apps": []}
        conn.replies[p.AppCommand] = NotFound("no app x")
        with pytest.raises(NotFound):
            await pool.ask(conn, lambda rid: p.AppCommand(rid, "list", {}))  # type: ignore[arg-type]
        del conn.replies[p.AppCommand]  # never answered
        with pytest.raises(ConnectionLost) as lost:
            await pool.ask(conn, lambda rid: p.AppCommand(rid, "list", {}),  # type: ignore[arg-type]
                           timeout=0.05)
        assert "tcp://sched:1 did not answer within 0s" in str(lost.value)
        assert conn.forgotten == [1, 2, 3]

    asyncio.run(scenario())


def test_a_request_waits_thirty_seconds_and_the_reaper_looks_every_five(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults: how long a reply is waited for, and how often idle connections are
    looked for (at most as long as the idle time itself)."""
    waits: list[float] = []
    sleeps: list[float] = []
    real_wait_for, real_sleep = asyncio.wait_for, asyncio.sleep

    async def wait_for(aw: Any, timeout: float) -> Any:
        waits.append(timeout)
        return await real_wait_for(aw, 0.01)

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await real_sleep(0)
        if len(sleeps) >= 2:
            raise asyncio.CancelledError

    async def scenario() -> None:
        with pytest.raises(ConnectionLost) as lost:
            await pool.ask(Conn(), lambda rid: p.AppCommand(rid, "list", {}))  # type: ignore[arg-type]
        assert waits == [30.0] and "within 30s" in str(lost.value)
        for idle_s in (3600.0, 0.5):
            sleeps.clear()
            cp = pool.ClientPool("tcp://h:1", idle_s=idle_s)
            with pytest.raises(asyncio.CancelledError):
                await cp._reap_loop()
            assert sleeps == [min(5.0, idle_s)] * 2

    monkeypatch.setattr(asyncio, "wait_for", wait_for)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    asyncio.run(scenario())


def test_an_entry_counts_what_it_holds_and_when_it_was_last_used() -> None:
    e = entry()
    assert not e.admin and e.inflight == 0
    before = e.last_used
    time.sleep(0.01)
    e.hold()
    assert e.inflight == 1 and e.last_used > before
    held = e.last_used
    time.sleep(0.01)
    e.release()
    assert e.inflight == 0 and e.last_used > held
    assert pool.digest("tok") == hashlib.sha256(b"tok").hexdigest()[:16]

    async def scenario() -> None:
        async def work() -> int:
            assert e.inflight == 1
            return 3

        async def fails() -> None:
            assert e.inflight == 1
            raise ValueError("x")

        assert await pool.guarded(e, work) == 3 and e.inflight == 0
        with pytest.raises(ValueError):
            await pool.guarded(e, fails)
        assert e.inflight == 0

    asyncio.run(scenario())


def test_a_token_gets_one_connection_shared_by_its_requests() -> None:
    made: list[tuple[str, str, float]] = []
    conns: list[Conn] = []

    def make(address: str, token: str, timeout: float) -> Conn:
        made.append((address, token, timeout))
        time.sleep(0.05)  # a handshake: the concurrent asks wait for this one
        conns.append(Conn(user="bob" if token == "t-bob" else None, admin=token == "t-admin"))
        return conns[-1]

    async def scenario() -> None:
        default = pool.ClientPool("tcp://h:1", idle_s=60, make_client=make)  # type: ignore[arg-type]
        await default.entry("t-default")
        assert made.pop() == ("tcp://h:1", "t-default", 15.0)
        cp = pool.ClientPool("tcp://h:1", idle_s=60, connect_timeout=7.0,
                             make_client=make)  # type: ignore[arg-type]
        a, b = await asyncio.gather(cp.entry("t-anon"), cp.entry("t-anon"))
        assert a is b and made == [("tcp://h:1", "t-anon", 7.0)] and len(cp) == 1
        assert a.owner == pool.digest("t-anon") and not a.admin
        before = a.last_used
        await asyncio.sleep(0.01)
        assert await cp.entry("t-anon") is a and a.last_used > before and len(made) == 1
        bob, admin = await cp.entry("t-bob"), await cp.entry("t-admin")
        assert (bob.owner, bob.admin, admin.admin) == ("bob", False, True)
        older = Conn()  # a scheduler that names no admin flag: not an admin
        del older.info
        older.info = type("Info", (), {"user": "carol"})()
        cp._make = lambda *_: older  # type: ignore[assignment]
        carol = await cp.entry("t-carol")
        assert (carol.owner, carol.admin) == ("carol", False)
        cp._make = make  # type: ignore[assignment]
        a.client.closed = True  # its connection went away: a new one, the old one closed
        again = await cp.entry("t-anon")
        assert again is not a and len(made) == 4 and a.client.close_calls == 1  # type: ignore[attr-defined]
        await cp.close()
        assert len(cp) == 0 and all(c.close_calls == 1 for c in conns[1:])
        assert older.close_calls == 1 and conns[0].close_calls == 0  # another pool's

    asyncio.run(scenario())


def test_a_refused_or_unreachable_connection_is_an_http_error() -> None:
    def refuse(address: str, token: str, timeout: float) -> Conn:
        raise AuthenticationError("bad token")

    def unreachable(address: str, token: str, timeout: float) -> Conn:
        raise ConnectionLost("no route")

    async def scenario() -> None:
        with pytest.raises(HTTPError) as refused:
            await pool.ClientPool("tcp://h:1", 60, make_client=refuse).entry("x")  # type: ignore[arg-type]
        assert refused.value.status == 401 and "Bearer" in refused.value.message
        cp = pool.ClientPool("tcp://h:1", 60, make_client=unreachable)  # type: ignore[arg-type]
        with pytest.raises(HTTPError) as down:
            await cp.entry("x")
        assert (down.value.status, down.value.type) == (503, "ConnectionLost")
        assert "tcp://h:1" in down.value.message and "no route" in down.value.message
        assert cp._connecting == {}  # a failed connect is not remembered

    asyncio.run(scenario())


def test_idle_connections_are_reaped_unless_in_use() -> None:
    async def scenario() -> None:
        conns: dict[str, Conn] = {}

        def make(address: str, token: str, timeout: float) -> Conn:
            conns[token] = Conn()
            return conns[token]

        cp = pool.ClientPool("tcp://h:1", idle_s=10, make_client=make)  # type: ignore[arg-type]
        busy, idle, fresh = await cp.entry("busy"), await cp.entry("idle"), await cp.entry("fresh")
        now = time.monotonic()
        busy.hold()
        busy.last_used = idle.last_used = now - 10  # exactly idle_s ago
        fresh.last_used = now - 9.9
        assert await cp.reap(now) == 1
        assert conns["idle"].closed and not conns["busy"].closed and not conns["fresh"].closed
        assert len(cp) == 2
        await cp.close()

    asyncio.run(scenario())


def test_the_reaper_runs_on_its_own_and_outlives_a_failing_close(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(pool, "REAP_EVERY", 0.05)

    async def scenario() -> None:
        conns: list[Conn] = []

        def make(address: str, token: str, timeout: float) -> Conn:
            conns.append(Conn())
            if token == "bad":
                def broken() -> None:
                    raise OSError("close failed")
                conns[-1].close = broken  # type: ignore[method-assign]
            return conns[-1]

        cp = pool.ClientPool("tcp://h:1", idle_s=3600, make_client=make)  # type: ignore[arg-type]
        cp.start()
        await cp.entry("bad")
        await cp.entry("good")
        cp.idle_s = 0.0
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(cp) == 0 and conns[1].closed:
                break
        assert conns[1].closed and len(cp) == 0
        assert "closing idle scheduler connections failed" in caplog.text
        reaper = cp._reaper
        assert reaper is not None and not reaper.done()  # still running after the failure
        await cp.close()
        await settle()
        assert reaper.cancelled()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the directory


def _params(*specs: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    return {"params": [{"name": n, "kind": k, **extra} for n, k, extra in specs]}


def test_a_recorded_signature_reads_like_python() -> None:
    st = directory.signature_text
    assert st(_params(("a", "POSITIONAL_ONLY", {}), ("b", "POSITIONAL_ONLY", {}),
                      ("c", "POSITIONAL_OR_KEYWORD", {"annotation": "int", "has_default": True,
                                                      "default_repr": "1"}),
                      ("d", "KEYWORD_ONLY", {}))) == "a, b, /, c: int=1, *, d"
    assert st(_params(("a", "POSITIONAL_ONLY", {}))) == "a, /"
    assert st(_params(("args", "VAR_POSITIONAL", {}), ("k", "KEYWORD_ONLY", {}),
                      ("kw", "VAR_KEYWORD", {}))) == "*args, k, **kw"
    assert st(_params(("k", "KEYWORD_ONLY", {}), ("j", "KEYWORD_ONLY", {"has_default": True}))) \
        == "*, k, j=..."
    assert st({}) == ""


def test_a_target_checks_arguments_against_its_recorded_signature() -> None:
    t = directory._target("app", {"name": "f", "interface": _params(
        ("x", "POSITIONAL_OR_KEYWORD", {"annotation": "int"}))}, 4, False)
    assert (t.app, t.name, t.version, t.pinned) == ("app", "f", 4, False)
    assert t.function_id() == p.app_alias("app", "f") and not t.generator and t.chat_model == ""
    assert directory._target("app", {"function": "g"}, 4, True).function_id() == \
        p.app_alias("app", "g", 4)
    t.check([1], {})
    with pytest.raises(HTTPError) as bad:
        t.check([1, 2], {})
    assert (bad.value.status, bad.value.type) == (400, "BadArguments")
    assert bad.value.message.startswith("app.f(x: int): ")
    old = directory._target("app", {"name": "f"}, 1, False)  # deployed before interfaces
    assert directory.signature_text(old.interface) == "*args, **kwargs"
    old.check([1, 2], {"z": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):  # cached, shared by requests
        t.version = 5  # type: ignore[misc]
    gen = directory._target("app", {"name": "g", "interface": {"generator": True,
                                                               "chat_model": "m"}}, 1, False)
    assert gen.generator and gen.chat_model == "m"


def _apps(*apps: tuple[str, int, str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {"apps": [{"name": n, "version": v, "state": s, "functions": fns}
                     for n, v, s, fns in apps]}


def test_the_listing_is_asked_at_most_once_a_second_unless_fresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        conn = Conn()
        conn.replies[p.AppCommand] = _apps(("a", 1, "active", [{"name": "f"}]))
        d = directory.Directory(entry(conn))
        assert [a["name"] for a in await d.apps()] == ["a"]
        await d.apps()
        assert len(conn.requests) == 1
        clock = time.monotonic()
        monkeypatch.setattr(directory.time, "monotonic", lambda: clock)
        await d.apps(fresh=True)
        assert len(conn.requests) == 2
        monkeypatch.setattr(directory.time, "monotonic", lambda: clock + 1.0)  # a second on
        await d.apps()
        assert len(conn.requests) == 2
        monkeypatch.setattr(directory.time, "monotonic", lambda: clock + 1.001)
        await d.apps()
        assert len(conn.requests) == 3
        conn.replies[p.AppCommand] = GpufnError("denied")
        with pytest.raises(HTTPError):
            await d.apps(fresh=True)

    asyncio.run(scenario())


def test_a_function_is_found_in_the_listing_a_fresh_one_or_named_missing() -> None:
    async def scenario() -> None:
        conn = Conn()
        listing = _apps(("a", 2, "active", [{"name": "f"}]), ("old", 1, "stopped", [{"name": "f"}]))
        conn.replies[p.AppCommand] = listing
        d = directory.Directory(entry(conn))
        t = await d.target("a", "f")
        assert (t.app, t.name, t.version, t.pinned) == ("a", "f", 2, False)
        assert await d.target("a", "f") is t and len(conn.requests) == 1  # cached
        # A deploy newer than the listing: the listing is asked again, once.
        conn.replies[p.AppCommand] = _apps(("a", 2, "active", [{"name": "f"}, {"name": "g"}]),
                                           ("old", 1, "stopped", [{"name": "f"}]))
        assert (await d.target("a", "g")).name == "g" and len(conn.requests) == 2
        # Not deployed, or only in a stopped app: the scheduler's own answer names why.
        conn.replies[p.Lookup] = NotFound("no function old.f")
        with pytest.raises(HTTPError) as missing:
            await d.target("old", "f")
        assert missing.value.status == 404 and missing.value.extra["apps"] == {
            "a": ["f", "g"], "old": ["f"]}
        lookups = [m for m in conn.requests if isinstance(m, p.Lookup)]
        assert [(m.app, m.function, m.version) for m in lookups] == [("old", "f", 0)]
        conn.replies[p.Lookup] = {"name": "h"}  # the scheduler knows it, the listing not
        with pytest.raises(HTTPError) as listed:
            await d.target("a", "h")
        assert listed.value.status == 404 and "no function a.h is deployed" in listed.value.message
        conn.replies[p.Lookup] = GpufnError("the scheduler is busy")
        with pytest.raises(HTTPError) as other:
            await d.target("a", "zz")
        assert other.value.status == 500 and "apps" not in other.value.extra

    asyncio.run(scenario())


def test_a_pinned_version_is_looked_up_once() -> None:
    async def scenario() -> None:
        conn = Conn()
        conn.replies[p.Lookup] = lambda m: {"name": m.function, "interface": {"generator": True}}
        d = directory.Directory(entry(conn))
        t = await d.target("a", "f", 3)
        assert (t.version, t.pinned, t.generator) == (3, True, True)
        assert await d.target("a", "f", 3) is t
        assert [(m.app, m.function, m.version) for m in conn.requests] == [("a", "f", 3)]
        conn.replies[p.Lookup] = NotFound("no version 9")
        conn.replies[p.AppCommand] = _apps(("a", 3, "active", [{"name": "f"}]))
        with pytest.raises(HTTPError) as missing:
            await d.target("a", "f", 9)
        assert missing.value.extra["apps"] == {"a": ["f"]}

    asyncio.run(scenario())


def test_openai_models_are_named_by_their_declared_names() -> None:
    assert directory.openai_roles({"openai": {"chat": "m", "completion": "m", "embedding": "",
                                              "other": "x"}}) == {"chat": "m", "completion": "m"}
    assert directory.openai_roles({"chat_model": "old"}) == {"chat": "old"}
    assert directory.openai_roles({"openai": {"embedding": "e"}, "chat_model": "old"}) == {
        "embedding": "e"}

    async def scenario() -> None:
        conn = Conn()

        def fn(name: str, **roles: str) -> dict[str, Any]:
            return {"name": name, "interface": {"openai": roles}}

        conn.replies[p.AppCommand] = _apps(
            ("c", 1, "stopped", [fn("x", chat="gone")]),
            ("a", 1, "active", [fn("chat", chat="llama"), fn("emb", embedding="e5")]),
            ("b", 2, "active", [fn("chat", chat="llama", completion="llama")]))
        d = directory.Directory(entry(conn))
        models = await d.openai_models()
        assert set(models) == {"a/llama", "b/llama", "e5"}
        assert set(models["b/llama"]) == {"chat", "completion"}
        t = await d.openai_target("b/llama", "completion")
        assert (t.app, t.name, t.version, t.pinned) == ("b", "chat", 2, False)
        assert t.function_id() == p.app_alias("b", "chat")  # bound to the current version
        with pytest.raises(HTTPError) as wrong_role:
            await d.openai_target("e5", "chat")
        assert wrong_role.value.status == 404 and wrong_role.value.code == "model_not_found"
        assert wrong_role.value.message == ("'e5' is an embedding model, not a chat model; "
                                            "chat models: a/llama, b/llama")
        with pytest.raises(HTTPError) as none:
            await d.openai_target("gone", "completion")
        assert none.value.message == "no model 'gone' is deployed; completion models: b/llama"
        conn.replies[p.AppCommand] = _apps()
        with pytest.raises(HTTPError) as empty:
            await directory.Directory(entry(conn)).openai_target("x", "embedding")
        assert empty.value.message.endswith(
            "embedding models: none (declare one with @gpufn.embedding_model)")

    asyncio.run(scenario())


# --------------------------------------------------------------------------- error shapes


def test_an_error_in_the_native_and_the_openai_shape() -> None:
    from gpufn.http import errors

    e = errors.HTTPError(429, "QueueFull", "wait ✓", headers={"Retry-After": "2"}, param="n",
                         code="busy", at=time)
    assert (e.status, e.type, e.message, e.headers, e.param, e.code) == (
        429, "QueueFull", "wait ✓", {"Retry-After": "2"}, "n", "busy")
    assert e.extra == {"at": time}
    assert json.loads(e.body()) == {"error": {"type": "QueueFull", "message": "wait ✓",
                                              "at": str(time)}}
    assert "✓".encode() in e.body()  # not escaped
    assert e.event() == b"event: error\ndata: " + e.body_inner() + b"\n\n"
    assert "✓".encode() in e.event()
    assert e.openai() == {"message": "wait ✓", "type": "rate_limit_error", "param": "n",
                          "code": "busy"}
    assert json.loads(e.openai_body()) == {"error": e.openai()}
    assert "✓".encode() in e.openai_body()
    plain = errors.HTTPError(404, "NotFound", "no f")
    assert plain.headers == {} and plain.extra == {} and plain.param is None
    assert plain.openai() == {"message": "no f", "type": "not_found_error", "param": None,
                              "code": "not_found"}
    kinds = {s: errors.HTTPError(s, "X", "m").openai()["type"]
             for s in (400, 401, 403, 404, 405, 408, 409, 413, 422, 429, 499, 500, 503, 504)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error",
                     403: "permission_error", 404: "not_found_error",
                     405: "invalid_request_error", 408: "invalid_request_error",
                     409: "invalid_request_error", 413: "invalid_request_error",
                     422: "invalid_request_error", 429: "rate_limit_error",
                     499: "invalid_request_error", 500: "server_error", 503: "server_error",
                     504: "server_error"}
    remote = errors.HTTPError(500, "KeyError", "'k'", remote=True).openai()
    assert (remote["message"], remote["code"]) == ("KeyError: 'k'", "key_error")
    assert [errors._snake(k) for k in ("QueueFull", "V2Error", "HTTPError", "")] == [
        "queue_full", "v2_error", "httperror", "error"]
    bad = errors.bad_request("too long", param="messages", code="context_length_exceeded")
    assert (bad.status, bad.type, bad.param, bad.code) == (400, "BadRequest", "messages",
                                                           "context_length_exceeded")
    assert errors.bad_request("x", "InvalidJSON").type == "InvalidJSON"
    with pytest.raises(TypeError):  # param and code are named, never positional
        errors.bad_request("x", "T", "p")  # type: ignore[misc]


def test_no_answer_carries_a_traceback_or_a_server_path(caplog: pytest.LogCaptureFixture) -> None:
    from gpufn.http import errors

    tb = ('Traceback (most recent call last):\n  File "/srv/app.py", line 3, in f\n'
          "    x()\nKeyError: 'k'")
    assert errors.public(f"load failed\n{tb}") == "load failed"
    assert errors.public('bad\n  File "/srv/m.py", line 9, in g\nafter ') == "bad\nafter"
    assert errors.public("  plain  ") == "plain" and errors.public("no tb!") == "no tb!"
    assert errors.public(tb) == ""  # a message that is only a traceback
    token = errors.request_id.set("req_abc")
    try:
        caplog.clear()
        with caplog.at_level("WARNING", "gpufn.http"):
            assert errors._logged("Timeout", "too slow") == "too slow"
            assert caplog.records == []  # nothing hidden: nothing logged
            assert errors._logged("ModelLoadError", f"no weights\n{tb}") == "no weights"
            assert errors._logged("KeyError", "'k'", "the traceback") == "'k'"
        assert len(caplog.records) == 2
        assert "request req_abc: ModelLoadError: no weights" in caplog.records[0].getMessage()
        assert "/srv/app.py" in caplog.records[0].getMessage()
        assert caplog.records[1].getMessage().endswith("KeyError: 'k'\nthe traceback")
    finally:
        errors.request_id.reset(token)
    caplog.clear()
    with caplog.at_level("WARNING", "gpufn.http"):
        errors._logged("X", "m", "tb")
    assert "request -: X: m" in caplog.records[0].getMessage()


def test_gpufn_errors_and_failed_results_get_their_status(
        caplog: pytest.LogCaptureFixture) -> None:
    from gpufn.http import errors

    assert [(x.status, x.type) for x in (
        errors.from_gpufn(NotFound("no app")), errors.from_gpufn(Timeout("slow")),
        errors.from_gpufn(GpufnError("odd")))] == [(404, "NotFound"), (504, "Timeout"),
                                                   (500, "GpufnError")]
    stopped = errors.from_result(p.Result("c", False, "AppStopped", "app a is stopped"))
    assert (stopped.status, stopped.type, stopped.extra) == (503, "AppStopped", {})
    odd = errors.from_result(p.Result("c", False, "Strange", "m"))
    assert (odd.status, odd.type) == (500, "Strange")
    assert {k: errors.from_result(p.Result("c", False, k, "m")).status for k in errors.STATUS} == {
        "InvalidSpec": 400, "AuthenticationError": 401, "NotFound": 404, "RequestTimeout": 408,
        "PayloadTooLarge": 413, "QueueFull": 429, "ConnectionLost": 503, "AppStopped": 503,
        "Cancelled": 503, "Timeout": 504}
    caplog.clear()
    with caplog.at_level("WARNING", "gpufn.http"):
        remote = errors.from_result(p.Result("c", False, "", "boom",
                                             p.ResultMeta(traceback="the tb")))
        plain = errors.from_result(p.Result("c", False, "", f"bad\n{'Traceback (most recent call last)'}",
                                            p.ResultMeta(error_type="ValueError")))
    assert (remote.status, remote.type, remote.message, remote.extra) == (
        500, "Exception", "boom", {"remote": True})
    assert (plain.type, plain.message) == ("ValueError", "bad")
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0].endswith("Exception: boom\nthe tb")  # the traceback, to the log only
    assert logged[1].endswith("most recent call last)\n")  # no traceback: nothing after


def test_every_answer_carries_a_request_id() -> None:
    from gpufn.http import errors

    async def scenario() -> None:
        seen: list[tuple[str, dict[str, Any]]] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append((errors.request_id.get(), scope))
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"X-Request-Id", b"inner"), (b"a", b"1")]})
                await send({"type": "http.response.body", "body": b"ok"})

        async def run(scope: dict[str, Any]) -> list[dict[str, Any]]:
            sent: list[dict[str, Any]] = []

            async def send(m: dict[str, Any]) -> None:
                sent.append(m)

            await errors.RequestIds(app)(scope, Receive(), send)  # type: ignore[arg-type]
            return sent

        sent = await run({"type": "http", "headers": [(b"x-request-id", b"mine-1.2_3")]})
        assert sent[0]["headers"] == [(b"a", b"1"), (b"x-request-id", b"mine-1.2_3")]
        assert sent[1] == {"type": "http.response.body", "body": b"ok"}
        assert seen[-1][0] == "mine-1.2_3" and seen[-1][1]["state"]["request_id"] == "mine-1.2_3"
        sent = await run({"type": "http", "headers": [(b"x-request-id", b"x" * 64)]})
        assert dict(sent[0]["headers"])[b"x-request-id"] == b"x" * 64
        for given in (b"x" * 65, b"bad id", b"bad\nid", b"end\n", b""):
            sent = await run({"type": "http", "headers": [(b"x-request-id", given)]})
            rid = dict(sent[0]["headers"])[b"x-request-id"].decode()
            assert rid.startswith("req_") and len(rid) == 28 and seen[-1][0] == rid
        assert (await run({"type": "http"}))[0]["status"] == 200  # no headers at all
        assert errors.request_id.get() == ""  # reset after each request
        assert await run({"type": "lifespan"}) == [] and seen[-1] == ("", {"type": "lifespan"})

    asyncio.run(scenario())


# --------------------------------------------------------------------------- request bodies


def _request(chunks: list[dict[str, Any]], length: str | None = None) -> Any:
    from starlette.requests import Request

    headers = [(b"content-length", length.encode())] if length is not None else []
    it = iter(chunks)

    async def receive() -> dict[str, Any]:
        try:
            return next(it)
        except StopIteration:
            await asyncio.Event().wait()  # a stalled client
            raise AssertionError("unreachable") from None

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers},
                   receive)


def _body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


def test_the_body_budget_refuses_past_its_total_and_gives_back_what_a_request_held() -> None:
    from gpufn.http import bodies

    budget = bodies.BodyBudget(100)
    a, b = budget.lease(), budget.lease()
    a.grow(60)
    b.grow(40)  # exactly the total
    assert (budget.used, a.held, b.held) == (100, 60, 40)
    b.grow(0)  # nothing more: never refused
    with pytest.raises(HTTPError) as busy:
        b.grow(1)
    assert (busy.value.status, busy.value.type, busy.value.headers) == (
        503, "Busy", {"Retry-After": "1"})
    assert "reading 100 bytes" in busy.value.message and "budget of 100" in busy.value.message
    assert "again in 1s" in busy.value.message and b.held == 40
    a.release()
    assert (budget.used, a.held) == (40, 0)
    a.release()
    assert budget.used == 40


def test_a_body_is_read_within_its_limit_counted_as_it_comes() -> None:
    from gpufn.http import bodies

    async def read(chunks: list[dict[str, Any]], length: str | None = None, limit: int = 10,
                   total: int = 100, idle_s: float = 5.0) -> tuple[bytes, bodies.Lease]:
        lease = bodies.BodyBudget(total).lease()
        got = await bodies.read(_request(chunks, length), limit, lease, idle_s)
        return bytes(got), lease

    async def refused(*args: Any, **kw: Any) -> HTTPError:
        with pytest.raises(HTTPError) as e:
            await read(*args, **kw)
        return e.value

    async def scenario() -> None:
        got, lease = await read([_body(b"abc", True), _body(b"defg", True), _body(b"hij")])
        assert got == b"abcdefghij" and lease.held == 10  # exactly the limit
        got, lease = await read([_body(b"ab", True), {"type": "http.request"}], "9")
        assert got == b"ab" and lease.held == 9  # a declared length counts whole
        e = await refused([_body(b"abcdefghijk")])
        assert (e.status, e.type) == (413, "PayloadTooLarge")
        assert "passed 10 bytes" in e.message and "GPUFN_MAX_PAYLOAD" in e.message
        e = await refused([], "11")  # refused before any byte is read
        assert e.status == 413 and "the body has 11 bytes" in e.message
        e = await refused([], "10", total=9)  # the budget: before any byte too
        assert e.status == 503
        e = await refused([_body(b"abcdef", True), _body(b"ghij")], total=8)
        assert e.status == 503
        for bad in ("ten", "-1", " "):
            e = await refused([], bad)
            assert (e.status, e.headers) == (400, bodies.CLOSE) and repr(bad) in e.message
        e = await refused([_body(b"abcd", True)], idle_s=0.05)
        assert (e.status, e.type, e.headers) == (408, "RequestTimeout", bodies.CLOSE)
        assert "for 0.05s after 4 bytes" in e.message
        e = await refused([_body(b"ab", True), {"type": "http.disconnect"}])
        assert (e.status, e.headers) == (400, bodies.CLOSE) and "left" in e.message

    asyncio.run(scenario())


def test_a_body_is_json_without_nan_or_endless_nesting() -> None:
    from gpufn.http import bodies

    assert bodies.parse(b"") == {} and bodies.parse(bytearray(b" \n")) == {}
    assert bodies.parse(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    for raw, why in ((b'{"x": NaN}', "NaN is not a JSON number"),
                     (b"[Infinity]", "Infinity is not a JSON number"),
                     (b"[-Infinity]", "-Infinity is not a JSON number"),
                     (b"{oops", "the body is not JSON"),
                     (b"[" * 100_000 + b"]" * 100_000, "nested too deeply")):
        with pytest.raises(HTTPError) as e:
            bodies.parse(raw)
        assert e.value.status == 400 and why in e.value.message


def test_a_request_gives_back_its_budget_when_it_ends_even_failing() -> None:
    from gpufn.http import bodies

    async def scenario() -> None:
        budget = bodies.BodyBudget(100)

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            lease = budget.lease()
            lease.grow(30)
            scope.setdefault("state", {})["lease"] = lease
            if scope.get("fail"):
                raise RuntimeError("route failed")

        wrapped = bodies.ReleaseLeases(app)  # type: ignore[arg-type]
        await wrapped({"type": "http"}, Receive(), None)  # type: ignore[arg-type]
        assert budget.used == 0
        with pytest.raises(RuntimeError):
            await wrapped({"type": "http", "fail": True}, Receive(), None)  # type: ignore[arg-type]
        assert budget.used == 0

        async def other(scope: dict[str, Any], receive: Any, send: Any) -> None:
            scope["state"] = {"lease": "not a lease"}

        await bodies.ReleaseLeases(other)({"type": "http"}, Receive(), None)  # type: ignore[arg-type]
        async def nothing(scope: dict[str, Any], receive: Any, send: Any) -> None:
            pass

        await bodies.ReleaseLeases(nothing)({"type": "lifespan", "state": None}, Receive(), None)  # type: ignore[arg-type]

    asyncio.run(scenario())
