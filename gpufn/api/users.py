"""A cluster's users, from Python (what `gpufn token ...` calls): create a user and their
token, list users (never tokens), change their limits, rotate or revoke their token. Each
needs the cluster's (admin) token; the scheduler keeps only the tokens' hashes."""

from __future__ import annotations

from typing import Any

from gpufn.client.client import Client
from gpufn.client.default import get_client
from gpufn.wire import protocol as p

K = p.UserCommandKind


def _command(kind: p.UserCommandKind, client: Client | None, **args: Any) -> dict[str, Any]:
    client = client or get_client()
    return client.ask(lambda rid: p.UserCommand(rid, kind.value, args))


def create_user(name: str, *, operator: bool = False, max_priority: int | None = None,
                max_devices: int | None = None,
                client: Client | None = None) -> tuple[dict[str, Any], str]:
    """A new user and their token (shown this once: the scheduler keeps only its hash).
    `operator` lets them deploy, roll back, stop apps and shut down; `max_priority` is the
    highest priority their calls run at; `max_devices` the most devices their running
    calls hold at once."""
    data = _command(K.CREATE, client, name=name, operator=operator,
                    max_priority=max_priority, max_devices=max_devices)
    return data["user"], str(data["token"])


def list_users(client: Client | None = None) -> list[dict[str, Any]]:
    """Every user (the admin first) with their rights, limits and open connections."""
    return list(_command(K.LIST, client)["users"])


def update_user(name: str, client: Client | None = None, **changes: Any) -> dict[str, Any]:
    """Change `operator`, `max_priority` or `max_devices` (None: no limit); in effect at once."""
    return dict(_command(K.UPDATE, client, name=name, **changes)["user"])


def rotate_token(name: str, client: Client | None = None) -> tuple[dict[str, Any], str]:
    """A new token for a user, who keeps their name, limits and usage; the old token is
    refused from now on (their open connections are closed)."""
    data = _command(K.ROTATE, client, name=name)
    return data["user"], str(data["token"])


def revoke_user(name: str, client: Client | None = None) -> dict[str, Any]:
    """Remove a user: their token is refused from now on (open connections are closed,
    and their calls end as when a client leaves)."""
    return _command(K.REVOKE, client, name=name)
