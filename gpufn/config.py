"""Settings read from the environment (GPUFN_*), in one place, with their defaults."""

from __future__ import annotations

import os
import socket

from gpufn.exceptions import InvalidSpec
from gpufn.spec import parse_memory

DEFAULT_PORT = 7555


def env_str(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return v if v not in (None, "") else default


def env_int(name: str, default: int) -> int:
    v = env_str(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise InvalidSpec(f"{name}={v!r} must be an integer.") from None


def env_float(name: str, default: float) -> float:
    v = env_str(name)
    if v is None:
        return default
    try:
        return float(v)
    except ValueError:
        raise InvalidSpec(f"{name}={v!r} must be a number.") from None


def address() -> str | None:
    """GPUFN_ADDRESS: the scheduler to connect to; unset means the embedded local cluster."""
    return env_str("GPUFN_ADDRESS")


def token() -> str | None:
    return env_str("GPUFN_TOKEN")


def cpu_devices() -> int:
    """GPUFN_CPU_DEVICES: simulated devices where no GPU is found (default 2)."""
    n = env_int("GPUFN_CPU_DEVICES", 2)
    if n < 1:
        raise InvalidSpec(f"GPUFN_CPU_DEVICES={n} must be at least 1.")
    return n


def device_memory() -> int:
    """GPUFN_DEVICE_MEMORY: capacity of each simulated device (default 8GiB)."""
    return parse_memory(env_str("GPUFN_DEVICE_MEMORY", "8GiB"), "GPUFN_DEVICE_MEMORY")


def node_id() -> str:
    """GPUFN_NODE_ID: this host's name in device keys ("node:index")."""
    return env_str("GPUFN_NODE_ID") or socket.gethostname()


def high_water_mark() -> int:
    """GPUFN_HWM: ZeroMQ send/receive high-water marks (messages) on every gpufn socket."""
    return env_int("GPUFN_HWM", 100_000)


def log_level() -> str:
    return (env_str("GPUFN_LOG_LEVEL", "WARNING") or "WARNING").upper()


def normalize_address(addr: str) -> str:
    """'host:port' or 'tcp://host:port' -> 'tcp://host:port'."""
    if "://" in addr:
        return addr
    if ":" not in addr:
        return f"tcp://{addr}:{DEFAULT_PORT}"
    return f"tcp://{addr}"
