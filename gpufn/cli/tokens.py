"""`gpufn token create|list|update|rotate|revoke`: a cluster's users and their tokens (thin:
parse, call `gpufn.api.users`, render). A new token is the only thing printed on stdout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

from gpufn.cli import common, render
from gpufn.cli.common import ADDRESS_HELP, fail
from gpufn.exceptions import GpufnError

token_cli = typer.Typer(add_completion=False, no_args_is_help=True, help=(
    "Users and their tokens: each user sees only their own calls, results, output and "
    "usage. Needs the cluster's (admin) token."))
console = Console()
err = Console(stderr=True)

_ADDRESS = typer.Option(None, envvar="GPUFN_ADDRESS", help=ADDRESS_HELP)
_TOKEN = typer.Option(None, envvar="GPUFN_TOKEN", help=(
    "The cluster's (admin) token [saved by `gpufn serve` on this machine]."))
_JSON = typer.Option(False, "--json", help="Print JSON.")
_TIMEOUT = typer.Option(10.0, help="Seconds to wait for the scheduler.")
_NAME = typer.Argument(..., help="The user's name (letters, digits, '_', '-', '.', '@').")

T = TypeVar("T")


def _limit(text: str, option: str) -> int | None:
    """A limit option's value: a whole number, or `none` for no limit."""
    if text.strip().lower() in ("none", "no", "-"):
        return None
    try:
        return int(text)
    except ValueError:
        fail(f"{option} {text!r} must be a whole number, or none for no limit", 2)


def _ask(address: str | None, token: str | None, timeout: float,
         call: Callable[[Any], T]) -> T:
    client = common.connect(address, token, timeout)
    try:
        return call(client)
    except GpufnError as e:
        fail(f"{type(e).__name__}: {e}")
    finally:
        client.close()


def create(
    name: str = _NAME,
    operator: bool = typer.Option(False, "--operator", help="May also deploy, roll back and stop apps, and shut the cluster down."),
    max_priority: str | None = typer.Option(None, help="The highest priority the user's calls run at (higher asks run at this)."),
    max_devices: str | None = typer.Option(None, help="The most devices the user's running calls may hold at once (more wait their turn)."),
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Make a user; print their token (alone on stdout, shown only this once)."""
    from gpufn.api.users import create_user

    prio = _limit(max_priority, "--max-priority") if max_priority is not None else None
    devices = _limit(max_devices, "--max-devices") if max_devices is not None else None
    user, new = _ask(address, token, timeout, lambda c: create_user(
        name, operator=operator, max_priority=prio, max_devices=devices, client=c))
    if as_json:
        common.print_json({"user": user, "token": new})
        return
    typer.echo(new)
    err.print(f"user {name} created; give them this token over a channel you trust (the "
              "cluster keeps only its hash)", soft_wrap=True, markup=False)


def list_(
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """The users, their rights, limits and open connections (never their tokens)."""
    from gpufn.api.users import list_users

    users = _ask(address, token, timeout, lambda c: list_users(c))
    if as_json:
        common.print_json(users)
    else:
        console.print(render.users_table(users))


def update(
    name: str = _NAME,
    operator: bool | None = typer.Option(None, "--operator/--no-operator", help="Allow (or no longer allow) deploy, rollback, stop and shutdown."),
    max_priority: str | None = typer.Option(None, help="The new priority ceiling (none: no ceiling)."),
    max_devices: str | None = typer.Option(None, help="The new device cap (none: no cap)."),
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Change a user's rights or limits; in effect at once, for calls already queued too."""
    from gpufn.api.users import update_user

    changes: dict[str, Any] = {}
    if operator is not None:
        changes["operator"] = operator
    for key, text, option in (("max_priority", max_priority, "--max-priority"),
                              ("max_devices", max_devices, "--max-devices")):
        if text is not None:
            changes[key] = _limit(text, option)
    if not changes:
        fail("nothing to change: give --max-priority, --max-devices, --operator or "
             "--no-operator", 2)
    user = _ask(address, token, timeout, lambda c: update_user(name, client=c, **changes))
    if as_json:
        common.print_json(user)
    else:
        typer.echo(f"user {name} updated: operator {user['operator']}, max priority "
                   f"{user['max_priority']}, max devices {user['max_devices']}")


def rotate(
    name: str = _NAME,
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Give a user a new token (printed alone on stdout); the old one is refused from now on."""
    from gpufn.api.users import rotate_token

    if name == "admin":
        fail("the cluster's (admin) token changes with a restart: `gpufn shutdown`, then "
             "`gpufn serve --new-token` (worker hosts and clients then need the new one)", 2)
    user, new = _ask(address, token, timeout, lambda c: rotate_token(name, client=c))
    if as_json:
        common.print_json({"user": user, "token": new})
        return
    typer.echo(new)
    err.print(f"user {name} has a new token; the old one is refused from now on",
              soft_wrap=True, markup=False)


def revoke(
    name: str = _NAME,
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Remove a user: their token is refused from now on, open connections included."""
    from gpufn.api.users import revoke_user

    if name == "admin":
        fail("the cluster's (admin) token cannot be revoked; make a new one with "
             "`gpufn shutdown`, then `gpufn serve --new-token`", 2)
    data = _ask(address, token, timeout, lambda c: revoke_user(name, client=c))
    if as_json:
        common.print_json(data)
    else:
        typer.echo(f"user {name} revoked ({data['dropped']} open connection(s) closed)")


def register(app: typer.Typer) -> None:
    """Add `gpufn token ...` to the `gpufn` app."""
    token_cli.command()(create)
    token_cli.command("list")(list_)
    token_cli.command()(update)
    token_cli.command()(rotate)
    token_cli.command()(revoke)
    app.add_typer(token_cli, name="token")
