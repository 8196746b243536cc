"""The scheduler's side of the handshake: whether a peer's Hello is accepted, who may send
what once it is (the one role table), and the merge of the core's and desks' handlers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gpufn.exceptions import AuthenticationError, GpufnError, ProtocolMismatch, kind_of
from gpufn.scheduler.books.users import Identity
from gpufn.scheduler.nouns.records import Peer
from gpufn.wire import protocol as p


def runtimes(peers: Iterable[Peer]) -> list[dict[str, Any]]:
    """The distinct (Python, cloudpickle) versions of the workers and supervisors, with
    their nodes: a client compares them with its own when it connects."""
    seen: dict[tuple[str, str], set[str]] = {}
    for peer in peers:
        if peer.role in (p.Role.WORKER, p.Role.SUPERVISOR) and peer.info.python:
            key = (peer.info.python, peer.info.cloudpickle)
            seen.setdefault(key, set()).add(peer.info.node or peer.info.device or "?")
    return [{"python": py, "cloudpickle": cp, "nodes": sorted(nodes)}
            for (py, cp), nodes in seen.items()]


def refusal(msg: p.Hello, who: Identity | None) -> p.Welcome | None:
    """The Welcome that refuses this Hello (malformed, other protocol, a token that is
    nobody's, a user's token for a worker host), or None. `who` is the token's holder
    (`users.identify`), None if it is nobody's."""
    if not (isinstance(msg.role, str) and isinstance(msg.token, str)
            and isinstance(msg.info, p.HelloInfo) and isinstance(msg.pid, int)):
        return p.Welcome(False, kind_of(ProtocolMismatch),
                         "malformed Hello: role/token must be strings, info a map")
    if msg.version != p.PROTOCOL_VERSION:
        return p.Welcome(False, kind_of(ProtocolMismatch), (
            f"peer speaks gpufn protocol {msg.version}, this scheduler speaks "
            f"{p.PROTOCOL_VERSION}; install the same gpufn version everywhere"))
    if who is None:
        return p.Welcome(False, kind_of(AuthenticationError), (
            "wrong, missing or revoked token: set GPUFN_TOKEN (or connect(token=...)) to the "
            "cluster's token (in the cluster file of `gpufn serve`) or to a user's token from "
            "`gpufn token create`"))
    if msg.role not in (p.Role.CLIENT, p.Role.SUPERVISOR, p.Role.WORKER):
        return p.Welcome(False, kind_of(GpufnError), f"unknown role {msg.role!r}")
    if msg.role != p.Role.CLIENT and not who.admin:  # a worker sees every user's calls
        return p.Welcome(False, kind_of(AuthenticationError), (
            f"user {who.user!r}'s token admits clients only: worker hosts join with the "
            "cluster's token (in the cluster file of `gpufn serve` on the head)"))
    return None


# Who may send what once welcomed. Every message a peer may send is listed: the core
# checks this table once, before any handler runs.
_CLIENT, _WORKER = frozenset({p.Role.CLIENT}), frozenset({p.Role.WORKER})
_ANYONE = frozenset({p.Role.CLIENT, p.Role.WORKER, p.Role.SUPERVISOR})
ROLES_ALLOWED: dict[type, frozenset[str]] = {
    p.Hello: _ANYONE, p.Ping: _ANYONE, p.Goodbye: _ANYONE,
    p.Register: _CLIENT, p.Submit: _CLIENT, p.Cancel: _CLIENT, p.StatusRequest: _CLIENT,
    p.Query: _CLIENT, p.Drain: _CLIENT, p.Deploy: _CLIENT, p.Lookup: _CLIENT,
    p.AppCommand: _CLIENT, p.Credit: _CLIENT, p.Attach: _CLIENT, p.UserCommand: _CLIENT,
    p.Result: _WORKER, p.Output: _WORKER, p.Heartbeat: _WORKER, p.ModelEvent: _WORKER,
    p.Item: _WORKER, p.LeaseOverrun: _WORKER,
    p.LeaseReport: frozenset({p.Role.WORKER, p.Role.CLIENT}),
    p.WorkerExited: frozenset({p.Role.SUPERVISOR}),
}

Handler = Callable[[bytes, Any, float], None]


def merge_handlers(*tables: dict[type, Handler]) -> dict[type, Handler]:
    """One handler per message type, from the core and each desk; a message type claimed
    twice, or one the role table does not list, is a programming error."""
    out: dict[type, Handler] = {}
    for table in tables:
        for kind, handler in table.items():
            if kind in out:
                raise TypeError(f"two handlers for {kind.__name__}")
            if kind not in ROLES_ALLOWED:
                raise TypeError(f"{kind.__name__} has a handler but no entry in ROLES_ALLOWED")
            out[kind] = handler
    return out
