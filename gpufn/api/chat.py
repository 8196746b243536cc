"""Declare deployed functions OpenAI models, served by the HTTP gateway:
`@gpufn.chat_model("name")` at `/v1/chat/completions`, `@gpufn.completion_model("name")` at
`/v1/completions`, `@gpufn.embedding_model("name")` at `/v1/embeddings` (all listed at
`/v1/models`). One name may be a chat and a completion model at once (two functions).

    @gpufn.chat_model("tiny-llama")
    @gpufn.gpu(count=2, models=[llama])
    def chat(messages: list[dict], max_tokens: int = 16, stop: list[str] | None = None):
        yield from generate_text(messages, max_tokens, stop)    # text pieces

Declared, never dropped: the function receives, as keyword arguments, the request
parameters it declares — those its signature names (a `**kwargs` declares none), or the
`params=` list given here, which replaces them — and the gateway refuses a request that
sets any other with a 400 naming it. The contracts (what each kind of model receives and
yields or returns) are in docs/api.md, "OpenAI models".
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from gpufn.api.function import Function
from gpufn.exceptions import InvalidSpec

F = TypeVar("F", bound=Function[Any, Any])

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,99}$")
_PARAM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
ROLES = {"chat": "messages", "completion": "prompt", "embedding": "input"}
_SHAPE = {"chat": "a generator function that yields text pieces "
                  "(def chat(messages, max_tokens=16): yield ...)",
          "completion": "a generator function that yields text pieces "
                        "(def complete(prompt, max_tokens=16): yield ...)",
          "embedding": "a function that returns one embedding per input "
                       "(def embed(input): return [...])"}


def _check_params(deco: str, fn: Function[Any, Any], role: str,
                  params: Iterable[str] | None) -> list[str] | None:
    """The explicit `params=` list, checked against the function's signature."""
    if params is None:
        return None
    names = list(params)
    for name in names:
        if not isinstance(name, str) or not _PARAM.match(name):
            raise InvalidSpec(f"{deco}: {name!r} in params is not a parameter name")
    sig = inspect.signature(fn._fn)
    kinds = {p.name: p.kind for p in sig.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD not in kinds.values():
        missing = [n for n in names if n not in kinds]
        if missing:
            raise InvalidSpec(f"{deco} on {fn.name}: params lists {missing}, which "
                              f"{fn.name} does not accept; add them (or **kwargs) to its "
                              "signature")
    if ROLES[role] in names:
        raise InvalidSpec(f"{deco}: {ROLES[role]!r} is always passed; leave it out of params")
    return names


def _marker(role: str) -> Callable[..., Callable[[F], F]]:
    def decorator(name: str, *, params: Iterable[str] | None = None) -> Callable[[F], F]:
        deco = f"@gpufn.{role}_model({name!r})"
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidSpec(f"{role}_model({name!r}): a model name is 1-100 letters, digits "
                              "and '_.:/-', starting with a letter or digit, e.g. 'tiny-llama'")
        if isinstance(params, str):
            raise InvalidSpec(f"{deco}: params is a list of parameter names, e.g. "
                              "params=['max_tokens', 'temperature'], not a string")

        def mark(fn: F) -> F:
            if not isinstance(fn, Function):
                raise InvalidSpec(f"{deco} goes above @gpufn.gpu(...): it marks a gpufn "
                                  f"function, not {fn!r}")
            if fn._yields != (role != "embedding"):
                raise InvalidSpec(f"{deco} on {fn.name}: a {role} model is {_SHAPE[role]}")
            fn.__dict__[f"_{role}_model"] = name
            fn.__dict__[f"_{role}_params"] = _check_params(deco, fn, role, params)
            return fn

        return mark

    decorator.__name__ = f"{role}_model"
    decorator.__doc__ = (f"Mark a `@gpufn.gpu` function as the OpenAI {role} model `name`; "
                         f"it is {_SHAPE[role]}. `params`: the OpenAI parameters it handles, "
                         "if not those its signature names.")
    return decorator


chat_model = _marker("chat")
completion_model = _marker("completion")
embedding_model = _marker("embedding")


def chat_name(fn: Function[Any, Any]) -> str:
    """The chat model name `fn` was declared as ("" if none)."""
    return str(fn.__dict__.get("_chat_model", ""))


def model_names(fn: Function[Any, Any]) -> dict[str, str]:
    """The OpenAI model names `fn` serves, by role (chat, completion, embedding)."""
    return {role: str(fn.__dict__[f"_{role}_model"]) for role in ROLES
            if fn.__dict__.get(f"_{role}_model")}


def openai_interface(fn: Function[Any, Any]) -> dict[str, Any]:
    """What the gateway records of `fn`'s OpenAI roles: `{"chat": name, ..., "params":
    [...]}` (params only where given explicitly); {} for a function that serves none."""
    roles: dict[str, Any] = dict(model_names(fn))
    for role in roles.copy():
        listed = fn.__dict__.get(f"_{role}_params")
        if listed is not None:
            roles["params"] = list(listed)
    return roles
