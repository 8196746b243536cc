"""A cheap fingerprint of what a function's pickled code depends on, so a call re-pickles
the code only when it changed: the function itself, its defaults and closure, and the
globals it reads (recursively through functions pickled by value).

A value's part of the key is its identity and version where it allows one (a function,
a module or class pickled by reference, a torch tensor's `_version`), the value itself for
small immutable values, and the contents, walked, for small containers (a list mutated in
place changes the key). Anything else (a class instance, a large container, a module
pickled by value) makes the function unfingerprintable: `fingerprint` returns None and the
caller pickles every time, as it would without this module. The objects whose identity a
key uses are kept alive with it (`Fingerprint.keep`), so no id is reused while it is held.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

try:
    from cloudpickle.cloudpickle import _extract_code_globals as _code_globals
    from cloudpickle.cloudpickle import _should_pickle_by_reference as _by_reference
except ImportError:  # pragma: no cover - another cloudpickle layout: always re-pickle
    _code_globals = None
    _by_reference = None

from gpufn.wire import byvalue

# Leaves walked per fingerprint before giving up (re-pickling is then as cheap).
BUDGET = 2000
_SCALARS = frozenset({int, float, complex, str, bytes, bool, type(None), type(Ellipsis)})
_SIMPLE_BY_ID = (types.BuiltinFunctionType, types.MethodDescriptorType,
                 types.WrapperDescriptorType, type(int.__dict__["real"]))


# id -> (the object, the by-value generation, whether it is pickled by reference)
_REF_CACHE: dict[int, tuple[Any, int, bool]] = {}


def _pickled_by_reference(obj: Any) -> bool:
    """cloudpickle's own rule, remembered per object until the by-value set changes."""
    gen = byvalue.generation()
    hit = _REF_CACHE.get(id(obj))
    if hit is not None and hit[0] is obj and hit[1] == gen:
        return hit[2]
    assert _by_reference is not None
    ref = bool(_by_reference(obj))
    if len(_REF_CACHE) > 4096:
        _REF_CACHE.clear()
    _REF_CACHE[id(obj)] = (obj, gen, ref)
    return ref


class Unfingerprintable(Exception):
    """A value whose changes a fingerprint cannot see cheaply."""


@dataclass(slots=True)
class Fingerprint:
    key: tuple[Any, ...]
    keep: list[Any] = field(default_factory=list)


class _Walk:
    __slots__ = ("budget", "keep", "seen")

    def __init__(self) -> None:
        self.budget = BUDGET
        self.keep: list[Any] = []
        self.seen: set[int] = set()

    def ident(self, obj: Any) -> int:
        self.keep.append(obj)
        return id(obj)

    def value(self, obj: Any) -> Any:
        self.budget -= 1
        if self.budget < 0:
            raise Unfingerprintable("too large")
        t = type(obj)
        if t is str:
            return obj
        if t in _SCALARS:  # 1 == 1.0 == True and 0.0 == -0.0 must differ
            return (t, obj.hex() if t is float else repr(obj) if t is complex else obj)
        if t is tuple or t is frozenset:
            return (t, tuple(self.value(x) for x in obj))
        if t is list:
            return (list, self.ident(obj), tuple(self.value(x) for x in obj))
        if t is dict:
            return (dict, self.ident(obj),
                    tuple((self.value(k), self.value(v)) for k, v in obj.items()))
        if t is set:
            return (set, self.ident(obj), frozenset(self.value(x) for x in obj))
        if t is types.FunctionType:
            return self.function(obj)
        if t is types.ModuleType or isinstance(obj, type):
            if _pickled_by_reference(obj):
                return (t, self.ident(obj))
            raise Unfingerprintable(f"{obj!r} is pickled by value")
        if isinstance(obj, _SIMPLE_BY_ID):
            return (t, self.ident(obj))
        torch = sys.modules.get("torch")
        if torch is not None and t is torch.Tensor:
            return (t, self.ident(obj), obj._version, obj.requires_grad)
        raise Unfingerprintable(f"a {t.__name__}")

    def function(self, fn: types.FunctionType) -> Any:
        if _pickled_by_reference(fn):
            return (types.FunctionType, self.ident(fn))  # the worker imports it
        if id(fn) in self.seen:
            return ("seen", id(fn))  # recursion (its key is being built)
        self.seen.add(id(fn))
        code = fn.__code__
        globs = fn.__globals__
        assert _code_globals is not None
        names = _code_globals(code)
        g = tuple((n, self.value(globs[n])) for n in names if n in globs)
        cells = fn.__closure__
        closure: tuple[Any, ...] = ()
        if cells:
            closure = tuple(self.cell(c) for c in cells)
        return (self.ident(fn), self.ident(code), g, closure,
                self.value(fn.__defaults__) if fn.__defaults__ else None,
                self.value(fn.__kwdefaults__) if fn.__kwdefaults__ else None,
                self.value(fn.__dict__) if fn.__dict__ else None)

    def cell(self, c: types.CellType) -> Any:
        try:
            return self.value(c.cell_contents)
        except ValueError:  # an empty cell
            return ("empty",)


def fingerprint(target: Any) -> Fingerprint | None:
    """The key of what pickling `target` (a function, or one wrapped with its call options)
    depends on, or None when it cannot be told cheaply (then pickle every time)."""
    if _code_globals is None or _by_reference is None:
        return None
    fn = getattr(target, "__gpufn_target__", None)
    w = _Walk()
    extra: tuple[Any, ...] = ()
    try:
        if fn is not None:  # WithCallOptions: the options are plain values
            extra = (w.value(target.autocast), w.value(target.device_args))
        else:
            fn = target
        if type(fn) is not types.FunctionType:
            return None
        key = (byvalue.generation(), extra, w.function(fn))
    except (Unfingerprintable, RecursionError):
        return None
    return Fingerprint(key, w.keep)
