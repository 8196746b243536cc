"""The source lines a pickled function carries for remote tracebacks: only its own (the
frames a worker names after the user's file are its code's: cloudpickle renames the rest
"<dynamic-code>"), so that a file of N functions is not sent, stored and loaded N times."""

from __future__ import annotations

import linecache
import types
from typing import Any


def needed(target: Any, filename: str, lines: list[str]) -> dict[int, str]:
    """Line number (1-based) -> line, for the lines of `filename` that `target`'s code
    spans (nested functions, lambdas and comprehensions included)."""
    keep: dict[int, str] = {}
    for fn in _functions(target):
        code = fn.__code__
        if code.co_filename == filename:
            lo, hi = _span(code)
            for n in range(lo, min(hi, len(lines)) + 1):
                keep[n] = lines[n - 1]
    return keep


def _functions(obj: Any) -> list[types.FunctionType]:
    """The plain functions behind `obj`: itself, a wrapper's (`@gpu`: `_fn`), a class's
    methods."""
    if isinstance(obj, types.FunctionType):
        return [obj]
    inner = getattr(obj, "_fn", None) if not isinstance(obj, type) else None
    if isinstance(inner, types.FunctionType):
        return [inner]
    if not isinstance(obj, type):
        return []
    out = []
    for v in vars(obj).values():
        v = getattr(v, "__func__", v)  # staticmethod, classmethod
        if isinstance(v, property):
            out += [f for f in (v.fget, v.fset, v.fdel) if isinstance(f, types.FunctionType)]
        elif isinstance(v, types.FunctionType):
            out.append(v)
    return out


def _span(code: types.CodeType) -> tuple[int, int]:
    """First and last line of `code` and of the code nested in it."""
    lo = hi = code.co_firstlineno
    for _, _, line in code.co_lines():
        if line is not None and line > hi:
            hi = line
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            clo, chi = _span(c)
            lo, hi = min(lo, clo), max(hi, chi)
    return lo, hi


def install(filename: str, lines: dict[int, str] | list[str]) -> None:
    """Put a shipped function's lines in `linecache` for `filename`, merged with what other
    functions of the same file put there (a list: the whole file, as older senders did)."""
    if isinstance(lines, list):
        linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
        return
    entry: Any = linecache.cache.get(filename)
    full = list(entry[2]) if entry is not None and len(entry) == 4 and entry[1] is None else []
    top = max(lines, default=0)
    if len(full) < top:
        full += ["\n"] * (top - len(full))
    for n, line in lines.items():
        full[n - 1] = line
    linecache.cache[filename] = (sum(map(len, full)), None, full, filename)
