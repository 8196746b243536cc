"""Who a peer is, and what that allows: the user store (tokens kept only as sha256 hashes,
in `users.json` of the state directory, 0600), the identity a Hello's token resolves to,
and the rules that follow from it (a user sees only their own calls; operations need the
admin or an operator; a user's priority ceiling and device cap).

The cluster's own token (`SchedulerConfig.token`, the one `gpufn serve` makes) is the
admin's and is never stored here; with no store (an embedded cluster) it is the only one.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from gpufn.exceptions import GpufnError, InvalidSpec, NotFound
from gpufn.net import backups
from gpufn.scheduler.nouns.records import Device, Invocation, Peer
from gpufn.wire.spec import GpuSpec

log = logging.getLogger("gpufn.scheduler")

ADMIN = "admin"  # the holder of the cluster's token; no user may take the name
FILE_NAME = "users.json"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")
MAX_PRIORITY_BOUND = 10**6  # |max-priority| at most this (a spec's priority is an int)


class UserStoreError(GpufnError):
    """The user store cannot be read or written (a corrupt or unreadable users.json)."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a token belongs to, as the scheduler decided it at Hello."""

    user: str
    admin: bool = False


@dataclass(slots=True)
class User:
    """One user: their token's hash, what they may do, and their limits."""

    name: str
    token_sha256: str
    created: float = 0.0
    operator: bool = False  # may deploy, roll back, stop apps and shut the cluster down
    max_priority: int | None = None  # a call asking for more runs at this priority
    max_devices: int | None = None  # devices their running calls may hold at once

    def public(self) -> dict[str, Any]:
        """What `gpufn token list` shows: everything but the hash."""
        out = asdict(self)
        del out["token_sha256"]
        return out


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_hex(24)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidSpec(f"user name {name!r}: use 1-64 letters, digits, '_', '-', '.' or '@'")
    if name == ADMIN:
        raise InvalidSpec(f"{ADMIN!r} is the holder of the cluster's token; pick another name")
    return name


def check_limit(name: str, value: Any) -> int | None:
    """A limit as given to `token create/update`: an int in range, or None (no limit)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(f"{name}={value!r} must be a whole number (or none for no limit)")
    if name == "max_devices" and value < 1:
        raise InvalidSpec(f"max_devices={value} must be at least 1 (or none for no limit)")
    if name == "max_priority" and abs(value) > MAX_PRIORITY_BOUND:
        raise InvalidSpec(f"max_priority={value} is out of range (at most {MAX_PRIORITY_BOUND})")
    return value


class UserStore:
    """Users by name, kept in a JSON file (written atomically, 0600); `path` None keeps
    them in memory (unit tests, embedded clusters that never create users)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._users: dict[str, User] = {}
        if path is not None and path.exists():
            self._load(path)

    @classmethod
    def in_state_dir(cls, state_dir: str) -> UserStore:
        return cls(Path(state_dir) / FILE_NAME if state_dir else None)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            known = {f.name for f in fields(User)}
            users = [User(**{k: v for k, v in u.items() if k in known}) for u in data["users"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserStoreError(
                f"cannot read the user store {path}: {type(e).__name__}: {e}; restore it from "
                "a backup, or remove it (every user's token then stops working)") from None
        self._users = {u.name: u for u in users}
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        data = {"version": 1, "users": [asdict(u) for u in self._users.values()]}
        text = json.dumps(data, indent=1)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UserStoreError(f"cannot write the user store {self.path}: {e}"
                                 + (" (no space left on the state directory's disk)"
                                    if e.errno == errno.ENOSPC else "")) from None
        try:  # for `gpufn state restore` (docs/reliability.md, "A damaged state file")
            backups.backup_bytes(text.encode(), self.path)
        except OSError as e:
            log.warning("could not back up %s: %s", self.path, e)

    # ------------------------------------------------------------------ reading

    def resolve(self, token: str) -> User | None:
        """The user this token belongs to (every stored hash is compared, in constant time)."""
        digest = _digest(token)
        found = None
        for u in self._users.values():
            if hmac.compare_digest(u.token_sha256, digest):
                found = u
        return found

    def get(self, name: str) -> User | None:
        return self._users.get(name)

    def users(self) -> list[User]:
        return sorted(self._users.values(), key=lambda u: u.name)

    def __len__(self) -> int:
        return len(self._users)

    def capped(self) -> bool:
        """Whether any user has a device cap (placement then counts what users hold)."""
        return any(u.max_devices is not None for u in self._users.values())

    # ------------------------------------------------------------------ changing

    def create(self, name: str, created: float, operator: bool = False,
               max_priority: int | None = None, max_devices: int | None = None) -> tuple[User, str]:
        """A new user and their token (the token is returned once and never stored)."""
        check_name(name)
        if name in self._users:
            raise InvalidSpec(f"user {name!r} exists already; `gpufn token rotate {name}` "
                              "gives them a new token")
        token = new_token()
        user = User(name, _digest(token), created, bool(operator),
                    check_limit("max_priority", max_priority),
                    check_limit("max_devices", max_devices))
        self._users[name] = user
        self._save()
        return user, token

    def _known(self, name: str) -> User:
        user = self._users.get(name)
        if user is None:
            raise NotFound(f"no user {name!r}; users: {', '.join(self._users) or 'none yet'}")
        return user

    def revoke(self, name: str) -> User:
        user = self._known(name)
        del self._users[name]
        self._save()
        return user

    def rotate(self, name: str) -> tuple[User, str]:
        user = self._known(name)
        token = new_token()
        user.token_sha256 = _digest(token)
        self._save()
        return user, token

    def update(self, name: str, changes: dict[str, Any]) -> User:
        """Change `operator`, `max_priority` and/or `max_devices` (None clears a limit)."""
        user = self._known(name)
        unknown = set(changes) - {"operator", "max_priority", "max_devices"}
        if unknown:
            raise InvalidSpec(f"cannot change {', '.join(sorted(unknown))} of a user")
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            checked[key] = bool(value) if key == "operator" else check_limit(key, value)
        for key, value in checked.items():
            setattr(user, key, value)
        self._save()
        return user


# --------------------------------------------------------------------------- the rules


def identify(token: str, admin_token: str | None, store: UserStore) -> Identity | None:
    """Who presents `token`: the admin (the cluster's token), a stored user, or nobody
    (None: refused). A cluster started without a token admits everyone as its admin."""
    if admin_token and hmac.compare_digest(admin_token.encode(), token.encode()):
        return Identity(ADMIN, admin=True)
    user = store.resolve(token) if token and len(store) else None
    if user is not None:
        return Identity(user.name)
    if not admin_token:
        return Identity(ADMIN, admin=True)
    return None


def sees(viewer: Peer | None, owner: str) -> bool:
    """Whether `viewer` may see and act on a call of user `owner`: their own, or any for
    an admin. Another user's call must look exactly like an unknown one."""
    return viewer is not None and (viewer.admin or viewer.user == owner)


def may_operate(viewer: Peer, store: UserStore) -> bool:
    """Deploy, roll back, stop apps, shut down: the admin, or a user made an operator."""
    if viewer.admin:
        return True
    user = store.get(viewer.user)
    return user is not None and user.operator


def ceiling(spec: GpuSpec, user: User | None) -> GpuSpec:
    """The call's spec with its priority lowered to the user's ceiling, if above it."""
    if user is None or user.max_priority is None or spec.priority <= user.max_priority:
        return spec
    return replace(spec, priority=user.max_priority)


def device_share(inv: Invocation) -> Iterable[tuple[str, float]]:
    """(user, devices) a running call holds, as usage meters it: a batch's devices are
    shared by its calls."""
    held = len(inv.devices)
    if inv.members:
        for m in inv.members:
            yield m.user, held / len(inv.members)
    elif inv.carrier is None:
        yield inv.user, float(held)


def held_devices(devices: Iterable[Device]) -> dict[str, float]:
    """Devices each user's running calls hold now (a gang of 4 holds 4)."""
    seen: set[str] = set()
    out: dict[str, float] = {}
    for d in devices:
        for inv in d.running.values():
            if inv.id in seen:
                continue
            seen.add(inv.id)
            for user, n in device_share(inv):
                out[user] = out.get(user, 0.0) + n
    return out


class DeviceCaps:
    """The device caps in one placement pass: what each user holds at its start, plus
    what the pass dispatched since. A call that would take its user over the cap waits
    (held aside by the queue, so the calls of other users behind it are not blocked)."""

    def __init__(self, store: UserStore) -> None:
        self.store = store
        self.held: dict[str, float] = {}

    def begin(self, devices: Iterable[Device]) -> bool:
        """Start a pass; False when no user has a cap (nothing to check)."""
        if not self.store.capped():
            self.held = {}
            return False
        self.held = held_devices(devices)
        return True

    def cap(self, user: str) -> int | None:
        u = self.store.get(user)
        return u.max_devices if u is not None else None

    def room(self, user: str) -> float:
        cap = self.cap(user)
        return float("inf") if cap is None else cap - self.held.get(user, 0.0)

    def admits(self, inv: Invocation) -> bool:
        return inv.spec.count <= self.room(inv.user)

    def took(self, inv: Invocation) -> None:
        """The pass dispatched `inv`: its user holds its devices from now on."""
        self.held[inv.user] = self.held.get(inv.user, 0.0) + inv.spec.count


def over_cap_refusal(spec: GpuSpec, name: str, user: User | None) -> str | None:
    """Why a call can never run under its user's device cap (it needs more than the cap)."""
    if user is None or user.max_devices is None or spec.count <= user.max_devices:
        return None
    return (f"{name} needs {spec.count} devices at once, but user {user.name!r} may hold at "
            f"most {user.max_devices} (max-devices); ask an admin to raise it with `gpufn "
            f"token update {user.name} --max-devices {spec.count}`")
