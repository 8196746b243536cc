"""Where `gpufn serve` leaves its address and token for local clients and `gpufn status`
($GPUFN_HOME/cluster.json, default ~/.gpufn, readable by the owner only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpufn import config


def home() -> Path:
    return config.home()


def write_cluster_file(address: str, token: str) -> Path:
    d = home()
    d.mkdir(parents=True, exist_ok=True)
    path = d / "cluster.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "token": token, "pid": os.getpid()}, f)
    return path


def load_cluster_file() -> dict[str, Any] | None:
    try:
        data = json.loads((home() / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "address" not in data:
        return None
    return data


def saved_token(address: str) -> str | None:
    """The token `gpufn serve` on this machine left, if `address` is that scheduler."""
    saved = load_cluster_file()
    if saved is None or saved["address"] != config.normalize_address(address):
        return None
    tok = saved.get("token")
    return tok if isinstance(tok, str) and tok else None
