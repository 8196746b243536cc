"""What every command shares: finding and reaching the scheduler, one-line failures, durations,
JSON output, and the detached server's pid and log files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NoReturn

import typer

from gpufn.net.processes import alive
from gpufn.wire import config

ADDRESS_HELP = "Scheduler address, tcp://host:port [the last `gpufn serve` on this machine]."
TOKEN_HELP = "The cluster's token [saved by `gpufn serve` on this machine]."

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def fail(message: str, code: int = 1) -> NoReturn:
    """Exit with a one-line reason on stderr (never a traceback for an expected error)."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(code)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def parse_duration(text: str, what: str = "--since") -> float:
    """'90', '90s', '10m', '2h', '1d', '1w' or '1h30m' -> seconds."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", t)
    if not parts or "".join(n + u for n, u in parts) != t:
        fail(f"{what} {text!r} is not a duration: use e.g. 30s, 10m, 2h, 1d", 2)
    return sum(float(n) * _UNITS[u] for n, u in parts)


def resolve(address: str | None, token: str | None) -> tuple[str, str | None]:
    """The scheduler to talk to: --address/GPUFN_ADDRESS, else the one `gpufn serve` on this
    machine left in GPUFN_HOME/cluster.json; its token likewise."""
    from gpufn.net.cluster_file import load_cluster_file, saved_token

    if not address:
        saved = load_cluster_file()
        if saved is None:
            fail("no scheduler address: start one with `gpufn serve` (or `gpufn serve "
                 "--detach`), or pass --address / set GPUFN_ADDRESS", 2)
        address = str(saved["address"])
    if not token:
        token = saved_token(address)
    return config.normalize_address(address), token


def connect(address: str | None, token: str | None, timeout: float) -> Any:
    """A `Client` for the resolved scheduler, or a one-line exit saying why not."""
    import zmq

    from gpufn.client.client import Client
    from gpufn.exceptions import GpufnError

    addr, tok = resolve(address, token)
    try:
        return Client(addr, tok, connect_timeout=timeout)
    except GpufnError as e:
        fail(f"cannot reach the scheduler at {addr}: {type(e).__name__}: {e}")
    except zmq.ZMQError as e:
        fail(f"bad scheduler address {addr!r}: {e}", 2)


def pid_file() -> Path:
    return config.state_dir() / "serve.pid"


def log_file() -> Path:
    return config.state_dir() / "serve.log"


def read_pid() -> int | None:
    """The detached server's pid, if its pid file names a live process."""
    try:
        pid = int(pid_file().read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None
