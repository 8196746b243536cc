"""The gateway's routes: deployed functions over HTTP (JSON calls, SSE streams, spawned calls),
the apps they belong to, the status the dashboard reads, and the OpenAI-compatible chat
routes (gpufn/http/openai_routes.py). Errors are `{"error": {"type", "message"}}`."""

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

from gpufn.exceptions import GpufnError
from gpufn.http import calls, dashboard, openai_routes
from gpufn.http.calls import ClientGone, SpawnBook, Spawned
from gpufn.http.directory import Directory, Target
from gpufn.http.errors import HTTPError, bad_request, error_body, from_gpufn
from gpufn.http.events import EventStream, event
from gpufn.http.metrics import RequestMetrics, recorder
from gpufn.http.pool import ClientPool, Entry, ask
from gpufn.wire import config
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.http")

JSON = "application/json"
CALL_OPTIONS = ("priority", "timeout", "version")
RECENT_ERRORS = 50


class Gateway:
    """The gateway's state: the connection pool, spawned calls, recent errors."""

    def __init__(self, address: str, idle_s: float | None = None) -> None:
        self.pool = ClientPool(address, config.http_client_idle() if idle_s is None else idle_s)
        self.spawned = SpawnBook()
        self.errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self.max_body = config.max_payload()

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
        return await self.pool.entry(token)

    async def body(self, request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise HTTPError(413, "PayloadTooLarge", f"the body has {size} bytes; at most "
                            f"{self.max_body} are accepted (GPUFN_MAX_PAYLOAD)")
        raw = await request.body()
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except ValueError as e:
            raise bad_request(f"the body is not JSON: {e}", "BadRequest") from None

    def record_error(self, request: Request, err: HTTPError) -> None:
        if err.status in (401, 404) and request.url.path == "/v1/status":
            return  # a dashboard before its login: not worth listing
        self.errors.append({"time": time.time(), "method": request.method,
                            "path": request.url.path, "status": err.status, "type": err.type,
                            "message": err.message[:500]})

    # ------------------------------------------------------------------ routes

    async def call(self, request: Request) -> Response:
        entry = await self.entry(request)
        args, kwargs = call_arguments(await self.body(request))
        options, version = call_options(request)
        target = await Directory(entry).target(request.path_params["app"],
                                               request.path_params["function"], version)
        target.check(args, kwargs)
        sub = calls.submit(entry, target, args, kwargs, options)
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
        entry = await self.entry(request)
        args, kwargs = call_arguments(await self.body(request))
        options, version = call_options(request)
        target = await Directory(entry).target(request.path_params["app"],
                                               request.path_params["function"], version)
        if target.generator:
            raise bad_request(f"{target.app}.{target.name} is a generator function: stream it "
                              "with POST /v1/apps/APP/FUNCTION and 'Accept: text/event-stream'")
        target.check(args, kwargs)
        sub = calls.submit(entry, target, args, kwargs, options)
        name = f"{target.app}.{target.name}"
        fut = entry.client.submit(sub, name)
        self.spawned.add(Spawned(sub.invocation_id, entry.owner, name, fut, entry),
                         asyncio.get_running_loop())
        body = {"call_id": sub.invocation_id, "url": f"/v1/calls/{sub.invocation_id}"}
        return Response(json.dumps(body), status_code=202, media_type=JSON)

    async def get_call(self, request: Request) -> Response:
        entry = await self.entry(request)
        s = self.spawned.get(request.path_params["call_id"], entry.owner)
        running = None
        if not s.future.done():
            with contextlib.suppress(GpufnError):
                st = await ask(entry.client, lambda rid: p.StatusRequest(rid), timeout=5)
                running = any(r.get("id") == s.call_id for d in st.get("devices", [])
                              for r in d.get("running", []))
        status, body = s.view(running)
        return Response(body, status_code=status, media_type=JSON)

    async def cancel_call(self, request: Request) -> Response:
        entry = await self.entry(request)
        s = self.spawned.get(request.path_params["call_id"], entry.owner)
        pending = not s.future.done()
        if pending:
            s.entry.client.cancel(s.call_id, "cancelled over HTTP")
        return Response(json.dumps({"call_id": s.call_id, "cancelled": pending}), media_type=JSON)

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
        body = {"status": st, "apps": [app_view(a) for a in listed],
                "gateway": {"errors": list(self.errors)[::-1], "connections": len(self.pool),
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
    """The call options from the query (`priority`, `timeout`) and the pinned `version`."""
    q = request.query_params
    unknown = set(q) - set(CALL_OPTIONS)
    if unknown:
        raise bad_request(f"unknown query parameter(s) {sorted(unknown)}; known: "
                          f"{', '.join(CALL_OPTIONS)}")
    options: dict[str, Any] = {}
    version = None
    try:
        if "priority" in q:
            options["priority"] = int(q["priority"])
        if "timeout" in q:
            options["timeout"] = float(q["timeout"])
            if not options["timeout"] > 0:
                raise ValueError("timeout must be a positive number of seconds")
        if "version" in q:
            version = int(q["version"])
            if version < 1:
                raise ValueError("version must be 1 or more")
    except ValueError as e:
        raise bad_request(f"bad query parameter: {e} (priority is an integer, timeout "
                          "seconds, version a number from 1)", "InvalidSpec") from None
    return options, version


def app_view(a: dict[str, Any]) -> dict[str, Any]:
    """An app as GET /v1/apps lists it."""
    fns = []
    for f in a.get("functions", []):
        i = f.get("interface") or {}
        fns.append({"name": f["name"], "params": i.get("params"), "returns": i.get("returns", ""),
                    "doc": i.get("doc", ""), "streams": bool(i.get("generator")),
                    "chat_model": i.get("chat_model", ""), "describe": f.get("describe", ""),
                    "models": f.get("models", []), "calls_1h": f.get("calls_1h", 0),
                    "queued": f.get("queued", 0), "running": f.get("running", 0),
                    "errors": f.get("errors", []), "url": f"/v1/apps/{a['name']}/{f['name']}"})
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
        gw.record_error(request, err)
        return Response(err.body(), status_code=err.status, media_type=JSON,
                        headers={"WWW-Authenticate": "Bearer"} if err.status == 401 else None)

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
        log.exception("the gateway failed on %s %s", request.method, request.url.path)
        return json_error(request, HTTPError(500, type(exc).__name__, f"the gateway failed: {exc}"))

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
    return RequestMetrics(app, recorder())


__all__ = ["Gateway", "Target", "create_app", "error_body"]
