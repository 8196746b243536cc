"""The gateway's own routes through the whole ASGI app `create_app` builds (its middleware,
error handlers and routes), over the gateway tests' stand-in scheduler connection: the
token, calls and their options checked, answers, generators collected or streamed, a
plain call as events, spawned calls and their owners, status, health, the dashboard, and
errors in the native shape with their request id."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future
from typing import Any

import pytest

pytest.importorskip("starlette")

from starlette.routing import request_response

from gpufn.exceptions import AuthenticationError
from gpufn.http import app as gateway_app
from gpufn.http import calls
from gpufn.wire import interface as iface
from gpufn.wire import protocol as p
from tests.unit.test_http_gateway import Conn, _item, result, settle

pytestmark = pytest.mark.timeout(30)


def square(x: int, *, scale: int = 1) -> int:
    return x * x * scale


def count(n: int) -> Any:
    yield from range(n)


APPS = [{"name": "demo", "version": 3, "state": "active", "created": 5.0, "who": "alice",
         "functions": [{"name": "square", "interface": iface.describe(square)},
                       {"name": "count", "interface": iface.describe(count)}]}]


class Http:
    """The ASGI app driven directly: one request at a time, its messages recorded."""

    def __init__(self, users: dict[str, str] | None = None) -> None:
        self.app = gateway_app.create_app("tcp://sched:1", idle_s=60)
        inner: Any = self.app
        while not hasattr(getattr(inner, "state", None), "gateway"):
            inner = inner.app
        self.gw: gateway_app.Gateway = inner.state.gateway
        self.users = users or {"tok": "alice"}
        self.conns: dict[str, Conn] = {}

        def make(address: str, token: str, timeout: float) -> Conn:
            if token not in self.users:
                raise AuthenticationError("wrong token")
            conn = Conn(user=self.users[token])
            conn.replies[p.AppCommand] = {"apps": APPS}
            conn.replies[p.Lookup] = lambda m: {"name": m.function, "interface":
                                                iface.describe(square)}
            subs: list[p.Submit] = []
            submit = conn.submit

            def record(sub: p.Submit, name: str) -> Any:
                subs.append(sub)
                return submit(sub, name)

            conn.submit = record  # type: ignore[method-assign]
            conn.subs = subs  # type: ignore[attr-defined]
            attached: dict[str, Future[p.Result]] = {}

            def attach(call_id: str, name: str = "call") -> Future[p.Result]:
                fut: Future[p.Result] = Future()
                attached[call_id] = fut
                return fut

            conn.attach = attach  # type: ignore[attr-defined]
            conn.attached = attached  # type: ignore[attr-defined]
            self.conns[token] = conn
            return conn

        self.gw.pool._make = make  # type: ignore[assignment]

    def start(self, method: str, path: str, body: Any = None, token: str | None = "tok",
              headers: dict[str, str] | None = None) -> tuple[asyncio.Task[None], list[Any],
                                                               asyncio.Event]:
        path, _, query = path.partition("?")
        hs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if token is not None:
            hs.append((b"authorization", f"Bearer {token}".encode()))
        raw = b"" if body is None else (body if isinstance(body, bytes)
                                        else json.dumps(body).encode())
        hs.append((b"content-length", str(len(raw)).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "path": path, "raw_path": path.encode(),
                 "query_string": query.encode(), "headers": hs, "scheme": "http",
                 "server": ("test", 80), "client": ("127.0.0.1", 1), "root_path": ""}
        sent: list[Any] = []
        gone = asyncio.Event()
        first = True

        async def receive() -> dict[str, Any]:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        return asyncio.ensure_future(self.app(scope, receive, send)), sent, gone

    async def request(self, *args: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        task, sent, _ = self.start(*args, **kw)
        await asyncio.wait_for(task, 5)
        return answer(sent)


def answer(sent: list[Any]) -> tuple[int, dict[str, str], bytes]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, body


def run(coro: Any) -> None:
    asyncio.run(coro)


def test_health_the_dashboard_and_the_favicon_need_no_token() -> None:
    async def go() -> None:
        h = Http()
        assert (await h.request("GET", "/healthz", token=None))[::2] == (200, b'{"ok":true}')
        status, headers, body = await h.request("GET", "/", token=None)
        assert status == 200 and b"<html" in body.lower() and "text/html" in headers[
            "content-type"]
        assert (await h.request("GET", "/favicon.ico", token=None))[0] == 204

    run(go())


def test_a_request_without_a_valid_token_is_401_naming_the_fix() -> None:
    async def go() -> None:
        h = Http()
        for token, why in ((None, "send the cluster's token as 'Authorization: Bearer TOKEN'"),
                           ("bad", "the scheduler refused this token")):
            status, headers, body = await h.request("POST", "/v1/apps/demo/square",
                                                    {"args": [2]}, token=token)
            err = json.loads(body)["error"]
            assert status == 401 and headers["www-authenticate"] == "Bearer"
            assert err["type"] == "AuthenticationError" and why in err["message"]
        status, _, body = await h.request("GET", "/v1/apps", headers={"authorization": "Basic x"},
                                          token=None)
        assert status == 401

    run(go())


def test_a_call_answers_its_value_with_its_id() -> None:
    async def go() -> None:
        h = Http()
        task, sent, _ = h.start("POST", "/v1/apps/demo/square?priority=5&timeout=2.5",
                                {"args": [3], "kwargs": {"scale": 2}})
        await settle(20)
        conn = h.conns["tok"]
        (inv, fut), = conn.submitted.items()
        fut.set_result(result(inv, 18))
        await asyncio.wait_for(task, 5)
        status, headers, body = answer(sent)
        assert status == 200 and json.loads(body) == {"result": 18, "call_id": inv}
        assert headers["x-gpufn-call-id"] == inv and headers["content-type"] == "application/json"
        assert h.gw.pool._entries["tok"].inflight == 0

    run(go())


@pytest.mark.parametrize("path, body, why", [
    ("/v1/apps/demo/square", [1], "the body must be a JSON object"),
    ("/v1/apps/demo/square", {"args": [1], "extra": 1}, "unknown field(s) ['extra']"),
    ("/v1/apps/demo/square", {"args": {"x": 1}}, '"args" must be a list, got dict'),
    ("/v1/apps/demo/square", {"kwargs": [1]}, '"kwargs" must be an object, got list'),
    ("/v1/apps/demo/square", {"args": []}, "missing a required argument: 'x'"),
    ("/v1/apps/demo/square?prio=1", {"args": [1]}, "unknown query parameter(s) ['prio']"),
    ("/v1/apps/demo/square?priority=1&priority=2", {"args": [1]},
     "query parameter priority is given 2 times"),
    ("/v1/apps/demo/square?priority=high", {"args": [1]}, "priority='high' is not valid"),
    ("/v1/apps/demo/square?priority=1.5", {"args": [1]}, "priority='1.5' is not valid"),
    ("/v1/apps/demo/square?timeout=0", {"args": [1]}, "timeout='0' is not valid"),
    ("/v1/apps/demo/square?timeout=nan", {"args": [1]}, "a positive number of seconds"),
    ("/v1/apps/demo/square?timeout=1e10", {"args": [1]}, "timeout='1e10' is not valid"),
    ("/v1/apps/demo/square?version=0", {"args": [1]}, "version='0' is not valid"),
    ("/v1/apps/demo/square?version=x", {"args": [1]}, "from 1 to 2,147,483,647"),
])
def test_a_bad_call_is_400_naming_what_is_wrong_and_no_call_is_made(path: str, body: Any,
                                                                     why: str) -> None:
    async def go() -> None:
        h = Http()
        status, _, raw = await h.request("POST", path, body)
        err = json.loads(raw)["error"]
        assert status == 400 and why in err["message"], err
        assert h.conns["tok"].submitted == {}

    run(go())


def test_query_options_reach_the_submit_and_a_version_pins_the_function() -> None:
    async def go() -> None:
        h = Http()
        task, _, _ = h.start("POST", "/v1/apps/demo/square?priority=-3&timeout=0.5&version=2",
                             {"args": [1]})
        await settle(20)
        conn = h.conns["tok"]
        sub, = conn.subs  # type: ignore[attr-defined]
        assert sub.options == {"priority": -3, "timeout": 0.5} and not sub.keep
        assert sub.function_id == p.app_alias("demo", "square", 2)
        lookup = next(m for m in conn.requests if isinstance(m, p.Lookup))
        assert (lookup.app, lookup.function, lookup.version) == ("demo", "square", 2)
        conn.submitted[sub.invocation_id].set_result(result(sub.invocation_id, 1))
        await asyncio.wait_for(task, 5)
        status, _, _ = await h.request("POST", "/v1/apps/demo/square/spawn?priority=2",
                                          {"args": [1]})
        spawned = conn.subs[-1]  # type: ignore[attr-defined]
        assert status == 202 and spawned.keep and spawned.options == {"priority": 2}
        assert spawned.function_id == "app:demo/square"  # the current version, not pinned

    run(go())


def test_unknown_routes_and_methods_say_where_to_look() -> None:
    async def go() -> None:
        h = Http()
        for method, path, status in (("GET", "/v2/x", 404), ("GET", "/v1/apps/demo/square", 405)):
            got, _, raw = await h.request(method, path)
            err = json.loads(raw)["error"]
            assert got == status and f"no route {method} {path}" in err["message"]
            assert "GET /v1/apps" in err["message"]

    run(go())


def test_a_generator_is_collected_without_sse_and_streamed_with_it() -> None:
    async def go() -> None:
        h = Http()
        task, sent, _ = h.start("POST", "/v1/apps/demo/count", {"args": [2]})
        await settle(20)
        conn = h.conns["tok"]
        (inv, fut), = conn.submitted.items()
        for i in range(2):
            conn.streams[inv].put(_item(inv, i, i))
        fut.set_result(result(inv))
        await asyncio.wait_for(task, 5)
        status, _, body = answer(sent)
        assert status == 200 and json.loads(body) == {"result": [0, 1], "call_id": inv}

        task, sent, _ = h.start("POST", "/v1/apps/demo/count", {"args": [2]},
                                headers={"accept": "text/event-stream"})
        await settle(20)
        inv2 = next(i for i in conn.submitted if i != inv)
        conn.streams[inv2].put(_item(inv2, 0, "a"))
        conn.submitted[inv2].set_result(result(inv2))
        await asyncio.wait_for(task, 5)
        status, headers, body = answer(sent)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert headers["x-gpufn-call-id"] == inv2
        text = body.decode()
        assert text.startswith('data: "a"\n\n') and "event: end" in text
        assert json.loads(re.findall(r"event: end\ndata: (.*)\n", text)[0]) == {
            "call_id": inv2, "items": 1}

    run(go())


def test_a_plain_call_as_events_and_its_error_as_an_event() -> None:
    async def go() -> None:
        h = Http()
        for ok in (True, False):
            task, sent, _ = h.start("POST", "/v1/apps/demo/square", {"args": [4]},
                                    headers={"accept": "text/event-stream"})
            await settle(20)
            conn = h.conns["tok"]
            inv, fut = next((i, f) for i, f in conn.submitted.items() if not f.done())
            fut.set_result(result(inv, 16) if ok else result(
                inv, ok=False, kind="ValueError", message="negative"))
            await asyncio.wait_for(task, 5)
            text = answer(sent)[2].decode()
            if ok:
                assert text.startswith("data: 16\n\n") and '"items": 1' in text
            else:
                assert "event: error" in text and "negative" in text

    run(go())


def test_a_call_whose_client_leaves_is_cancelled_and_answered_499() -> None:
    async def go() -> None:
        h = Http()
        for headers in (None, {"accept": "text/event-stream"}):
            task, sent, gone = h.start("POST", "/v1/apps/demo/square", {"args": [1]},
                                       headers=headers)
            await settle(20)
            conn = h.conns["tok"]
            inv = next(i for i, f in conn.submitted.items() if not f.done())
            gone.set()
            await asyncio.wait_for(task, 5)
            if headers is None:
                assert answer(sent)[0] == 499
            assert inv in [i for i, _ in conn.cancels]
            conn.submitted[inv].set_result(result(inv, 1))

    run(go())


def test_spawned_calls_are_their_callers_and_can_be_cancelled() -> None:
    async def go() -> None:
        h = Http({"tok": "alice", "other": "bob"})
        status, _, body = await h.request("POST", "/v1/apps/demo/square/spawn", {"args": [5]})
        spawned = json.loads(body)
        inv = spawned["call_id"]
        assert status == 202 and spawned["url"] == f"/v1/calls/{inv}"
        conn = h.conns["tok"]
        conn.replies[p.StatusRequest] = {"devices": [{"running": [{"id": inv,
                                                                   "function": "demo.square"}]}]}
        status, _, body = await h.request("GET", f"/v1/calls/{inv}")
        view = json.loads(body)
        assert status == 200 and (view["state"], view["function"]) == ("running", "demo.square")
        status, _, body = await h.request("GET", f"/v1/calls/{inv}", token="other")
        assert status == 403 and "belongs to another caller" in json.loads(body)["error"][
            "message"]
        status, _, _ = await h.request("DELETE", f"/v1/calls/{inv}", token="other")
        assert status == 403 and not any(isinstance(m, p.Cancel) for m in conn.requests)
        conn.replies[p.Cancel] = {"cancelled": True}
        status, _, body = await h.request("DELETE", f"/v1/calls/{inv}")
        assert status == 200 and json.loads(body) == {"call_id": inv, "cancelled": True}
        cancel = next(m for m in conn.requests if isinstance(m, p.Cancel))
        assert cancel.invocation_id == inv and cancel.include_running
        conn.submitted[inv].set_result(result(inv, 25))
        await settle()
        status, _, body = await h.request("GET", f"/v1/calls/{inv}")
        assert status == 200 and json.loads(body)["state"] == "done"
        assert json.loads(body)["result"] == 25
        status, _, body = await h.request("DELETE", f"/v1/calls/{inv}")
        assert json.loads(body) == {"call_id": inv, "cancelled": False}  # ended: nothing to do

        status, _, body = await h.request("POST", "/v1/apps/demo/count/spawn", {"args": [1]})
        assert status == 400 and "is a generator function: stream it" in json.loads(body)[
            "error"]["message"]

    run(go())


def test_apps_and_status_for_their_caller() -> None:
    async def go() -> None:
        h = Http({"tok": "alice", "other": "bob"})
        status, _, body = await h.request("GET", "/v1/apps")
        demo = json.loads(body)["apps"][0]
        assert status == 200 and (demo["name"], demo["version"], demo["who"]) == (
            "demo", 3, "alice")
        sq = demo["functions"][0]
        assert sq["url"] == "/v1/apps/demo/square" and sq["streams"] is False
        assert demo["functions"][1]["streams"] is True
        await h.request("POST", "/v1/apps/nope/f", {"args": []})  # alice's 404
        await h.request("POST", "/v1/apps/nope/g", {"args": []}, token="other")  # bob's
        await h.request("GET", "/v1/status", token=None)  # a dashboard before its login
        conn = h.conns["tok"]
        conn.replies[p.StatusRequest] = {"devices": [{"key": "n:0", "last_error": (
            'boom\n  File "/srv/x.py", line 3, in f\nend')}], "you": {"admin": False}}
        status, _, body = await h.request("GET", "/v1/status")
        st = json.loads(body)
        assert status == 200 and st["status"]["devices"][0]["last_error"] == "boom\nend"
        errors = st["gateway"]["errors"]
        assert [e["path"] for e in errors] == ["/v1/apps/nope/f"] and errors[0]["status"] == 404
        assert st["gateway"]["connections"] == 2 and st["apps"][0]["name"] == "demo"
        conn.replies[p.StatusRequest] = {"devices": [], "you": {"admin": True}}
        st = json.loads((await h.request("GET", "/v1/status"))[2])
        assert [e["path"] for e in st["gateway"]["errors"]] == ["/v1/apps/nope/g",
                                                                 "/v1/apps/nope/f"]

    run(go())


def test_an_unexpected_failure_is_a_500_naming_its_request_id() -> None:
    async def go() -> None:
        h = Http()

        async def broken(request: Any) -> Any:
            raise KeyError("oops")

        route = next(r for r in _routes(h) if r.path == "/v1/apps")
        route.app = request_response(broken)
        task, sent, _ = h.start("GET", "/v1/apps")
        with pytest.raises(KeyError):  # answered, then raised on to the server (logged)
            await asyncio.wait_for(task, 5)
        status, headers, body = answer(sent)
        err = json.loads(body)["error"]
        assert status == 500 and err["type"] == "GatewayError" and "KeyError" in err["message"]
        rid = headers.get("x-request-id")
        assert rid and rid in err["message"]

    run(go())


def _routes(h: Http) -> list[Any]:
    inner: Any = h.app
    while not hasattr(inner, "routes"):
        inner = inner.app
    return list(inner.routes)


# --------------------------------------------------------------------------- edges


@pytest.mark.parametrize("query, ok", [
    ("priority=-1000000000", True), ("priority=1000000000", True), ("priority=1000000001", False),
    ("priority=-1000000001", False), ("priority=%2B-1", False), ("timeout=1000000000", True),
    ("timeout=1000000001", False), ("timeout=abc", False), ("version=2147483647", True),
    ("version=1", True)])
def test_query_options_at_their_bounds(query: str, ok: bool) -> None:
    from gpufn.wire.spec import INT_BOUNDS

    assert INT_BOUNDS["priority"] == (-1_000_000_000, 1_000_000_000)

    async def go() -> None:
        h = Http()
        task, sent, _ = h.start("POST", f"/v1/apps/demo/square?{query}", {"args": [1]})
        await settle(20)
        conn = h.conns["tok"]
        if ok:
            sub, = conn.subs  # type: ignore[attr-defined]
            conn.submitted[sub.invocation_id].set_result(result(sub.invocation_id, 1))
        await asyncio.wait_for(task, 5)
        assert answer(sent)[0] == (200 if ok else 400)

    run(go())


def test_the_idle_bound_is_the_configured_one_unless_given() -> None:
    from gpufn.wire import config

    assert gateway_app.Gateway("tcp://h:1").pool.idle_s == config.http_client_idle()
    assert gateway_app.Gateway("tcp://h:1", 7.0).pool.idle_s == 7.0


def test_a_bearer_without_a_token_is_told_to_send_one() -> None:
    async def go() -> None:
        h = Http()
        status, _, body = await h.request("GET", "/v1/apps", token=None,
                                          headers={"authorization": "Bearer  "})
        message = json.loads(body)["error"]["message"]
        assert status == 401 and message.startswith("send the cluster's token")
        assert h.conns == {}  # never sent to the scheduler

    run(go())


def test_route_errors_are_typed_and_the_recent_ones_bounded() -> None:
    async def go() -> None:
        h = Http()
        assert json.loads((await h.request("GET", "/nope"))[2])["error"]["type"] == "NotFound"
        assert json.loads((await h.request("PUT", "/v1/apps"))[2])["error"][
            "type"] == "MethodNotAllowed"
        await h.request("POST", "/v1/status")  # 405 on the status path: listed
        long = "x" * 600
        await h.request("POST", f"/v1/apps/demo/square?{long}=1", {"args": [1]})
        errors = h.gw.errors_for("alice", True)  # (the admin's view: the 405s are nobody's)
        assert errors[0]["status"] == 400 and len(errors[0]["message"]) == 500
        assert errors[1]["path"] == "/v1/status" and errors[1]["status"] == 405
        for _ in range(gateway_app.RECENT_ERRORS + 1):
            await h.request("GET", "/nope")
        assert len(h.gw.errors_for("alice", True)) == 50 == gateway_app.RECENT_ERRORS

    run(go())


def test_a_call_spawned_elsewhere_is_attached_named_and_kept() -> None:
    async def go() -> None:
        h = Http()
        await h.request("GET", "/v1/apps")  # connects
        conn = h.conns["tok"]
        conn.replies[p.StatusRequest] = {"devices": [{"running": [
            {"id": "other", "function": "x.y"}, {"id": "c1", "function": "demo.count"}]}]}
        status, _, body = await h.request("GET", "/v1/calls/c1")
        view = json.loads(body)
        assert status == 200 and (view["state"], view["function"]) == ("running", "demo.count")
        conn.replies[p.StatusRequest] = {"devices": [{"running": []}]}
        view = json.loads((await h.request("GET", "/v1/calls/c1"))[2])
        assert (view["state"], view["function"]) == ("queued", "demo.count")  # its name kept
        assert list(conn.attached) == ["c1"]  # type: ignore[attr-defined]
        conn.attached["c1"].set_exception(  # type: ignore[attr-defined]
            __import__("gpufn.exceptions", fromlist=["ConnectionLost"]).ConnectionLost("gone"))
        await h.request("GET", "/v1/calls/c1")  # lost before its answer: attached again
        assert len(conn.attached) == 1 and not conn.attached["c1"].done()  # type: ignore[attr-defined]
        conn.attached["c1"].set_result(p.Result(  # type: ignore[attr-defined]
            "c1", False, "GpufnError", f"{calls.UNKNOWN_CALL} c1"))
        status, _, body = await h.request("GET", "/v1/calls/c1")
        assert status == 404 and "no call c1 of yours is known" in json.loads(body)["error"][
            "message"]

    run(go())


def test_a_status_lists_fresh_apps_and_leaves_devices_without_errors_alone() -> None:
    async def go() -> None:
        h = Http()
        await h.request("GET", "/v1/apps")
        conn = h.conns["tok"]
        conn.replies[p.AppCommand] = {"apps": [{**APPS[0], "name": "newer"}]}
        conn.replies[p.StatusRequest] = {"devices": [{"key": "n:0"}, "odd"]}
        st = json.loads((await h.request("GET", "/v1/status"))[2])
        assert st["apps"][0]["name"] == "newer" and st["status"]["devices"][0] == {"key": "n:0"}
        conn.replies[p.AppCommand] = {"apps": [{**APPS[0], "name": "newest"}]}
        listed = json.loads((await h.request("GET", "/v1/apps"))[2])["apps"][0]
        assert listed["name"] == "newest" and listed["broken"] is False
        fn = listed["functions"][0]
        assert (fn["calls_1h"], fn["queued"], fn["running"]) == (0, 0, 0)

    run(go())


def test_a_cancel_asks_for_any_dispatch_and_a_lost_scheduler_is_an_error() -> None:
    async def go() -> None:
        h = Http()
        status, _, body = await h.request("POST", "/v1/apps/demo/square/spawn", {"args": [5]})
        inv = json.loads(body)["call_id"]
        conn = h.conns["tok"]
        conn.replies[p.Cancel] = {"cancelled": True}
        conn.replies[p.StatusRequest] = {"devices": []}
        await h.request("DELETE", f"/v1/calls/{inv}")
        cancel = next(m for m in conn.requests if isinstance(m, p.Cancel))
        assert cancel.dispatch_token == 0

        def lost(call_id: str, name: str = "call") -> Any:
            raise __import__("gpufn.exceptions", fromlist=["ConnectionLost"]).ConnectionLost(
                "the scheduler went away")

        conn.attach = lost  # type: ignore[attr-defined]
        status, _, body = await h.request("GET", "/v1/calls/unseen")
        assert status >= 500 and "went away" in json.loads(body)["error"]["message"]

    run(go())


def test_a_stream_that_breaks_its_order_ends_with_an_error_event() -> None:
    async def go() -> None:
        h = Http()
        task, sent, _ = h.start("POST", "/v1/apps/demo/count", {"args": [2]},
                                headers={"accept": "text/event-stream"})
        await settle(20)
        conn = h.conns["tok"]
        (inv, _), = conn.submitted.items()
        conn.streams[inv].put(_item(inv, 5, "late"))
        await asyncio.wait_for(task, 5)
        assert "event: error" in answer(sent)[2].decode()

    run(go())
