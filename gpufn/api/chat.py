"""`@gpufn.chat_model("name")`: declare a deployed generator function an OpenAI chat model,
served by the HTTP gateway at `/v1/chat/completions` (and listed at `/v1/models`).

    @gpufn.chat_model("tiny-llama")
    @gpufn.gpu(count=2, models=[llama])
    def chat(messages: list[dict], **params) -> Iterator[str]:
        yield from generate_text(messages, **params)    # text pieces

`params` are the request's `max_tokens`, `temperature`, `top_p`, `stop` and `seed` (only
those the client sent). Besides text pieces the function may yield dicts with `text`,
`usage` (`prompt_tokens`, `completion_tokens`) and `finish_reason` (`stop`, `length`),
which the gateway reports as OpenAI does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from gpufn.api.function import Function
from gpufn.exceptions import InvalidSpec

F = TypeVar("F", bound=Function[Any, Any])

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,99}$")


def chat_model(name: str) -> Callable[[F], F]:
    """Mark a `@gpufn.gpu` generator function as the OpenAI chat model `name`."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidSpec(f"chat_model({name!r}): a model name is 1-100 letters, digits and "
                          "'_.:/-', starting with a letter or digit, e.g. 'tiny-llama'")

    def mark(fn: F) -> F:
        if not isinstance(fn, Function):
            raise InvalidSpec(f"@gpufn.chat_model({name!r}) goes above @gpufn.gpu(...): it marks "
                              f"a gpufn function, not {fn!r}")
        if not fn._yields:
            raise InvalidSpec(f"@gpufn.chat_model({name!r}) on {fn.name}: a chat model is a "
                              "generator function that yields text pieces "
                              "(def chat(messages, **params): yield ...)")
        fn.__dict__["_chat_model"] = name
        return fn

    return mark


def chat_name(fn: Function[Any, Any]) -> str:
    """The chat model name `fn` was declared as ("" if none)."""
    return str(fn.__dict__.get("_chat_model", ""))
