"""Settings from the environment: one accessor each in gpufn.wire.config, defaults, and bad values
refused with InvalidSpec naming the variable."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufn.exceptions import InvalidSpec
from gpufn.wire import config

ROOT = Path(__file__).resolve().parents[2]

# accessor, variable, value when unset, [(set to, gives)], [bad values]
CASES: list[tuple[Callable[[], Any], str, Any, list[tuple[str, Any]], list[str]]] = [
    (config.token, "GPUFN_TOKEN", None, [("s3cret", "s3cret"), ("", None)], []),
    (config.cpu_devices, "GPUFN_CPU_DEVICES", 2, [("4", 4)], ["0", "two", "-1"]),
    (config.cpu_islands, "GPUFN_CPU_ISLANDS", 1, [("2", 2)], ["0", "x"]),
    (config.force_cpu, "GPUFN_FORCE_CPU", False,
     [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False)], ["maybe", "2"]),
    (config.log_level, "GPUFN_LOG_LEVEL", "WARNING", [("info", "INFO"), ("DEBUG", "DEBUG")],
     ["LOUD", "verbose"]),
    (config.log_dir, "GPUFN_LOG_DIR", config.state_dir() / "logs",
     [("/tmp/x", Path("/tmp/x"))], []),
    (config.home, "GPUFN_HOME", Path.home() / ".gpufn", [("/tmp/h", Path("/tmp/h"))], []),
    (config.embedded_transport, "GPUFN_EMBEDDED_TRANSPORT", "ipc",
     [("tcp", "tcp"), ("IPC", "ipc")], ["udp", "unix"]),
    (config.dist_backend, "GPUFN_DIST_BACKEND", None, [("gloo", "gloo"), (" nccl ", "nccl")], []),
    (config.progress_enabled, "GPUFN_PROGRESS", True, [("0", False), ("1", True)], ["sometimes"]),
    (config.map_window, "GPUFN_MAP_WINDOW", 4096, [("16", 16)], ["0", "lots"]),
    (config.high_water_mark, "GPUFN_HWM", 100_000, [("10", 10)], ["many"]),
    (config.shm_threshold, "GPUFN_SHM_THRESHOLD", 64 * 2**20, [("1MiB", 2**20), ("0", None)],
     ["big"]),
    (config.shm_pool_bytes, "GPUFN_SHM_POOL", 2**30, [("256MiB", 2**28), ("0", 0)],
     ["deep", "-1GiB"]),
    (config.worker_host_memory, "GPUFN_WORKER_HOST_MEMORY", None,
     [("32GiB", 32 * 2**30), ("0", 0)], ["plenty", "-1GiB"]),
    (config.head_grace, "GPUFN_HEAD_GRACE", 60.0, [("5", 5.0), ("0.5", 0.5)], ["0", "-1", "soon"]),
    (config.held_result_bytes, "GPUFN_HELD_RESULTS", 64 * 2**20, [("1MiB", 2**20), ("0", 0)],
     ["lots"]),
]


@pytest.mark.parametrize("accessor,var,default,good,bad", CASES, ids=[c[1] for c in CASES])
def test_accessor(monkeypatch: pytest.MonkeyPatch, accessor: Callable[[], Any], var: str,
                  default: Any, good: list[tuple[str, Any]], bad: list[str]) -> None:
    assert accessor.__doc__ and var in accessor.__doc__, f"{accessor.__name__} documents {var}"
    monkeypatch.delenv(var, raising=False)
    assert accessor() == default
    for value, expected in good:
        monkeypatch.setenv(var, value)
        assert accessor() == expected, value
    for value in bad:
        monkeypatch.setenv(var, value)
        with pytest.raises(InvalidSpec, match=var):
            accessor()


def test_env_bool_default_when_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_FORCE_CPU", "")
    assert config.force_cpu() is False


_READ = re.compile(r"""os\.(environ\.get\(|environ\[|getenv\()\s*["']GPUFN_""")


def test_settings_are_read_only_through_config() -> None:
    """Every read of a GPUFN_* variable goes through gpufn.wire.config (writes for children are fine)."""
    offenders = []
    for folder in ("gpufn", "scheduler", "memory_pool", "worker"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "gpufn" / "config.py":
                continue
            for no, line in enumerate(path.read_text().splitlines(), 1):
                m = _READ.search(line)
                if m and not re.search(r"""\[["']GPUFN_\w+["']\]\s*=[^=]""", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "read these through a gpufn.wire.config accessor:\n" + "\n".join(offenders)
