"""What a function declares it needs (`@gpu(...)`), parsed and validated up front.

A bad value raises `InvalidSpec` naming the option, the value and the fix, when the
decorator runs; the scheduler later resolves a valid spec against real devices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from gpufn.exceptions import InvalidSpec
from gpufn.wire.units import format_bytes, parse_memory


@dataclass(frozen=True, slots=True)
class Retries:
    """Retry policy (`@gpu(retries=gpufn.Retries(...))`), after Modal's `modal.Retries`.

    A call whose function raises an exception that is an instance of one of `on` (default:
    any `Exception`) runs again, up to `max_retries` times, after a delay of
    `initial_delay * backoff_coefficient ** n` seconds (n = 0 for the first retry), at most
    `max_delay`; after the last retry the caller gets the last exception. A lost worker is
    retried at once, as with `retries=N`. gpufn's own errors (Cancelled, Timeout, ...) and
    a generator that has already delivered a value are never retried. `backoff=` is an
    alias of `backoff_coefficient=`.
    """

    max_retries: int
    backoff_coefficient: float = 2.0
    initial_delay: float = 1.0
    max_delay: float = 60.0
    on: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, max_retries: int, backoff_coefficient: float = 2.0,
                 initial_delay: float = 1.0, max_delay: float = 60.0,
                 on: type[BaseException] | Iterable[type[BaseException]] = (Exception,),
                 *, backoff: float | None = None) -> None:
        if backoff is not None:
            backoff_coefficient = backoff
        on = (on,) if isinstance(on, type) else tuple(on)
        if not on or not all(isinstance(c, type) and issubclass(c, BaseException) for c in on):
            raise InvalidSpec(f"Retries(on={on!r}) must be exception classes, "
                              "e.g. on=(ConnectionError, TimeoutError)")
        for name, value, low in (("backoff_coefficient", backoff_coefficient, 1.0),
                                 ("initial_delay", initial_delay, 0.0), ("max_delay", max_delay, 0.0)):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < low):
                raise InvalidSpec(f"Retries({name}={value!r}) must be a number of at least {low:g}.")
        low, high = INT_BOUNDS["retries"]
        object.__setattr__(self, "max_retries", _int("max_retries", max_retries, minimum=low,
                                                     maximum=high))
        object.__setattr__(self, "backoff_coefficient", float(backoff_coefficient))
        object.__setattr__(self, "initial_delay", float(initial_delay))
        object.__setattr__(self, "max_delay", float(max_delay))
        object.__setattr__(self, "on", on)

    def options(self) -> dict[str, object]:
        """The spec options it stands for (classes travel as "module.qualname")."""
        return {"retries": self.max_retries, "retry_on": tuple(class_name(c) for c in self.on),
                "retry_backoff": self.backoff_coefficient,
                "retry_delay": self.initial_delay, "retry_max_delay": self.max_delay}


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def retry_delay(spec: GpuSpec, retry: int) -> float:
    """Seconds before retry number `retry` (1 for the first) of a raised exception."""
    return min(spec.retry_max_delay, spec.retry_delay * spec.retry_backoff ** max(0, retry - 1))


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A validated `@gpu(...)` declaration (plus per-call options)."""

    count: int = 1
    type: tuple[str, ...] = ()
    memory: int = 0
    timeout: float | None = None
    retries: int = 0
    priority: int = 0
    concurrency: int = 1
    models: tuple[str, ...] = ()
    gather: bool = False
    spmd: bool = True
    preemptible: bool = False
    batch_size: int | None = None
    batch_wait_ms: float = 0.0
    deadline: float | None = None
    cache: str = ""  # result cache directory ("" = off); see gpufn/api/cache.py
    autocast: str = ""  # run under torch.autocast with this dtype: "bf16", "fp16" ("" = off)
    device_args: bool = False  # move tensor arguments to the call's device
    # Retries(...): raised exceptions of these classes ("module.qualname") are retried too,
    # after retry_delay * retry_backoff ** n seconds (at most retry_max_delay).
    retry_on: tuple[str, ...] = ()
    retry_backoff: float = 2.0
    retry_delay: float = 1.0
    retry_max_delay: float = 60.0
    # The worker's host memory (its processes' resident bytes) may reach this while the
    # call runs, instead of the host's per-worker budget (0: that budget); see
    # worker/host/memory_watch.py.
    host_memory: int = 0
    # A session or prompt-prefix key: the call goes to the device that last ran this key
    # (whose engine may hold its cache) when that device has room and is not much busier
    # than the least busy one; see scheduler/placement/affinity.py.
    affinity: str = ""

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = list(self.type)
        d["models"] = list(self.models)
        d["retry_on"] = list(self.retry_on)
        return d

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> GpuSpec:
        """A spec from its wire form, every field validated again (a peer may lie)."""
        if not isinstance(d, Mapping):
            raise InvalidSpec(f"a spec must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for name in ("models", "retry_on"):
            if isinstance(kw.get(name), list):
                kw[name] = tuple(kw[name])
        if kw.get("type") in ([], ()):
            kw["type"] = None
        return make_spec(**kw)

    def describe(self) -> str:
        parts = [f"{self.count} device{'s' if self.count > 1 else ''}"]
        if self.type:
            parts.append("of type " + " or ".join(self.type))
        if self.memory:
            parts.append(f"with {format_bytes(self.memory)} free")
        return " ".join(parts)


OPTION_NAMES = tuple(f.name for f in fields(GpuSpec))


# The range of each integer option (inclusive): every value fits the wire's int64, and
# none is so large that it can only be a mistake.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "count": (1, 4096),
    "retries": (0, 1000),
    "priority": (-10**9, 10**9),
    "concurrency": (1, 10_000),
    "batch_size": (1, 1_000_000),
}


def _int(name: str, value: object, *, minimum: int | None = None,
         maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(f"{name}={value!r} must be an integer.")
    if minimum is not None and value < minimum:
        raise InvalidSpec(f"{name}={value!r} must be at least {minimum}.")
    if maximum is not None and value > maximum:
        raise InvalidSpec(f"{name}={value!r} must be at most {maximum:,}.")
    return value


def _bounded(name: str, value: object) -> int:
    low, high = INT_BOUNDS[name]
    return _int(name, value, minimum=low, maximum=high)


def _seconds(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidSpec(f"{name}={value!r} must be a number of seconds (or None).")
    if value <= 0:
        raise InvalidSpec(f"{name}={value!r} must be positive; use None for no limit.")
    return float(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidSpec(f"{name}={value!r} must be True or False.")
    return value


def _types(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items: Iterable[object] = [value] if isinstance(value, str) else value  # type: ignore[assignment]
    try:
        out = tuple(items)
    except TypeError:
        out = ()
    names = tuple(t.strip() for t in out if isinstance(t, str) and t.strip())
    if not names or len(names) != len(out):
        raise InvalidSpec(
            f"type={value!r} must be a device name like 'H100' or an ordered list of "
            "acceptable names like ['H100', 'A100'] (fallbacks, first preferred)."
        )
    for name in names:
        base, sep, n = name.rpartition(":")
        if sep and n.strip().isdigit():  # Modal's "H100:2"
            raise InvalidSpec(f"type={name!r}: give the device count apart, "
                              f"@gpu(type={base.strip()!r}, count={int(n)}).")
        if not any(ch.isalnum() for ch in name):
            raise InvalidSpec(f"type={name!r} is not a device name; use one like 'H100' or 'A100'.")
    return names


def modal_gpu_hint(value: object) -> str:
    """The gpufn spelling of Modal's `gpu=` argument ("H100", "H100:2", ["H100", "A100"])."""
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    count, types = 1, []
    for v in names:
        if not isinstance(v, str):
            return "@gpu(type='H100', count=2)"
        base, sep, n = v.rpartition(":")
        if sep and n.strip().isdigit():
            count, v = int(n), base
        types.append(v.strip())
    if not types:
        return "@gpu(type='H100', count=2)"
    t = repr(types[0]) if len(types) == 1 else repr(types)
    return f"@gpu(type={t}" + (f", count={count})" if count > 1 else ")")


AUTOCAST_DTYPES = ("bf16", "fp16")


def _cache_dir(value: object) -> str:
    """cache=True: the default directory (GPUFN_CACHE_DIR); a path: that directory."""
    if value is None or value is False or value == "":
        return ""
    if value is True:
        from gpufn.wire import config

        return str(config.cache_dir())
    if isinstance(value, str):
        return value
    if hasattr(value, "__fspath__"):
        return str(value.__fspath__())
    raise InvalidSpec(f"cache={value!r} must be True, False or a directory path, e.g. "
                      "@gpu(cache=True) or @gpu(cache='/shared/gpufn-cache').")


def normalize_option(name: str, value: object) -> object:
    """Validate one option and return its canonical value; raise InvalidSpec otherwise."""
    if name == "count":
        return _bounded(name, value)
    if name == "type":
        return _types(value)
    if name in ("memory", "host_memory"):
        return 0 if value is None else parse_memory(value, name)
    if name in ("timeout", "deadline"):
        return _seconds(name, value)
    if name == "retries":
        return _bounded(name, value)
    if name == "retry_on":
        if not isinstance(value, tuple) or not all(isinstance(c, str) and c for c in value):
            raise InvalidSpec(f"retry_on={value!r} must be a tuple of class names; "
                              "use retries=gpufn.Retries(on=...)")
        return value
    if name in ("retry_backoff", "retry_delay", "retry_max_delay"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < (1.0 if name == "retry_backoff" else 0.0):
            raise InvalidSpec(f"{name}={value!r} is out of range; use retries=gpufn.Retries(...)")
        return float(value)
    if name in ("priority", "concurrency"):
        return _bounded(name, value)
    if name == "cache":
        return _cache_dir(value)
    if name == "autocast":
        if value in (None, False, ""):
            return ""
        if value not in AUTOCAST_DTYPES:
            raise InvalidSpec(f"autocast={value!r} must be one of {', '.join(map(repr, AUTOCAST_DTYPES))} "
                              "(or None for full precision), e.g. @gpu(autocast='bf16').")
        return value
    if name in ("gather", "spmd", "preemptible", "device_args"):
        return _bool(name, value)
    if name == "batch_size":
        return None if value is None else _bounded(name, value)
    if name == "batch_wait_ms":
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InvalidSpec(f"batch_wait_ms={value!r} must be a non-negative number of ms.")
        return float(value)
    if name == "affinity":
        if value is None:
            return ""
        if not isinstance(value, str) or len(value) > 256:
            raise InvalidSpec(f"affinity={value!r} must be a string of at most 256 characters "
                              "(a session id or a prompt-prefix key), e.g. "
                              "f.with_options(affinity=session_id).")
        return value
    if name == "models":
        if not isinstance(value, tuple) or not all(isinstance(m, str) for m in value):
            raise InvalidSpec(f"models={value!r} must be a tuple of model names.")
        return value
    raise InvalidSpec(
        f"unknown option {name!r}. Known options: {', '.join(OPTION_NAMES)}."
    )


def make_spec(base: GpuSpec | None = None, **options: object) -> GpuSpec:
    """Build a spec from options (on top of `base`), validating each and their combination."""
    retries = options.get("retries")
    if isinstance(retries, Retries):
        options = {**options, **retries.options()}
    clean = {k: normalize_option(k, v) for k, v in options.items()}
    spec = replace(base or GpuSpec(), **clean)  # type: ignore[arg-type]
    if spec.gather and spec.count == 1:
        raise InvalidSpec("gather=True needs count>1: it returns the list of every rank's result.")
    if spec.batch_size is not None and spec.count > 1:
        raise InvalidSpec("batch_size= cannot be combined with count>1; batch within the gang instead.")
    if spec.batch_wait_ms and spec.batch_size is None:
        raise InvalidSpec("batch_wait_ms= needs batch_size=, e.g. @gpu(batch_size=32, batch_wait_ms=5).")
    if spec.gather and not spec.spmd:
        raise InvalidSpec("gather=True needs spmd=True: with spmd=False there is one process and one result.")
    return spec
