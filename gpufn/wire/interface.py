"""How a deployed function is called, recorded when it is deployed: its parameters (names,
kinds, defaults, annotations as text), whether it streams, and what it serves over HTTP
(an OpenAI chat model). The gateway lists it and refuses arguments that do not bind
without ever having the function's code."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

_KINDS = {k.name: k for k in (inspect.Parameter.POSITIONAL_ONLY,
                              inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY,
                              inspect.Parameter.VAR_KEYWORD)}


def _text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):  # `from __future__ import annotations`
        return annotation
    return inspect.formatannotation(annotation)


def _param(p: inspect.Parameter) -> dict[str, Any]:
    out: dict[str, Any] = {"name": p.name, "kind": p.kind.name, "annotation": _text(p.annotation),
                           "has_default": p.default is not inspect.Parameter.empty}
    if out["has_default"]:
        out["default_repr"] = repr(p.default)[:200]
        try:
            json.dumps(p.default, allow_nan=False)
            out["default"] = p.default
        except (TypeError, ValueError):
            pass  # not a JSON value: the repr says what it is
    return out


def describe(fn: Callable[..., Any], chat_model: str = "") -> dict[str, Any]:
    """The interface of `fn` as plain JSON data."""
    try:
        sig = inspect.signature(fn)
        params = [_param(p) for p in sig.parameters.values()]
        returns = _text(sig.return_annotation)
    except (TypeError, ValueError):  # a builtin without a signature: anything binds
        params = [{"name": "args", "kind": "VAR_POSITIONAL", "annotation": "", "has_default": False},
                  {"name": "kwargs", "kind": "VAR_KEYWORD", "annotation": "", "has_default": False}]
        returns = ""
    doc = (inspect.getdoc(fn) or "").strip().split("\n\n")[0].replace("\n", " ")
    return {"params": params, "returns": returns, "doc": doc[:300],
            "generator": inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn),
            "chat_model": chat_model}


def signature(interface: dict[str, Any]) -> inspect.Signature:
    """An `inspect.Signature` rebuilt from a recorded interface (defaults stand in)."""
    params = []
    for p in interface.get("params", []):
        default = p.get("default", ...) if p.get("has_default") else inspect.Parameter.empty
        params.append(inspect.Parameter(str(p["name"]), _KINDS[str(p["kind"])], default=default))
    return inspect.Signature(params)


def bind_error(sig: inspect.Signature, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    """Why these arguments do not fit the signature ("missing a required argument: 'x'"),
    or None."""
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None
