"""CURVE keys and who may connect: key files with safe modes, when a bind must be
encrypted, the keys a peer presents, and the ZAP allow-list (pyzmq's `zmq.auth`)."""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from gpufn.exceptions import GpufnError
from gpufn.wire import config

log = logging.getLogger("gpufn.net.curve")

SERVER_KEY_NAME = "server"
LOCAL_KEY_NAME = "local"  # this host's own supervisor and workers, admitted with --allow-keys


class SecurityError(GpufnError):
    """A key file is missing, unsafe or malformed, or a bind would run unencrypted."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes


def keys_dir() -> Path:
    return config.state_dir() / "keys"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: traffic that never leaves this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def needs_curve(host: str, ipc: bool = False) -> bool:
    """Whether a bind on `host` must be encrypted: anything off loopback over TCP, or any
    TCP bind when GPUFN_CURVE=1. A Unix socket (ipc) never leaves the host and is guarded
    by its folder's mode, so it stays on the token alone."""
    if ipc:
        return False
    return config.curve_forced() or not is_loopback(host)


# ------------------------------------------------------------------ key files


def check_private(path: Path) -> None:
    """Refuse a secret key file that group or others may read (or write)."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise SecurityError(f"cannot read the CURVE secret key {path}: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(
            f"the CURVE secret key {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"fix it with: chmod 600 {path}")


def _make_private_dir(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # mkdir's mode is masked by the umask, and an old folder keeps its own


def ensure_keypair(d: Path, name: str) -> tuple[Path, Path]:
    """`d/name.key` (public, 0644) and `d/name.key_secret` (0600), made on first use.

    pyzmq's `create_certificates` writes both with the umask's modes, so the secret is
    written under a 0077 umask and both modes are set afterwards.
    """
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    if secret.exists() and public.exists():
        return public, secret
    _make_private_dir(d)
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    log.info("made a CURVE key pair %s", secret)
    return public, secret


def load_keypair(secret_file: Path) -> KeyPair:
    """A secret key file (pyzmq certificate format), after checking its mode."""
    check_private(secret_file)
    try:
        public, secret = zmq.auth.load_certificate(str(secret_file))
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot load the CURVE key {secret_file}: {e}") from None
    if not secret:
        raise SecurityError(f"{secret_file} holds no secret key (is it the public .key file?)")
    return KeyPair(public, secret)


def server_keys(d: Path, create: bool) -> KeyPair:
    """The scheduler's key pair in `d` (made if `create`)."""
    if create:
        ensure_keypair(d, SERVER_KEY_NAME)
    secret = d / f"{SERVER_KEY_NAME}.key_secret"
    if not secret.exists():
        raise SecurityError(
            f"no CURVE key pair in {d}: a scheduler bound off loopback encrypts its traffic "
            "and needs one (`gpufn serve` makes it on first start)")
    return load_keypair(secret)


_ephemeral: tuple[int, KeyPair] | None = None
_ephemeral_lock = threading.Lock()


def client_keys() -> KeyPair:
    """What this process presents as a CURVE client: GPUFN_CLIENT_KEY's key pair, else
    one made for this process (a fresh pair after fork)."""
    global _ephemeral
    path = config.client_key_file()
    if path is not None:
        return load_keypair(path)
    with _ephemeral_lock:
        if _ephemeral is None or _ephemeral[0] != os.getpid():
            _ephemeral = (os.getpid(), KeyPair(*zmq.curve_keypair()))
        return _ephemeral[1]


# ------------------------------------------------------------------ the scheduler's side


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """How a scheduler socket is secured: its key pair, and optionally an allow-list."""

    keys: KeyPair
    allow_keys: Path | None = None
    extra_allowed: frozenset[bytes] = frozenset()  # this host's own peers (local.key)

    @classmethod
    def for_bind(cls, host: str, ipc: bool, keys: Path | None,
                 allow_keys: Path | None) -> ServerSecurity | None:
        """The security a bind needs, or None for token-only (loopback, ipc). Refuses an
        off-loopback bind without keys, and an allow-list without encryption's keys."""
        if not (needs_curve(host, ipc) or allow_keys is not None):
            return None
        if ipc:
            raise SecurityError("CURVE is for TCP binds; a Unix socket is guarded by its "
                                "folder's mode")
        if keys is None:
            why = ("--allow-keys needs CURVE" if allow_keys is not None and is_loopback(host)
                   else f"a scheduler bound to {host} (off loopback) must encrypt with CURVE")
            raise SecurityError(f"{why}, and no key folder was given: start it with "
                                "`gpufn serve`, which makes the keys on first start")
        pair = server_keys(keys, create=False)
        extra = {pair.public}
        local = keys / f"{LOCAL_KEY_NAME}.key"
        if allow_keys is not None and local.exists():
            extra.add(zmq.auth.load_certificate(str(local))[0])
        return cls(pair, allow_keys, frozenset(extra))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Before bind: this socket is a CURVE server with our key pair."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public

    def start_auth(self, ctx: zmq.Context[Any]) -> Any:
        """The ZAP allow-list for `ctx` if one was asked for, else None (then any client
        key completes the handshake, and the token in Hello decides)."""
        if self.allow_keys is None:
            return None
        return start_allow_list(ctx, self.allow_keys, set(self.extra_allowed))


# ------------------------------------------------------------------ who may connect


class _KeyFolder:
    """ZAP credentials provider: the public keys (`*.key`) in a folder, re-read when the
    folder changes, plus a fixed set (this host's own peers)."""

    def __init__(self, folder: Path, extra: set[bytes]) -> None:
        self.folder, self.extra = folder, extra
        self._mtime = -1.0
        self._keys: set[bytes] = set()
        self._lock = threading.Lock()

    def keys(self) -> set[bytes]:
        with self._lock:
            try:
                mtime = self.folder.stat().st_mtime
            except OSError:
                mtime = -1.0
            if mtime != self._mtime:
                self._mtime = mtime
                try:
                    self._keys = set(zmq.auth.load_certificates(str(self.folder)))
                except (OSError, ValueError) as e:
                    log.error("cannot read allowed keys in %s: %s", self.folder, e)
                    self._keys = set()
            return self._keys | self.extra

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys()
        if not ok:
            log.warning("refused a CURVE client key not in %s: %s", self.folder, key.decode())
        return ok


def start_allow_list(ctx: zmq.Context[Any], folder: Path, extra: set[bytes]) -> Any:
    """A ZAP handler on `ctx` admitting only CURVE clients whose public key is in `folder`
    or `extra`; returns the running `ThreadAuthenticator` (stop it before `ctx.term()`)."""
    from zmq.auth.thread import ThreadAuthenticator

    if not folder.is_dir():
        raise SecurityError(f"--allow-keys {folder}: not a folder of public .key files")
    provider = _KeyFolder(folder, extra)
    if not provider.keys() - extra:
        log.warning("--allow-keys %s holds no *.key files: only this host's peers may connect",
                    folder)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("gpufn.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=provider)
    return auth
