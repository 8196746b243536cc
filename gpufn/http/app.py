"""The gateway's routes: deployed functions over HTTP (JSON calls, SSE streams, spawned calls),
the apps they belong to, the status the dashboard reads, and the OpenAI-compatible chat
routes (gpufn/http/openai_routes.py). Errors are `{"error": {"type", "message"}}` (on the
OpenAI routes, OpenAI's `{"error": {"message", "type", "param", "code"}}`), never with a
traceback; every answer carries an `x-request-id`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gpufn.exceptions import GpufnError, NotJSONSerializable
from gpufn.http import bodies, calls, dashboard, openai_routes
from gpufn.http.calls import ClientGone, SpawnBook, Spawned
from gpufn.http.directory import Directory, Target, openai_roles
from gpufn.http.errors import (
    HTTPError,
    RequestIds,
    bad_request,
    error_body,
    from_gpufn,
    public,
    request_id,
)
from gpufn.http.events import EventStream, event
from gpufn.http.metrics import RequestMetrics, recorder
from gpufn.http.pool import ClientPool, Entry, ask
from gpufn.wire import config
from gpufn.wire import protocol as p
from gpufn.wire.spec import INT_BOUNDS

log = logging.getLogger("gpufn.http")

JSON = "application/json"
CALL_OPTIONS = ("priority", "timeout", "version")
RECENT_ERRORS = 50
MAX_VERSION = 2**31 - 1
MAX_TIMEOUT_S = 10**9


class Gateway:
    """The gateway's state: the connection pool, spawned calls, recent errors."""

    def __init__(self, address: str, idle_s: float | None = None) -> None:
        self.pool = ClientPool(address, config.http_client_idle() if idle_s is None else idle_s)
        self.spawned = SpawnBook()
        # Recent errors, each with whose request it was (None: before its token was known);
        # a user sees their own, the admin all.
        self.errors: deque[tuple[str | None, dict[str, Any]]] = deque(maxlen=RECENT_ERRORS)
        self.max_body = config.max_payload()
        self.budget = bodies.BodyBudget(config.http_body_budget())
        self.read_timeout = config.http_read_timeout()

    # ------------------------------------------------------------------ request pieces

    async def entry(self, request: Request) -> Entry:
        """The caller's scheduler connection, by its Bearer token; 401 without one."""
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise HTTPError(401, "AuthenticationError", "send the cluster's token as "
                            "'Authorization: Bearer TOKEN' (`gpufn serve` keeps it in "
                            "~/.gpufn/cluster.json)")
        entry = await self.pool.entry(token)
        request.state.owner = entry.owner  # whose errors this request's are
        return entry

    async def body(self, request: Request) -> Any:
        """The request's JSON body, read within the size limit, the body budget and the
        read timeout (gpufn/http/bodies.py); its bytes stay counted in the budget until
        `done_reading` (the call's payload is encoded) or the request ends."""
        lease = request.state.lease = self.budget.lease()
        raw = await bodies.read(request, self.max_body, lease, self.read_timeout)
        return bodies.parse(raw)

    def done_reading(self, request: Request) -> None:
        lease = getattr(request.state, "lease", None)
        if lease is not None:
            lease.release()

    def record_error(self, request: Request, err: HTTPError) -> None:
        if err.status in (401, 404) and request.url.path == "/v1/status":
            return  # a dashboard before its login: not worth listing
        owner = getattr(request.state, "owner", None)
        self.errors.append((owner, {"time": time.time(), "method": request.method,
                                    "path": request.url.path, "status": err.status,
                                    "type": err.type, "message": err.message[:500]}))

    def errors_for(self, owner: str, admin: bool) -> list[dict[str, Any]]:
        """The recent errors `owner` may see, newest first: their own; the admin's, all."""
        return [e for who, e in reversed(self.errors) if admin or who == owner]

    async def prepare(self, request: Request, keep: bool = False) -> tuple[Entry, Target, p.Submit]:
        """A call's target and its Submit (the JSON payload encoded), from the route, the
        query and the body; the parsed body is not kept (only the encoded payload is)."""
        entry = await self.entry(request)
        options, version = call_options(request)
        args, kwargs = call_arguments(await self.body(request))
        target = await Directory(entry).target(request.path_params["app"],
                                               request.path_params["function"], version)
        target.check(args, kwargs)
        try:
            sub = calls.submit(entry, target, args, kwargs, options, keep)
        except NotJSONSerializable as e:  # arguments that came as JSON: too deep to write
            raise bad_request(str(e), "BadArguments") from None
        finally:
            self.done_reading(request)
        return entry, target, sub

    # ------------------------------------------------------------------ routes

    async def call(self, request: Request) -> Response:
        entry, target, sub = await self.prepare(request)
        name = f"{target.app}.{target.name}"
        headers = {"X-Gpufn-Call-Id": sub.invocation_id}
        if "text/event-stream" in request.headers.get("accept", ""):
            events = _stream_events if target.generator else _one_event
            return EventStream(events(entry, sub, name), headers=headers)
        entry.hold()
        try:
            if target.generator:  # no SSE asked for: every value, as one list
                body = await calls.until_gone(_collect(entry, sub, name), request.receive)
            else:
                body = calls.answer(await calls.call(entry, sub, name, request.receive))
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; no one reads it
        finally:
            entry.release()
        return Response(body, media_type=JSON, headers=headers)

    async def spawn(self, request: Request) -> Response:
        # keep: the scheduler keeps its Result, and the call outlives this connection (a
        # spawned call of a deployed function, as Python's spawn), noted on disk by a
        # durable head: found again after the gateway or the head restarts.
        entry, target, sub = await self.prepare(request, keep=True)
        if target.generator:
            raise bad_request(f"{target.app}.{target.name} is a generator function: stream it "
                              "with POST /v1/apps/APP/FUNCTION and 'Accept: text/event-stream'")
        name = f"{target.app}.{target.name}"
        fut = entry.client.submit(sub, name)
        self.spawned.add(Spawned(sub.invocation_id, entry.owner, name, fut, entry),
                         asyncio.get_running_loop())
        body = {"call_id": sub.invocation_id, "url": f"/v1/calls/{sub.invocation_id}"}
        return Response(json.dumps(body), status_code=202, media_type=JSON)

    async def spawned_call(self, request: Request) -> tuple[Spawned, dict[str, Any] | None]:
        """The caller's spawned call (and, while it is out, the scheduler's status): from
        this gateway's book, or else attached at the scheduler (`FunctionCall.from_id`'s
        way: a call spawned before this gateway or its head restarted). 404 if the
        scheduler knows no such call of this caller, 403 if this gateway spawned it for
        another caller."""
        entry = await self.entry(request)
        call_id = request.path_params["call_id"]
        s = self.spawned.find(call_id, entry.owner)
        if s is not None and s.lost():  # its connection closed before the answer: ask again
            self.spawned.forget(call_id)
            s = None
        fresh = s is None
        if s is None:
            s = Spawned(call_id, entry.owner, "", entry.client.attach(call_id), entry)
        st = None
        if not s.future.done():
            # Answered after the attach (one socket, in order): a call the scheduler knows
            # only by its kept Result, or not at all, is answered by then.
            with contextlib.suppress(GpufnError):
                st = await ask(entry.client, lambda rid: p.StatusRequest(rid), timeout=5)
        if s.unknown():
            self.spawned.forget(call_id)
            raise HTTPError(404, "NotFound", f"no call {call_id} of yours is known: it was never "
                            "spawned, or it ended and its result is no longer kept (a day, "
                            "GPUFN_RESULT_RETENTION), or another user made it")
        if fresh:  # kept from now on, as if spawned here
            self.spawned.add(s, asyncio.get_running_loop())
        return s, st

    async def get_call(self, request: Request) -> Response:
        s, st = await self.spawned_call(request)
        running = None
        if st is not None and not s.future.done():
            rows = [r for d in st.get("devices", []) for r in d.get("running", [])
                    if r.get("id") == s.call_id]
            running = bool(rows)
            if rows and not s.name:
                s.name = str(rows[0].get("function") or "")
        status, body = s.view(running)
        return Response(body, status_code=status, media_type=JSON)

    async def cancel_call(self, request: Request) -> Response:
        s, _ = await self.spawned_call(request)
        cancelled = False
        if not s.future.done():
            call_id = s.call_id
            try:
                data = await ask(s.entry.client, lambda rid: p.Cancel(
                    call_id, "cancelled over HTTP", True, 0, rid), timeout=10)
            except GpufnError as e:
                raise from_gpufn(e) from None
            cancelled = bool(data.get("cancelled"))
        return Response(json.dumps({"call_id": s.call_id, "cancelled": cancelled}),
                        media_type=JSON)

    async def apps(self, request: Request) -> Response:
        entry = await self.entry(request)
        listed = await Directory(entry).apps(fresh=True)
        return Response(json.dumps({"apps": [app_view(a) for a in listed]}), media_type=JSON)

    async def status(self, request: Request) -> Response:
        """What `gpufn status --json` shows, the apps, and the gateway's recent errors."""
        entry = await self.entry(request)
        try:
            st = await ask(entry.client, lambda rid: p.StatusRequest(rid), timeout=10)
        except GpufnError as e:
            raise from_gpufn(e) from None
        listed = await Directory(entry).apps(fresh=True)
        for d in st.get("devices", []):  # a worker's last error may quote a traceback
            if isinstance(d, dict) and d.get("last_error"):
                d["last_error"] = public(str(d["last_error"]))
        you = st.get("you") or {}
        errors = self.errors_for(entry.owner, bool(you.get("admin", entry.admin)))
        body = {"status": st, "apps": [app_view(a) for a in listed],
                "gateway": {"errors": errors, "connections": len(self.pool),
                            "time": time.time()}}
        return Response(json.dumps(body, default=str), media_type=JSON)

    async def health(self, request: Request) -> Response:
        return Response(b'{"ok":true}', media_type=JSON)

    async def page(self, request: Request) -> Response:
        return HTMLResponse(dashboard.page(), headers=dashboard.HEADERS)

    async def favicon(self, request: Request) -> Response:
        return Response(status_code=204)  # browsers ask; not an error worth listing


# --------------------------------------------------------------------------- helpers


def call_arguments(body: Any) -> tuple[list[Any], dict[str, Any]]:
    """(args, kwargs) of a call's body `{"args": [...], "kwargs": {...}}`; 400 otherwise."""
    if not isinstance(body, dict):
        raise bad_request('the body must be a JSON object {"args": [...], "kwargs": {...}}')
    extra = set(body) - {"args", "kwargs"}
    if extra:
        raise bad_request(f'unknown field(s) {sorted(extra)} in the body; it holds "args" '
                          '(a list) and "kwargs" (an object)')
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if not isinstance(args, list):
        raise bad_request(f'"args" must be a list, got {type(args).__name__}')
    if not isinstance(kwargs, dict):
        raise bad_request(f'"kwargs" must be an object, got {type(kwargs).__name__}')
    return args, kwargs


def call_options(request: Request) -> tuple[dict[str, Any], int | None]:
    """The call options from the query (`priority`, `timeout`) and the pinned `version`;
    400 naming the parameter and its accepted form."""
    q = request.query_params
    unknown = set(q) - set(CALL_OPTIONS)
    if unknown:
        raise bad_request(f"unknown query parameter(s) {sorted(unknown)}; known: "
                          f"{', '.join(CALL_OPTIONS)}")
    for name in CALL_OPTIONS:
        if len(q.getlist(name)) > 1:
            raise bad_request(f"query parameter {name} is given {len(q.getlist(name))} times; "
                              "give it once", "InvalidSpec")
    options: dict[str, Any] = {}
    version = None
    if "priority" in q:
        low, high = INT_BOUNDS["priority"]
        options["priority"] = _query_int(q["priority"], "priority", low, high,
                                         "an integer, higher runs first (e.g. ?priority=5)")
    if "timeout" in q:
        options["timeout"] = _query_seconds(q["timeout"], "timeout")
    if "version" in q:
        version = _query_int(q["version"], "version", 1, MAX_VERSION,
                             "a deployed version number from 1 (e.g. ?version=2)")
    return options, version


def _query_int(raw: str, name: str, low: int, high: int, form: str) -> int:
    try:
        value = int(raw.strip()) if raw.strip().lstrip("+-").isdigit() else None
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise bad_request(f"query parameter {name}={raw!r} is not valid: {name} is {form}, "
                          f"from {low:,} to {high:,}", "InvalidSpec")
    return value


def _query_seconds(raw: str, name: str) -> float:
    try:
        value: float | None = float(raw)
    except ValueError:
        value = None
    if value is None or not 0 < value <= MAX_TIMEOUT_S:  # NaN and infinities fail here too
        raise bad_request(f"query parameter {name}={raw!r} is not valid: {name} is a positive "
                          "number of seconds (e.g. ?timeout=30 or ?timeout=0.5)", "InvalidSpec")
    return value


def app_view(a: dict[str, Any]) -> dict[str, Any]:
    """An app as GET /v1/apps lists it."""
    fns = []
    for f in a.get("functions", []):
        i = f.get("interface") or {}
        fns.append({"name": f["name"], "params": i.get("params"), "returns": i.get("returns", ""),
                    "doc": i.get("doc", ""), "streams": bool(i.get("generator")),
                    "chat_model": i.get("chat_model", ""),
                    "openai": openai_roles(i), "describe": f.get("describe", ""),
                    "models": f.get("models", []), "calls_1h": f.get("calls_1h", 0),
                    "queued": f.get("queued", 0), "running": f.get("running", 0),
                    "errors": [public(str(e)) for e in f.get("errors", [])], "url": f"/v1/apps/{a['name']}/{f['name']}"})
    return {"name": a["name"], "version": a["version"], "state": a.get("state", "active"),
            "tag": a.get("tag", ""), "created": a.get("created"), "who": a.get("who", ""),
            "broken": a.get("broken", False), "functions": fns}


async def _collect(entry: Entry, sub: p.Submit, name: str) -> bytes:
    stream = calls.Stream(entry, sub, name)
    values = []
    async with contextlib.aclosing(stream.values()) as it:
        async for v in it:
            values.append(v)
    err = stream.error()
    if err is not None:
        raise err
    return (b'{"result":[' + b",".join(values) + b'],"call_id":"' + sub.invocation_id.encode()
            + b'"}')


async def _stream_events(entry: Entry, sub: p.Submit, name: str) -> AsyncIterator[bytes]:
    """A generator call as events: one `data:` per value, then `event: end` (or `error`)."""
    entry.hold()
    stream = calls.Stream(entry, sub, name)
    try:
        async with contextlib.aclosing(stream.values()) as it:
            async for v in it:
                yield event(v)
        err = stream.error()
        yield err.event() if err is not None else event(json.dumps(
            {"call_id": sub.invocation_id, "items": stream.read}).encode(), "end")
    except HTTPError as e:
        yield e.event()
    finally:
        entry.release()


async def _one_event(entry: Entry, sub: p.Submit, name: str) -> AsyncIterator[bytes]:
    """A plain call asked for as events: its value as one `data:`, then `event: end`."""
    entry.hold()
    try:
        res = await calls.call(entry, sub, name, None)
        yield event(calls.value(res))  # raises the call's error
        yield event(json.dumps({"call_id": sub.invocation_id, "items": 1}).encode(), "end")
    except HTTPError as e:
        yield e.event()
    except GpufnError as e:
        yield from_gpufn(e).event()
    except asyncio.CancelledError:
        entry.client.cancel(sub.invocation_id, "the HTTP client closed the stream")
        raise
    finally:
        entry.release()


# --------------------------------------------------------------------------- the app


def create_app(address: str, idle_s: float | None = None) -> ASGIApp:
    """The gateway as an ASGI app, calling the scheduler at `address`."""
    gw = Gateway(address, idle_s)

    def json_error(request: Request, err: HTTPError) -> Response:
        gw.done_reading(request)
        gw.record_error(request, err)
        headers = dict(err.headers)
        if err.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        body = (err.openai_body() if openai_routes.is_openai(request.url.path)
                else err.body())
        return Response(body, status_code=err.status, media_type=JSON, headers=headers or None)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPError)
        return json_error(request, exc)

    async def on_starlette(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        msg = (f"no route {request.method} {request.url.path}; see GET /v1/apps for the "
               "deployed functions" if exc.status_code in (404, 405) else str(exc.detail))
        return json_error(request, HTTPError(exc.status_code, kind, msg))

    async def on_gpufn(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GpufnError)
        return json_error(request, from_gpufn(exc))

    async def on_other(request: Request, exc: Exception) -> Response:
        rid = request_id.get() or "-"
        log.exception("request %s: the gateway failed on %s %s", rid, request.method,
                      request.url.path)
        return json_error(request, HTTPError(500, "GatewayError", "the gateway failed on this "
                                             f"request ({type(exc).__name__}); its log has "
                                             f"the details under request id {rid}"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gw.pool.start()
        try:
            yield
        finally:
            await gw.pool.close()

    routes = [
        Route("/", gw.page, methods=["GET"]),
        Route("/favicon.ico", gw.favicon, methods=["GET"]),
        Route("/healthz", gw.health, methods=["GET"]),
        Route("/v1/status", gw.status, methods=["GET"]),
        Route("/v1/apps", gw.apps, methods=["GET"]),
        Route("/v1/apps/{app}/{function}", gw.call, methods=["POST"]),
        Route("/v1/apps/{app}/{function}/spawn", gw.spawn, methods=["POST"]),
        Route("/v1/calls/{call_id}", gw.get_call, methods=["GET"]),
        Route("/v1/calls/{call_id}", gw.cancel_call, methods=["DELETE"]),
        *openai_routes.routes(gw),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        HTTPError: on_http_error, HTTPException: on_starlette, GpufnError: on_gpufn,
        Exception: on_other})
    app.state.gateway = gw
    return RequestIds(RequestMetrics(bodies.ReleaseLeases(app), recorder()))


__all__ = ["Gateway", "Target", "create_app", "error_body"]
