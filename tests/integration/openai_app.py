"""The OpenAI models the client tests deploy (as `oa`) beside the examples: one that declares
`tools`/`tool_choice`/`response_format` (and answers what it got), one that fails
mid-stream, and a completion model that declares `n`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import gpufn


@gpufn.chat_model("tooling", params=["tools", "tool_choice", "response_format", "max_tokens",
                                     "temperature", "parallel_tool_calls"])
@gpufn.gpu
def tooling(messages: list[dict[str, Any]], **params: Any) -> Iterator[Any]:
    """A tool call when given tools, a JSON object when asked for one, else the
    parameters it received."""
    tools = params.get("tools")
    if tools:
        name = tools[0]["function"]["name"]
        yield {"tool_calls": [{"id": "call_0", "type": "function",
                               "function": {"name": name, "arguments": json.dumps({"x": 1})}}]}
        return
    fmt = params.get("response_format") or {}
    if fmt.get("type") in ("json_object", "json_schema"):
        yield json.dumps({"name": "gpu", "count": 2})
        return
    yield json.dumps(sorted(params))


@gpufn.chat_model("broken")
@gpufn.gpu
def broken(messages: list[dict[str, Any]], max_tokens: int = 16) -> Iterator[str]:
    yield "partial"
    raise RuntimeError("boom mid-stream")


@gpufn.completion_model("multi")
@gpufn.gpu
def multi(prompt: str | list[int], n: int = 1, max_tokens: int = 16) -> Iterator[dict[str, Any]]:
    """`n` choices per prompt, each the prompt and its index."""
    for i in range(n):
        yield {"index": i, "text": f"{prompt}#{i}", "finish_reason": "length"}
    yield {"usage": {"prompt_tokens": 1, "completion_tokens": n}}


@gpufn.embedding_model("batchy")
@gpufn.gpu(batch_size=64, batch_wait_ms=200)
def batchy(input: list[Any]) -> list[dict[str, Any]]:
    """Each input's 'embedding' is the size of the batch it ran in."""
    return [{"embedding": [float(len(input))], "tokens": 1} for _ in input]
