"""The users' desk in the scheduler: `gpufn token ...` (its own message, `UserCommand`, the
admin's only), and the steps of the core that follow from who a peer is, each called
where it happens: `identify` at Hello, `denial` before an operation's handler runs,
`admit` at Submit (the user's priority ceiling and device cap), and `view` of the status
report (a user's own calls only, and why their calls wait at their cap). The placement
pass asks `caps` which calls fit under their user's device cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpufn.exceptions import (
    AuthenticationError,
    GpufnError,
    InvalidSpec,
    PermissionDenied,
    Unschedulable,
    kind_of,
)
from gpufn.scheduler.books.users import (
    ADMIN,
    DeviceCaps,
    Identity,
    UserStore,
    ceiling,
    held_devices,
    identify,
    may_operate,
    over_cap_refusal,
    sees,
)
from gpufn.scheduler.desks.surface import CoreView
from gpufn.scheduler.nouns.records import Peer
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec

OPERATOR_APP_COMMANDS = frozenset({"rollback", "stop"})  # `list` and `history` are for all
_CHANGEABLE = ("operator", "max_priority", "max_devices")

Drop = Callable[[bytes, float, str], None]


class UserDesk:
    def __init__(self, core: CoreView, store: UserStore, drop: Drop) -> None:
        self.core = core
        self.store = store
        self._drop = drop  # the core's: forget a peer (its calls end as when it leaves)
        self.caps = DeviceCaps(store)

    def handlers(self) -> dict[type, Any]:
        return {p.UserCommand: self._on_command}

    # ------------------------------------------------------------------ steps of the core

    def identify(self, msg: p.Hello) -> Identity | None:
        """Who this Hello's token belongs to (None: nobody, the Hello is refused)."""
        if not isinstance(msg.token, str):
            return None
        return identify(msg.token, self.core.config.token, self.store)

    def denial(self, peer: Peer, msg: p.Message) -> p.Message | None:
        """The reply refusing an operation this peer's token does not allow, or None."""
        if isinstance(msg, p.UserCommand):
            if peer.admin:
                return None
            why = (f"user {peer.user!r} may not manage users: `gpufn token ...` needs the "
                   "cluster's (admin) token, from the cluster file of `gpufn serve`")
            return p.AppReply(msg.request_id, False, kind_of(PermissionDenied), why)
        if isinstance(msg, p.Deploy):
            what = f"deploy app {msg.app!r}"
        elif isinstance(msg, p.Drain):
            what = "shut the cluster down"
        elif isinstance(msg, p.AppCommand) and msg.command in OPERATOR_APP_COMMANDS:
            what = f"{msg.command} app {msg.args.get('app', '')!r}"
        else:
            return None
        if may_operate(peer, self.store):
            return None
        why = (f"user {peer.user!r} may not {what}: that needs the cluster's (admin) token, "
               f"or an admin making them an operator (`gpufn token update {peer.user} "
               "--operator`)")
        return p.AppReply(msg.request_id, False, kind_of(PermissionDenied), why)

    def admit(self, peer: Peer, spec: GpuSpec, name: str) -> GpuSpec | GpufnError:
        """A submitted call's spec under its user's limits: over the priority ceiling it
        runs at the ceiling; needing more devices than the cap, it can never run."""
        user = None if peer.admin else self.store.get(peer.user)
        refused = over_cap_refusal(spec, name, user)
        if refused is not None:
            return Unschedulable(refused)
        return ceiling(spec, user)

    def view(self, status: dict[str, Any], viewer: Peer) -> dict[str, Any]:
        """The status report as `viewer` may see it: others' call rows left out (unless an
        admin), who they are, and the calls waiting at their user's device cap."""
        if not viewer.admin:
            for d in status["devices"]:
                d["running"] = [r for r in d["running"] if r.get("user") == viewer.user]
        status["you"] = {"user": viewer.user, "admin": viewer.admin}
        status["capped"] = self.capped(viewer)
        return status

    def capped(self, viewer: Peer) -> list[dict[str, Any]]:
        rows = []
        held: dict[str, float] | None = None
        for user in sorted(self.core.queue.held_users()):
            waiting = self.core.queue.held(user)
            if not waiting or not sees(viewer, user):
                continue
            if held is None:
                held = held_devices(self.core.devices.values())
            cap = self.caps.cap(user)
            holds = held.get(user, 0.0)
            rows.append({"user": user, "waiting": waiting, "holds": holds, "max_devices": cap,
                         "why": (f"{waiting} call(s) of user {user} wait their turn: their "
                                 f"running calls hold {holds:g} of the {cap} devices they may "
                                 "hold at once (max-devices)")})
        return rows

    # ------------------------------------------------------------------ gpufn token ...

    def _on_command(self, peer: bytes, msg: p.UserCommand, now: float) -> None:
        try:
            data = self._command(msg.command, msg.args, now)
        except GpufnError as e:
            self.core.send(peer, p.AppReply(msg.request_id, False, kind_of(e), str(e)))
            return
        self.core.send(peer, p.AppReply(msg.request_id, True, data=data))

    def _command(self, command: str, args: dict[str, Any], now: float) -> dict[str, Any]:
        kind = p.UserCommandKind
        name = str(args.get("name", ""))
        if command == kind.LIST:
            return {"users": self._list()}
        if command == kind.CREATE:
            user, token = self.store.create(
                name, self.core.wall(now), bool(args.get("operator", False)),
                args.get("max_priority"), args.get("max_devices"))
            return {"user": user.public(), "token": token}
        if command == kind.REVOKE:
            user = self.store.revoke(name)
            dropped = self._disconnect(name, now, "was revoked")
            return {"user": user.public(), "dropped": dropped}
        if command == kind.ROTATE:
            user, token = self.store.rotate(name)
            dropped = self._disconnect(name, now, "was replaced (`gpufn token rotate`)")
            return {"user": user.public(), "token": token, "dropped": dropped}
        if command == kind.UPDATE:
            changes = {k: args[k] for k in _CHANGEABLE if k in args}
            if not changes:
                raise InvalidSpec("nothing to change: give --max-priority, --max-devices, "
                                  "--operator or --no-operator")
            user = self.store.update(name, changes)
            self.core.tx.dirty = True  # calls waiting at the old cap may fit now
            return {"user": user.public()}
        raise InvalidSpec(f"unknown user command {command!r}; use "
                          + ", ".join(k.value for k in kind))

    def _list(self) -> list[dict[str, Any]]:
        connected: dict[str, int] = {}
        for peer in self.core.peers.values():
            if peer.role == p.Role.CLIENT:
                connected[peer.user] = connected.get(peer.user, 0) + 1
        admin = {"name": ADMIN, "admin": True, "operator": True, "created": None,
                 "max_priority": None, "max_devices": None}
        rows = [admin] + [{**u.public(), "admin": False} for u in self.store.users()]
        for row in rows:
            row["connections"] = connected.get(str(row["name"]), 0)
        return rows

    def _disconnect(self, name: str, now: float, why: str) -> int:
        """Forget every connection of user `name` (its token no longer holds): each is
        told so and, saying Hello again, is refused; its calls end as when it leaves."""
        peers = [k for k, v in self.core.peers.items() if v.user == name and not v.admin]
        for k in peers:
            self._drop(k, now, f"its token {why}")
            self.core.send(k, p.Error(kind_of(AuthenticationError), (
                f"this connection's token {why}; connect again with a current token")))
        self.core.tx.dirty = True
        return len(peers)
