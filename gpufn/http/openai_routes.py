"""OpenAI-compatible routes for the functions declared `@gpufn.chat_model(NAME)`,
`@gpufn.completion_model(NAME)` and `@gpufn.embedding_model(NAME)`: `GET /v1/models`,
`GET /v1/models/{id}`, `POST /v1/chat/completions`, `POST /v1/completions` (their streams
in OpenAI's chunk format, `data: [DONE]` at the end) and `POST /v1/embeddings`.

A model function receives its data (`messages`, `prompt`, `input`) and the request
parameters it declares (gpufn/http/openai_params.py: a parameter it does not declare is a
400 naming it). A chat function yields text pieces, or dicts with `text`, `usage`
(`prompt_tokens`, `completion_tokens`), `finish_reason`, `tool_calls` (OpenAI's list; the
finish reason is then `tool_calls`) and `logprobs` (OpenAI's chat `content` entries for
the piece's tokens). Completions: gpufn/http/openai_completions.py; embeddings:
gpufn/http/openai_embeddings.py. Errors are in OpenAI's shape (gpufn/http/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gpufn.http import calls
from gpufn.http import openai_completions as oc
from gpufn.http import openai_embeddings as oe
from gpufn.http.directory import Directory, Target
from gpufn.http.errors import HTTPError, from_result
from gpufn.http.events import EventStream
from gpufn.http.openai_params import DATA, bad, declared, function_kwargs
from gpufn.http.pool import Entry
from gpufn.wire import jsonwire
from gpufn.wire import protocol as p

OPENAI_PATHS = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def is_openai(path: str) -> bool:
    """Whether `path` is an OpenAI route (its errors are in OpenAI's shape)."""
    return path.rstrip("/") in OPENAI_PATHS or path.startswith("/v1/models/")


class Gateway(Protocol):
    """What these routes need of the gateway (gpufn/http/app.py)."""

    async def entry(self, request: Request) -> Entry: ...

    async def body(self, request: Request) -> Any: ...

    def done_reading(self, request: Request) -> None: ...

JSON = "application/json"


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat's messages as the model function gets them: each content a string (a list
    of OpenAI's text parts joined; an assistant's may be null when it calls tools)."""
    messages = body.get("messages")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) for m in messages)):
        raise bad("messages", 'messages must be a non-empty list of {"role": ..., "content": ...}')
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: dict[str, Any]) -> dict[str, Any]:
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of "
                  f"{', '.join(ROLES)}, got {role!r}")
    if isinstance(content, list):  # OpenAI's content parts: only text ones here
        if not all(isinstance(part, dict) and part.get("type") == "text"
                   and isinstance(part.get("text"), str) for part in content):
            kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__
                     for part in content]
            raise bad(f"messages[{i}].content", f"messages[{i}].content: only text parts "
                      '({"type": "text", "text": "..."}) are taken, got ' + repr(kinds))
        return {**m, "content": "".join(part["text"] for part in content)}
    if content is None and role == "assistant":
        return m
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a "
                  f"list of text parts, got {type(content).__name__}")
    return m


def _streamed(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be true or false, got {stream!r}")
    return stream


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "stream_options must be an object")
    return bool((opts or {}).get("include_usage"))


@dataclass
class Completion:
    """What a chat function produced so far: text, tool calls, logprobs, usage, finish."""

    text: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    usage: dict[str, int] | None = None
    finish: str = "stop"

    def add(self, raw: bytes) -> dict[str, Any]:
        """Take one yielded value (JSON text); the delta it adds (empty: nothing)."""
        v = json.loads(raw)
        if isinstance(v, str):
            v = {"text": v}
        if not isinstance(v, dict):
            raise HTTPError(500, "BadChatItem", "a chat model yields text pieces (str) or "
                            f"dicts with text/usage/finish_reason, not {type(v).__name__}")
        piece = v.get("text") or ""
        if not isinstance(piece, str):
            raise HTTPError(500, "BadChatItem", "a chat model's 'text' must be a string")
        usage = v.get("usage")
        if isinstance(usage, dict):
            prompt = int(usage.get("prompt_tokens", 0))
            completion = int(usage.get("completion_tokens", 0))
            self.usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}
        if v.get("finish_reason") in ("stop", "length", "tool_calls", "content_filter"):
            self.finish = str(v["finish_reason"])
        delta: dict[str, Any] = {}
        if piece:
            self.text.append(piece)
            delta["content"] = piece
        tools = v.get("tool_calls")
        if isinstance(tools, list) and tools:
            first = len(self.tool_calls)
            self.tool_calls += tools
            self.finish = "tool_calls"
            delta["tool_calls"] = [{"index": first + i, **t} for i, t in enumerate(tools)]
        lps = v.get("logprobs")
        if isinstance(lps, list):
            self.logprobs = (self.logprobs or []) + lps
            delta["logprobs"] = lps
        return delta

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
            msg["content"] = msg["content"] or None
        return msg


class OpenAIRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def _model_view(self, mid: str, roles: dict[str, tuple[dict[str, Any], dict[str, Any]]]
                    ) -> dict[str, Any]:
        a = next(iter(roles.values()))[0]
        return {"id": mid, "object": "model", "created": int(a.get("created") or 0),
                "owned_by": a["name"], "gpufn": {
                    "app": a["name"], "version": a["version"],
                    "roles": {role: fn["name"] for role, (_, fn) in sorted(roles.items())},
                    "params": {role: sorted(declared(fn.get("interface") or {}, role))
                               for role, (_, fn) in sorted(roles.items())}}}

    async def models(self, request: Request) -> Response:
        entry = await self.gw.entry(request)
        models = await Directory(entry).openai_models()
        data = [self._model_view(mid, roles) for mid, roles in sorted(models.items())]
        return Response(json.dumps({"object": "list", "data": data}), media_type=JSON)

    async def model(self, request: Request) -> Response:
        entry = await self.gw.entry(request)
        mid = request.path_params["model"]
        models = await Directory(entry).openai_models()
        if mid not in models:
            raise HTTPError(404, "NotFound", f"no model {mid!r} is deployed; models: "
                            f"{', '.join(sorted(models)) or 'none'}", param="model",
                            code="model_not_found")
        return Response(json.dumps(self._model_view(mid, models[mid])), media_type=JSON)

    async def _prepare(self, request: Request, role: str, data: Any
                       ) -> tuple[Entry, dict[str, Any], str, Target, dict[str, Any]]:
        """The caller's entry, the body, the model id, its function and the declared
        keyword arguments (400 for any parameter it does not declare)."""
        entry = await self.gw.entry(request)
        body = await self.gw.body(request)
        if not isinstance(body, dict):
            raise bad("", "the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model", f"model must name a {role} model (GET /v1/models lists them)")
        data(body)  # the data parameter's form first: a bad prompt is named as such
        _streamed(body)
        target = await Directory(entry).openai_target(model, role)
        accepts = declared(target.interface, role)
        kwargs = function_kwargs(body, role, accepts, model)
        if role == "embedding":  # every declared one, null where not sent: batched calls
            kwargs = {name: kwargs.get(name) for name in sorted(accepts)}  # carry the same
        target.check([], {DATA[role]: None, **kwargs})
        return entry, body, model, target, kwargs

    async def chat(self, request: Request) -> Response:
        entry, body, model, target, kwargs = await self._prepare(request, "chat", messages_of)
        if kwargs.get("n", 1) != 1:
            raise bad("n", "n must be 1: one choice per chat request")
        usage = _include_usage(body)  # refused before a call is made
        sub = calls.submit(entry, target, [], {"messages": messages_of(body), **kwargs}, {})
        self.gw.done_reading(request)  # only the encoded payload is kept from here
        head = {"id": f"chatcmpl-{sub.invocation_id}", "created": int(time.time()), "model": model}
        name = f"{target.app}.{target.name}"
        if _streamed(body):
            return EventStream(_chunks(entry, sub, name, head, usage))
        entry.hold()
        try:
            done = await calls.until_gone(_complete(entry, sub, name), request.receive)
        except calls.ClientGone:
            return Response(status_code=499)
        finally:
            entry.release()
        lps = {"content": done.logprobs} if done.logprobs is not None else None
        out = {**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": done.message(), "logprobs": lps,
            "finish_reason": done.finish}], "usage": done.usage}
        return Response(json.dumps(out, ensure_ascii=False), media_type=JSON)

    async def completions(self, request: Request) -> Response:
        entry, body, model, target, kwargs = await self._prepare(request, "completion",
                                                                 oc.prompts)
        prompts = oc.prompts(body)
        n = int(kwargs.get("n", 1))
        usage = _include_usage(body)  # refused before a call is made
        runs = []
        for i, prompt in enumerate(prompts):
            sub = calls.submit(entry, target, [], {"prompt": prompt, **kwargs}, {})
            runs.append((sub, oc.PromptCalls(i * n, n)))
        self.gw.done_reading(request)
        head = {"id": f"cmpl-{runs[0][0].invocation_id}", "created": int(time.time()),
                "model": model}
        name = f"{target.app}.{target.name}"
        logprobs = kwargs.get("logprobs") is not None
        if _streamed(body):
            return EventStream(oc.stream_chunks(entry, runs, name, head, logprobs, usage))
        entry.hold()
        try:
            parts = await calls.until_gone(_gather(
                [oc.run_one(entry, sub, name, part) for sub, part in runs]), request.receive)
        except calls.ClientGone:
            return Response(status_code=499)
        finally:
            entry.release()
        out = oc.body_of(head, parts, logprobs)
        return Response(json.dumps(out, ensure_ascii=False), media_type=JSON)

    async def embeddings(self, request: Request) -> Response:
        entry, body, model, target, kwargs = await self._prepare(request, "embedding",
                                                                 oe.inputs)
        items, fmt = oe.inputs(body), oe.encoding(body)
        subs = [calls.submit(entry, target, [], {"input": x, **kwargs}, {}) for x in items]
        self.gw.done_reading(request)
        name = f"{target.app}.{target.name}"
        entry.hold()
        try:
            results = await calls.until_gone(_results(entry, subs, name), request.receive)
        except calls.ClientGone:
            return Response(status_code=499)
        finally:
            entry.release()
        data, tokens = [], 0
        for i, res in enumerate(results):
            emb, n = oe.item(calls.value(res), i, fmt, kwargs.get("dimensions"))
            data.append(emb)
            tokens += n
        out = {"object": "list", "data": data, "model": model,
               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return Response(json.dumps(out), media_type=JSON)


async def _gather(work: list[Any]) -> list[Any]:
    """Every call's answer, in order; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def _results(entry: Entry, subs: list[p.Submit], name: str) -> list[p.Result]:
    """Every call's Result, in order. The first that failed ends the wait with its error,
    and the calls not answered yet are cancelled on their workers, as all of them are when
    this is cancelled (its HTTP client left: `calls.until_gone`)."""
    futs = [asyncio.wrap_future(entry.client.submit(sub, name)) for sub in subs]
    reason = "the HTTP client disconnected"
    try:
        pending: set[asyncio.Future[p.Result]] = set(futs)
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = next((f.result() for f in futs if f.done() and not f.result().ok), None)
            if failed is not None:
                reason = f"another input of its request failed ({failed.invocation_id})"
                raise from_result(failed)
        return [f.result() for f in futs]
    finally:
        for sub, fut in zip(subs, futs, strict=True):
            if not fut.done():  # (the client's own future is left alone: it ends as cancelled)
                entry.client.cancel(sub.invocation_id, reason)


async def _complete(entry: Entry, sub: p.Submit, name: str) -> Completion:
    done = Completion()
    stream = calls.Stream(entry, sub, name)
    async with contextlib.aclosing(stream.values()) as values:
        async for raw in values:
            done.add(raw)
    err = stream.error()
    if err is not None:
        raise err
    return done


def _chunk(head: dict[str, Any], delta: dict[str, Any], finish: str | None) -> bytes:
    lps = {"content": delta.pop("logprobs")} if "logprobs" in delta else None
    body = {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}]}
    return b"data: " + jsonwire.dumps(body) + b"\n\n"


async def _chunks(entry: Entry, sub: p.Submit, name: str, head: dict[str, Any],
                  include_usage: bool) -> AsyncIterator[bytes]:
    entry.hold()
    done = Completion()
    stream = calls.Stream(entry, sub, name)
    try:
        yield _chunk(head, {"role": "assistant", "content": ""}, None)
        async with contextlib.aclosing(stream.values()) as values:
            async for raw in values:
                delta = done.add(raw)
                if delta:
                    yield _chunk(head, delta, None)
        err = stream.error()
        if err is not None:
            raise err
        yield _chunk(head, {}, done.finish)
        if include_usage:
            yield b"data: " + jsonwire.dumps({**head, "object": "chat.completion.chunk",
                                              "choices": [], "usage": done.usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"
    except HTTPError as e:  # the OpenAI clients raise on a data event holding "error"
        yield b"data: " + e.openai_body() + b"\n\n"
    finally:
        entry.release()


def routes(gw: Gateway) -> list[Route]:
    r = OpenAIRoutes(gw)
    return [Route("/v1/models", r.models, methods=["GET"]),
            Route("/v1/models/{model:path}", r.model, methods=["GET"]),
            Route("/v1/chat/completions", r.chat, methods=["POST"]),
            Route("/v1/completions", r.completions, methods=["POST"]),
            Route("/v1/embeddings", r.embeddings, methods=["POST"])]
