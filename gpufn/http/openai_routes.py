"""OpenAI-compatible routes for the functions declared `@gpufn.chat_model(NAME)`:
`GET /v1/models` and `POST /v1/chat/completions`, streamed (`stream: true`, the OpenAI
chunk format, `data: [DONE]` at the end) or not.

The chat function is called with `messages` and the request's `max_tokens`, `temperature`,
`top_p`, `stop` and `seed` as keyword arguments (only those sent). It yields text pieces,
or dicts with `text`, `usage` (`prompt_tokens`, `completion_tokens`) and `finish_reason`.
"""

from __future__ import annotations

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
from gpufn.http.directory import Directory
from gpufn.http.errors import HTTPError, bad_request
from gpufn.http.events import EventStream
from gpufn.http.pool import Entry
from gpufn.wire import jsonwire
from gpufn.wire import protocol as p


class Gateway(Protocol):
    """What these routes need of the gateway (gpufn/http/app.py)."""

    async def entry(self, request: Request) -> Entry: ...

    async def body(self, request: Request) -> Any: ...

    def done_reading(self, request: Request) -> None: ...

JSON = "application/json"


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise bad_request(f"{name} must be a number from {low:g} to {high:g}, got {v!r}",
                          "invalid_request_error")
    return float(v)


def chat_params(body: dict[str, Any]) -> dict[str, Any]:
    """The chat function's keyword arguments from a chat completion request."""
    messages = body.get("messages")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise bad_request('messages must be a non-empty list of {"role": ..., "content": ...}',
                          "invalid_request_error")
    if body.get("n") not in (None, 1):
        raise bad_request("n must be 1: one choice per request", "invalid_request_error")
    out: dict[str, Any] = {"messages": messages}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad_request(f"max_tokens must be a positive integer, got {max_tokens!r}",
                              "invalid_request_error")
        out["max_tokens"] = max_tokens
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        v = _number(body, name, low, high)
        if v is not None:
            out[name] = v
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
            raise bad_request("stop must be a string or a list of at most 4 strings",
                              "invalid_request_error")
        out["stop"] = stops
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad_request(f"seed must be an integer, got {seed!r}", "invalid_request_error")
        out["seed"] = seed
    return out


@dataclass
class Completion:
    """What a chat function produced so far: text, usage, finish reason."""

    text: list[str] = field(default_factory=list)
    usage: dict[str, int] | None = None
    finish: str = "stop"

    def add(self, raw: bytes) -> str:
        """Take one yielded value (JSON text); the text piece it adds."""
        v = json.loads(raw)
        if isinstance(v, str):
            piece = v
        elif isinstance(v, dict):
            piece = v.get("text") or ""
            if not isinstance(piece, str):
                raise HTTPError(500, "BadChatItem", "a chat model's 'text' must be a string")
            usage = v.get("usage")
            if isinstance(usage, dict):
                prompt = int(usage.get("prompt_tokens", 0))
                completion = int(usage.get("completion_tokens", 0))
                self.usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
            if v.get("finish_reason") in ("stop", "length"):
                self.finish = str(v["finish_reason"])
        else:
            raise HTTPError(500, "BadChatItem", "a chat model yields text pieces (str) or "
                            f"dicts with text/usage/finish_reason, not {type(v).__name__}")
        if piece:
            self.text.append(piece)
        return piece


class ChatRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def models(self, request: Request) -> Response:
        entry = await self.gw.entry(request)
        models = await Directory(entry).chat_models()
        data = [{"id": mid, "object": "model", "created": int(a.get("created") or 0),
                 "owned_by": a["name"], "gpufn": {"app": a["name"], "function": fn["name"],
                                                  "version": a["version"]}}
                for mid, (a, fn) in sorted(models.items())]
        return Response(json.dumps({"object": "list", "data": data}), media_type=JSON)

    async def completions(self, request: Request) -> Response:
        entry = await self.gw.entry(request)
        body = await self.gw.body(request)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object", "invalid_request_error")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("model must name a chat model (GET /v1/models lists them)",
                              "invalid_request_error")
        kwargs = chat_params(body)
        target = await Directory(entry).chat_target(model)
        target.check([], kwargs)
        sub = calls.submit(entry, target, [], kwargs, {})
        self.gw.done_reading(request)  # only the encoded payload is kept from here
        head = {"id": f"chatcmpl-{sub.invocation_id}", "created": int(time.time()), "model": model}
        name = f"{target.app}.{target.name}"
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            return EventStream(_chunks(entry, sub, name, head, usage))
        entry.hold()
        try:
            done = await calls.until_gone(_complete(entry, sub, name), request.receive)
        except calls.ClientGone:
            return Response(status_code=499)
        finally:
            entry.release()
        out = {**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(done.text)},
            "logprobs": None, "finish_reason": done.finish}], "usage": done.usage}
        return Response(json.dumps(out, ensure_ascii=False), media_type=JSON)


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
    body = {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
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
                piece = done.add(raw)
                if piece:
                    yield _chunk(head, {"content": piece}, None)
        err = stream.error()
        if err is not None:
            raise err
        yield _chunk(head, {}, done.finish)
        if include_usage:
            yield b"data: " + jsonwire.dumps({**head, "object": "chat.completion.chunk",
                                              "choices": [], "usage": done.usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"
    except HTTPError as e:  # the OpenAI clients raise on a data event holding "error"
        yield b"data: " + e.body() + b"\n\n"
    finally:
        entry.release()


def routes(gw: Gateway) -> list[Route]:
    chat = ChatRoutes(gw)
    return [Route("/v1/models", chat.models, methods=["GET"]),
            Route("/v1/chat/completions", chat.completions, methods=["POST"])]
