"""Which OpenAI request parameters reach a model function: declared, never dropped.

The gateway itself handles a few parameters of each route (`HANDLED`: the model, the
input, `stream`, ...). Every other top-level parameter of the request goes to the model
function as a keyword argument if the function declares it, and is refused with a 400
naming it (`param`) if it does not. A function declares the parameters it names in its
signature (a `**kwargs` declares none), or those of the `params=` list given to its
decorator (`@gpufn.chat_model("m", params=[...])`), which replaces the signature's.
A parameter sent as null, or at the value that leaves OpenAI's behaviour unchanged
(`NEUTRAL`: `n: 1`, `presence_penalty: 0`, `echo: false`, ...), counts as not sent.
Values of the parameters OpenAI defines are checked here (type and range) before any
call is made; others (a declared `top_k`, say) pass as they came.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gpufn.http.errors import HTTPError

# Parameters the gateway handles itself, per route.
HANDLED: dict[str, frozenset[str]] = {
    "chat": frozenset({"model", "messages", "stream", "stream_options", "user"}),
    "completion": frozenset({"model", "prompt", "stream", "stream_options", "user"}),
    "embedding": frozenset({"model", "input", "encoding_format", "user"}),
}
# What each route's data parameter is called in the function.
DATA = {"chat": "messages", "completion": "prompt", "embedding": "input"}
# Values that change nothing: sent, they count as not sent.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "logit_bias": ({},), "echo": (False,), "suffix": ("",), "tools": ([],),
    "parallel_tool_calls": (True,), "store": (False,), "metadata": ({},),
    "response_format": ({"type": "text"},),
}
NEUTRAL_BY_ROUTE: dict[str, dict[str, tuple[Any, ...]]] = {
    "chat": {"logprobs": (False,), "top_logprobs": (0,)},
    "completion": {},
    "embedding": {},
}
MAX_LOGPROBS = 20


def bad(param: str, message: str, code: str = "invalid_value") -> HTTPError:
    return HTTPError(400, "invalid_request_error", message, param=param, code=code)


def _int(name: str, v: Any, low: int, high: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise bad(name, f"{name} must be an integer from {low} to {high}, got {v!r}")
    return v


def _number(name: str, v: Any, low: float, high: float) -> float:
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or not low <= v <= high):
        raise bad(name, f"{name} must be a number from {low:g} to {high:g}, got {v!r}")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def _stop(name: str, v: Any) -> list[str]:
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > 4):
        raise bad(name, "stop must be a string or a list of at most 4 non-empty strings")
    return list(stops)


def _logit_bias(name: str, v: Any) -> dict[int, float]:
    if not isinstance(v, dict):
        raise bad(name, 'logit_bias must map token ids to biases, e.g. {"50256": -100}')
    out: dict[int, float] = {}
    for k, b in v.items():
        key = str(k)
        if not key.isdigit():
            raise bad(name, f"logit_bias keys are token ids (digits), got {k!r}")
        out[int(key)] = _number(name, b, -100, 100)
    return out


def _object(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise bad(name, f"{name} must be an object, got {type(v).__name__}")
    return v


def _tools(name: str, v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise bad(name, "tools must be a list of tool objects")
    return v


def _tool_choice(name: str, v: Any) -> str | dict[str, Any]:
    if v in ("none", "auto", "required") or isinstance(v, dict):
        return v
    raise bad(name, 'tool_choice is "none", "auto", "required" or a tool object')


def _response_format(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise bad(name, 'response_format is {"type": "text" | "json_object" | "json_schema"}')
    return v


Check = Callable[[str, Any], Any]

CHECKS: dict[str, Check] = {
    "temperature": lambda n, v: _number(n, v, 0, 2),
    "top_p": lambda n, v: _number(n, v, 0, 1),
    "presence_penalty": lambda n, v: _number(n, v, -2, 2),
    "frequency_penalty": lambda n, v: _number(n, v, -2, 2),
    "seed": lambda n, v: _int(n, v, -(2**63), 2**64 - 1),
    "n": lambda n, v: _int(n, v, 1, 128),
    "best_of": lambda n, v: _int(n, v, 1, 128),
    "stop": _stop,
    "logit_bias": _logit_bias,
    "echo": _bool,
    "parallel_tool_calls": _bool,
    "top_logprobs": lambda n, v: _int(n, v, 0, MAX_LOGPROBS),
    "tools": _tools,
    "tool_choice": _tool_choice,
    "response_format": _response_format,
    "stream_options": _object,
    "dimensions": lambda n, v: _int(n, v, 1, 65536),
}
ROUTE_CHECKS: dict[str, dict[str, Check]] = {
    "chat": {"max_tokens": lambda n, v: _int(n, v, 1, 2**31 - 1), "logprobs": _bool},
    "completion": {"max_tokens": lambda n, v: _int(n, v, 0, 2**31 - 1),
                   "logprobs": lambda n, v: _int(n, v, 0, MAX_LOGPROBS)},
    "embedding": {},
}


def declared(interface: dict[str, Any], route: str) -> frozenset[str]:
    """The OpenAI parameters a recorded function declares (see the module's rule)."""
    listed = (interface.get("openai") or {}).get("params")
    if isinstance(listed, list):
        return frozenset(str(x) for x in listed)
    named = {str(x.get("name")) for x in interface.get("params", [])
             if x.get("kind") in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")}
    return frozenset(named - {DATA[route]})


def is_set(route: str, name: str, value: Any) -> bool:
    """Whether a sent value asks for something (null and neutral values do not)."""
    if value is None:
        return False
    neutral = NEUTRAL_BY_ROUTE[route].get(name, NEUTRAL.get(name, ()))
    return not any(type(value) is type(x) and value == x for x in neutral)


def function_kwargs(body: dict[str, Any], route: str, accepts: frozenset[str],
                    model: str) -> dict[str, Any]:
    """The keyword arguments the model function receives besides its data parameter:
    each declared parameter the request sets, checked; 400 naming the first one the
    function does not declare."""
    body = dict(body)
    if route == "chat" and "max_completion_tokens" in body:  # the newer name of max_tokens
        alias = body.pop("max_completion_tokens")
        if body.get("max_tokens") is None:
            body["max_tokens"] = alias
    checks = {**CHECKS, **ROUTE_CHECKS[route]}
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in HANDLED[route] or not is_set(route, name, value):
            continue
        if name not in accepts:
            handled = ", ".join(sorted(accepts)) or "none"
            raise bad(name, f"{model} does not handle the parameter {name!r} (it handles: "
                      f"{handled}); leave it out, or deploy a model function that declares "
                      "it", "unsupported_parameter")
        check = checks.get(name)
        out[name] = check(name, value) if check is not None else value
    _cross_checks(out, route)
    return out


def _cross_checks(kwargs: dict[str, Any], route: str) -> None:
    if "top_logprobs" in kwargs and route == "chat" and not kwargs.get("logprobs"):
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    if "best_of" in kwargs and kwargs["best_of"] < kwargs.get("n", 1):
        raise bad("best_of", "best_of must be at least n")
