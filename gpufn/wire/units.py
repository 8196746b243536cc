"""Sizes as people write them: "20GiB", "512MB", 2**30 -> bytes, and bytes back to text."""

from __future__ import annotations

import math
import re

from gpufn.exceptions import InvalidSpec

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # Docker-style single letters mean binary units.
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
MAX_BYTES = 2**60  # 1 EiB: no size gpufn takes is larger (and it fits the wire's int64)
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: object, option: str = "memory") -> int:
    """Bytes from an int or a string like "20GiB", "512MB", "1.5 GiB"."""
    fix = f"Give {option}= as bytes (an int) or a string like '20GiB' or '512MB'."
    if isinstance(value, bool) or value is None:
        raise InvalidSpec(f"{option}={value!r} is not a size. {fix}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidSpec(f"{option}={value!r} is negative. {fix}")
        return _at_most_max(value, option, value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise InvalidSpec(f"{option}={value!r} is not a valid size. {fix}")
        return _at_most_max(int(value), option, value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidSpec(f"{option}={value!r} cannot be parsed as a size. {fix}")
        return _at_most_max(int(float(m.group(1)) * _UNITS[m.group(2).lower()]), option, value)
    raise InvalidSpec(f"{option}={value!r} has type {type(value).__name__}, not a size. {fix}")


def _at_most_max(n: int, option: str, value: object) -> int:
    if n > MAX_BYTES:
        raise InvalidSpec(f"{option}={value!r} is larger than 1 EiB ({MAX_BYTES:,} bytes), "
                          "the largest size gpufn takes.")
    return n


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
