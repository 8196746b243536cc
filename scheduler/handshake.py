"""The scheduler's side of the handshake: whether a peer's Hello is accepted."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from gpufn.exceptions import AuthenticationError, GpufnError, ProtocolMismatch, kind_of
from gpufn.scheduler.app_book import AppBook
from gpufn.scheduler.records import Peer
from gpufn.wire import protocol as p


def runtimes(peers: Iterable[Peer]) -> list[dict[str, Any]]:
    """The distinct (Python, cloudpickle) versions of the workers and supervisors, with
    their nodes: a client compares them with its own when it connects."""
    seen: dict[tuple[str, str], set[str]] = {}
    for peer in peers:
        if peer.role in (p.Role.WORKER, p.Role.SUPERVISOR) and "python" in peer.info:
            key = (str(peer.info.get("python")), str(peer.info.get("cloudpickle", "")))
            seen.setdefault(key, set()).add(str(peer.info.get("node") or peer.info.get("device", "?")))
    return [{"python": py, "cloudpickle": cp, "nodes": sorted(nodes)}
            for (py, cp), nodes in seen.items()]


def refusal(msg: p.Hello, token: str | None) -> p.Welcome | None:
    """The Welcome that refuses this Hello (malformed, other protocol, wrong token), or None."""
    if not (isinstance(msg.role, str) and isinstance(msg.token, str)
            and isinstance(msg.info, dict) and isinstance(msg.pid, int)):
        return p.Welcome(False, kind_of(ProtocolMismatch),
                         "malformed Hello: role/token must be strings, info a map")
    if msg.version != p.PROTOCOL_VERSION:
        return p.Welcome(False, kind_of(ProtocolMismatch), (
            f"peer speaks gpufn protocol {msg.version}, this scheduler speaks "
            f"{p.PROTOCOL_VERSION}; install the same gpufn version everywhere"))
    if token and not hmac.compare_digest(token.encode(), (msg.token or "").encode()):
        return p.Welcome(False, kind_of(AuthenticationError), (
            "wrong or missing token: set GPUFN_TOKEN (or connect(token=...)) to the token "
            "the scheduler was started with"))
    if msg.role not in (p.Role.CLIENT, p.Role.SUPERVISOR, p.Role.WORKER):
        return p.Welcome(False, kind_of(GpufnError), f"unknown role {msg.role!r}")
    return None


# Who may send what once welcomed (messages not listed: anyone).
ROLES_ALLOWED: dict[type, frozenset[str]] = {
    p.Register: frozenset({p.Role.CLIENT}),
    p.Submit: frozenset({p.Role.CLIENT}),
    p.Cancel: frozenset({p.Role.CLIENT}),
    p.Result: frozenset({p.Role.WORKER}),
    p.Output: frozenset({p.Role.WORKER}),
    p.Heartbeat: frozenset({p.Role.WORKER}),
    p.ModelEvent: frozenset({p.Role.WORKER}),
    p.WorkerExited: frozenset({p.Role.SUPERVISOR}),
    **dict.fromkeys(AppBook.MESSAGES, frozenset({p.Role.CLIENT})),
}
