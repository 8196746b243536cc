"""The scheduler's side of the handshake: whether a peer's Hello is accepted."""

from __future__ import annotations

import hmac

from gpufn import protocol as p
from gpufn.exceptions import AuthenticationError, GpufnError, ProtocolMismatch, kind_of


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
