"""The Python and cloudpickle versions a peer runs: pickled code only loads where both
match, so a client compares its own with the workers' when it connects."""

from __future__ import annotations

import platform
from collections.abc import Iterable
from typing import Any

import cloudpickle


def runtime_info() -> dict[str, str]:
    """What every peer adds to its Hello."""
    return {"python": platform.python_version(), "cloudpickle": cloudpickle.__version__}


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def skew(mine: dict[str, str], theirs: Iterable[dict[str, Any]]) -> str | None:
    """Why code pickled here cannot run on the workers (another Python minor version or
    cloudpickle version), naming both versions; None when it can."""
    for other in theirs:
        py, cp = str(other.get("python", "")), str(other.get("cloudpickle", ""))
        if (py and _minor(py) != _minor(mine["python"])) or (cp and cp != mine["cloudpickle"]):
            where = ", ".join(other.get("nodes", [])) or "the cluster"
            return (f"version skew: this client runs Python {mine['python']} with cloudpickle "
                    f"{mine['cloudpickle']}, the workers on {where} run Python {py or '?'} with "
                    f"cloudpickle {cp or '?'}. Functions pickled here would fail to unpickle "
                    "there: install the same Python minor version and cloudpickle version "
                    "in both places.")
    return None
