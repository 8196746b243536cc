"""The address file: how `gpufn serve --address-file` tells workers on other hosts where
the head is, through a shared filesystem (the HPC pattern), and how they wait for it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FORMAT = 1


def write(path: Path, address: str, *, public_key: str | None = None) -> None:
    """Write atomically (readers never see half a file). No secret goes in: the token
    travels separately (GPUFN_TOKEN, a Secret); `public_key` is the server's CURVE key
    once traffic is encrypted (public by nature)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "address": address, "public_key": public_key,
                               "pid": os.getpid(), "written": time.time()}) + "\n")
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any] | None:
    """The file's contents, or None while it is missing or incomplete."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("address"), str):
        return None
    return data


def wait_for(path: Path, timeout: float = 0.0, poll: float = 0.5,
             on_wait: Any = None) -> dict[str, Any] | None:
    """Wait until `path` holds an address (forever if `timeout` is 0); None on timeout."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    waited = False
    while True:
        data = read(path)
        if data is not None:
            return data
        if not waited and on_wait is not None:
            on_wait()
            waited = True
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(poll)


def remove_if_ours(path: Path) -> None:
    """On a clean stop: remove the file if this process wrote it (not a newer head's)."""
    data = read(path)
    if data is not None and data.get("pid") == os.getpid():
        try:
            path.unlink()
        except OSError:
            pass
