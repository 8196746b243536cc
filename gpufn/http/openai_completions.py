"""`POST /v1/completions` over the functions declared `@gpufn.completion_model(NAME)`.

Each prompt of a request (a string, a list of strings, a list of token ids or a list of
such lists) is one call of the model function, `prompt=` that one prompt plus the declared
parameters the request sets (gpufn/http/openai_params.py); the calls run together (so a
batching function or engine steps them at once) and their answers are the request's
choices, prompt by prompt (`n` choices each where the function declares `n`).

The function yields text pieces (str), or dicts with any of: `text` (the piece), `tokens`
(its tokens' text), `token_logprobs` (one per token; null for the first token of an echoed
prompt), `top_logprobs` (one `{token: logprob}` per token, or null), `text_offset` (each
token's character offset in the choice's whole text; computed from the tokens' lengths
when left out), `finish_reason` (`stop`, `length`), `usage` (`prompt_tokens`,
`completion_tokens`) and `index` (which of its `n` choices the item belongs to). With
`echo`, its first pieces are the prompt itself. docs/api.md has the whole contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gpufn.exceptions import GpufnError
from gpufn.http import calls
from gpufn.http.errors import HTTPError, from_gpufn
from gpufn.http.openai_params import bad
from gpufn.http.pool import Entry
from gpufn.wire import jsonwire
from gpufn.wire import protocol as p

MAX_PROMPTS = 2048


def prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The request's prompts, one per call."""
    raw = body.get("prompt")

    def ids(x: Any) -> bool:
        return (isinstance(x, list) and bool(x)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x))

    if isinstance(raw, str):
        out: list[str | list[int]] = [str(raw)]
    elif ids(raw):
        out = [list(raw or [])]
    elif isinstance(raw, list) and raw and (all(isinstance(x, str) for x in raw)
                                            or all(ids(x) for x in raw)):
        out = list(raw)
    else:
        raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids "
                  "or a list of lists of token ids")
    if len(out) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(out)}")
    if any(x == "" for x in out):
        raise bad("prompt", "a prompt is empty: give at least one character or token")
    return out


def _fail(message: str) -> HTTPError:
    return HTTPError(500, "BadCompletionItem", "a completion model yielded "
                     f"{message} (see docs/api.md, 'OpenAI models')", code="bad_model_output")


@dataclass
class Choice:
    """One choice's text and, when asked, its logprobs, as the function yields them."""

    text: list[str] = field(default_factory=list)
    length: int = 0  # characters so far
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    finish: str | None = None

    def add(self, item: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        """Take one item; (the text it adds, its piece of logprobs or None)."""
        piece = item.get("text") or ""
        if not isinstance(piece, str):
            raise _fail("a 'text' that is not a string")
        start = self.length
        lp = None
        if item.get("tokens") is not None:
            lp = _logprobs_piece(item, start)
            self.tokens += lp["tokens"]
            self.token_logprobs += lp["token_logprobs"]
            self.top_logprobs += lp["top_logprobs"]
            self.text_offset += lp["text_offset"]
        if piece:
            self.text.append(piece)
            self.length += len(piece)
        if item.get("finish_reason") in ("stop", "length"):
            self.finish = str(item["finish_reason"])
        return piece, lp

    def logprobs(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def _logprobs_piece(item: dict[str, Any], start: int) -> dict[str, Any]:
    tokens = item.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise _fail("'tokens' that are not a list of strings")
    n = len(tokens)
    lps = item.get("token_logprobs", [None] * n)
    tops = item.get("top_logprobs") or [None] * n
    offsets = item.get("text_offset")
    if offsets is None:
        offsets, at = [], start
        for t in tokens:
            offsets.append(at)
            at += len(t)
    if not (isinstance(lps, list) and isinstance(tops, list) and isinstance(offsets, list)
            and len(lps) == len(tops) == len(offsets) == n):
        raise _fail("'tokens', 'token_logprobs', 'top_logprobs' and 'text_offset' of "
                    "different lengths")
    if not all(x is None or isinstance(x, (int, float)) for x in lps):
        raise _fail("'token_logprobs' that are not numbers")
    if not all(x is None or isinstance(x, dict) for x in tops):
        raise _fail("'top_logprobs' that are not {token: logprob} maps")
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


@dataclass
class PromptCalls:
    """One prompt's call: its choices (by their index within the prompt) and usage."""

    first: int  # the request-wide index of its choice 0
    n: int
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict[str, int] | None = None

    def add(self, raw: bytes) -> tuple[int, str, dict[str, Any] | None, Choice]:
        """One yielded value: (request-wide choice index, text, logprobs piece, choice)."""
        v = json.loads(raw)
        item = {"text": v} if isinstance(v, str) else v
        if not isinstance(item, dict):
            raise _fail(f"a {type(v).__name__}, not text or a dict")
        index = item.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.n:
            raise _fail(f"an 'index' of {index!r} for a request of n={self.n}")
        usage = item.get("usage")
        if isinstance(usage, dict):
            self.usage = {k: int(usage.get(k, 0)) for k in ("prompt_tokens", "completion_tokens")}
        choice = self.choices.setdefault(index, Choice())
        piece, lp = choice.add(item)
        return self.first + index, piece, lp, choice


def total_usage(parts: list[PromptCalls]) -> dict[str, int] | None:
    used = [x.usage for x in parts if x.usage is not None]
    if not used:
        return None
    prompt = sum(u["prompt_tokens"] for u in used)
    completion = sum(u["completion_tokens"] for u in used)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def run_one(entry: Entry, sub: p.Submit, name: str, part: PromptCalls) -> PromptCalls:
    stream = calls.Stream(entry, sub, name)
    async with contextlib.aclosing(stream.values()) as values:
        async for raw in values:
            part.add(raw)
    err = stream.error()
    if err is not None:
        raise err
    return part


def body_of(head: dict[str, Any], parts: list[PromptCalls], logprobs: bool) -> dict[str, Any]:
    """The non-streamed answer."""
    choices = []
    for part in parts:
        for i in range(part.n):
            c = part.choices.get(i, Choice())
            choices.append({"index": part.first + i, "text": "".join(c.text),
                            "logprobs": c.logprobs() if logprobs else None,
                            "finish_reason": c.finish or "stop"})
    return {**head, "object": "text_completion", "choices": choices,
            "usage": total_usage(parts)}


def _chunk(head: dict[str, Any], choices: list[dict[str, Any]], **extra: Any) -> bytes:
    body = {**head, "object": "text_completion", "choices": choices, **extra}
    return b"data: " + jsonwire.dumps(body) + b"\n\n"


async def stream_chunks(entry: Entry, runs: list[tuple[p.Submit, PromptCalls]], name: str,
                        head: dict[str, Any], logprobs: bool,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """The streamed answer: every call's items as they come, choice by choice, then each
    choice's finish, the usage (if asked) and `data: [DONE]`."""
    queue: asyncio.Queue[tuple[PromptCalls, bytes | None, HTTPError | None]] = asyncio.Queue()

    async def pump(sub: p.Submit, part: PromptCalls) -> None:
        try:
            stream = calls.Stream(entry, sub, name)
            async with contextlib.aclosing(stream.values()) as values:
                async for raw in values:
                    await queue.put((part, raw, None))
            err = stream.error()
        except HTTPError as e:
            err = e
        except GpufnError as e:  # the connection is gone: said, not waited for
            err = from_gpufn(e)
        await queue.put((part, None, err))

    entry.hold()
    tasks = [asyncio.ensure_future(pump(sub, part)) for sub, part in runs]
    try:
        left = len(tasks)
        while left:
            part, raw, err = await queue.get()
            if err is not None:
                raise err
            if raw is None:
                left -= 1
                continue
            index, piece, lp, _ = part.add(raw)
            if piece or lp is not None:
                yield _chunk(head, [{"index": index, "text": piece,
                                     "logprobs": lp if logprobs else None,
                                     "finish_reason": None}])
        for part in (part for _, part in runs):
            for i in range(part.n):
                c = part.choices.get(i, Choice())
                yield _chunk(head, [{"index": part.first + i, "text": "", "logprobs": None,
                                     "finish_reason": c.finish or "stop"}])
        if include_usage:
            yield _chunk(head, [], usage=total_usage([part for _, part in runs]))
        yield b"data: [DONE]\n\n"
    except HTTPError as e:  # the OpenAI clients raise on a data event holding "error"
        yield b"data: " + e.openai_body() + b"\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        entry.release()
