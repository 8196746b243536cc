"""What every command shares: finding and reaching the scheduler, one-line failures, durations,
JSON output, and the detached server's pid and log files."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from gpufn.net.discovery import Target

ADDRESS_HELP = ("Scheduler address, tcp://HOST:PORT (default: GPUFN_ADDRESS, else the running "
                "`gpufn serve` of this GPUFN_HOME).")
TOKEN_HELP = ("The cluster's token (default: GPUFN_TOKEN, else the one `gpufn serve` saved "
              "on this machine).")

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


def resolve(address: str | None, token: str | None) -> Target:
    """The scheduler to talk to, found as every gpufn client finds it
    (`gpufn.net.discovery.resolve`): --address, GPUFN_ADDRESS, then the running `gpufn
    serve` of this GPUFN_HOME. Never an embedded cluster: with none, a one-line exit."""
    from gpufn.exceptions import InvalidSpec
    from gpufn.net.discovery import resolve as discover

    try:
        target = discover(address, token, label="--address")
    except InvalidSpec as e:
        fail(str(e), 2)
    if target.embedded:
        why = f" ({target.notice}; {target.advice})" if target.notice else ""
        fail("no scheduler address: start one with `gpufn serve` (or `gpufn serve --detach`), "
             f"or pass --address / set GPUFN_ADDRESS{why}", 2)
    return target


def connect(address: str | None, token: str | None, timeout: float,
            target: Target | None = None) -> Any:
    """A `Client` for the resolved scheduler, or a one-line exit saying why not."""
    from gpufn.client.client import Client
    from gpufn.exceptions import GpufnError

    target = target or resolve(address, token)
    try:
        return Client(str(target.address), target.token, connect_timeout=timeout, target=target)
    except GpufnError as e:
        fail(f"cannot reach the scheduler at {target.address}: {type(e).__name__}: {e}")


