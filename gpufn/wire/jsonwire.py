"""JSON payloads: a call whose arguments travel as JSON (the HTTP gateway's) is answered in
JSON, its value and every value it yields, so nothing on the HTTP path is ever unpickled.

A JSON payload is two frames, `[JSON_MARK, body]`. A pickle stream (protocol 5) starts
with b"\\x80", never with the mark, so a worker tells the two apart by the first frame: the
payload describes itself, per call (also inside a batch that mixes JSON and Python
callers), and the scheduler, which routes frames untouched, needs no flag for it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpufn.exceptions import NotJSONSerializable, SerializationError
from gpufn.wire.codec import as_bytes

JSON_MARK = b"gpufn-json/1"




def is_json(frames: Sequence[Any]) -> bool:
    """Whether these payload frames are a JSON payload (not a pickle)."""
    if len(frames) != 2:
        return False
    head = frames[0]
    n = len(head) if isinstance(head, bytes) else len(as_bytes(head))
    return n == len(JSON_MARK) and as_bytes(head) == JSON_MARK


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _refuse(what: str) -> Any:
    def default(obj: Any) -> Any:
        raise NotJSONSerializable(
            f"{what} holds a {_type_name(obj)}, which JSON cannot represent; return (or "
            "yield) JSON values: dicts with string keys, lists, strings, numbers, booleans, "
            "None (e.g. tensor.tolist(), float(x))")

    return default


def dumps(value: Any, what: str = "the value") -> bytes:
    """Compact UTF-8 JSON text of `value` (no raw newlines: an SSE `data:` line takes it
    as it is); NotJSONSerializable names the type that does not fit."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_refuse(what)).encode()
    except NotJSONSerializable:
        raise
    except ValueError as e:  # NaN or infinity: not JSON
        raise NotJSONSerializable(f"{what} holds a float JSON cannot represent ({e}); "
                                  "replace NaN and infinities, e.g. with None") from None
    except (TypeError, RecursionError) as e:  # non-string dict keys, cycles
        raise NotJSONSerializable(f"{what} cannot be written as JSON: {e}") from None


def dump_call(args: Sequence[Any], kwargs: dict[str, Any]) -> list[bytes]:
    """The payload of a JSON call: its positional and keyword arguments."""
    return [JSON_MARK, dumps({"args": list(args), "kwargs": kwargs}, "the arguments")]


def load_call(frames: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of a JSON call's payload (made by `dump_call`)."""
    try:
        body = json.loads(as_bytes(frames[1]))
    except ValueError as e:
        raise SerializationError(f"the JSON arguments could not be read: {e}") from None
    if not isinstance(body, dict):
        raise SerializationError('JSON arguments must be {"args": [...], "kwargs": {...}}')
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise SerializationError('JSON arguments must be {"args": [...], "kwargs": {...}}')
    return tuple(args), kwargs


def dump_value(value: Any, what: str) -> list[bytes]:
    """The payload of a JSON call's value (or of one value it yields)."""
    return [JSON_MARK, dumps(value, what)]


def value_text(frames: Sequence[Any]) -> bytes:
    """The JSON text a JSON payload holds, to splice into a response as it is."""
    if not is_json(frames):
        raise SerializationError("the payload is not JSON (a pickle is never read here)")
    return as_bytes(frames[1])


def load_value(frames: Sequence[Any]) -> Any:
    """The value a JSON payload holds."""
    return json.loads(value_text(frames))
