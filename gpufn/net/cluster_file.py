"""Where `gpufn serve` leaves its address (with ?key= when it encrypts) and token for local
clients and `gpufn status` ($GPUFN_HOME/cluster.json, default ~/.gpufn, owner-only), and
the token it keeps between starts (admin.token in its state directory, owner-only)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from gpufn.exceptions import GpufnError
from gpufn.wire import config


def home() -> Path:
    return config.home()


def _write_private(path: Path, text: str) -> None:
    """Write `path` (0600) whole or not at all: a full disk leaves the old file, never a
    truncated one (OSError)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that existed already
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_cluster_file(address: str, token: str, http: str | None = None) -> Path:
    path = home() / "cluster.json"
    _write_private(path, json.dumps({"address": address, "token": token, "pid": os.getpid(),
                                     **({"http": http} if http else {})}))
    return path


def load_cluster_file() -> dict[str, Any] | None:
    """The cluster file of this GPUFN_HOME, or None."""
    return read_cluster_file(home() / "cluster.json")


def read_cluster_file(path: Path) -> dict[str, Any] | None:
    """A cluster file's contents (address, token, pid), or None if absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "address" not in data:
        return None
    return data


def _saved_for(address: str) -> dict[str, Any] | None:
    """The cluster file, if `address` (with or without ?key=) is its scheduler."""
    saved = load_cluster_file()
    if saved is None or not isinstance(saved["address"], str):
        return None
    try:
        mine = config.split_address(config.normalize_address(address))[0]
        theirs = config.split_address(saved["address"])[0]
    except ValueError:
        return None
    return saved if mine == theirs else None


def saved_token(address: str) -> str | None:
    """The token `gpufn serve` on this machine left, if `address` is that scheduler."""
    saved = _saved_for(address)
    tok = saved.get("token") if saved else None
    return tok if isinstance(tok, str) and tok else None


def saved_server_key(address: str) -> str | None:
    """The CURVE public key of the scheduler `gpufn serve` on this machine runs at
    `address`, if it encrypts (its saved address carries ?key=)."""
    saved = _saved_for(address)
    return config.split_address(saved["address"])[1] if saved else None


def admin_token_file() -> Path:
    """Where `gpufn serve` keeps its (admin) token between starts: the state directory."""
    return config.state_dir() / "admin.token"


def serve_token(given: str | None, rotate: bool = False) -> tuple[str, str]:
    """The token `gpufn serve` starts with and where it came from: "given" (--token or
    GPUFN_TOKEN), "kept" (the state directory's, so a restart changes nothing for the
    clients and worker hosts that have it), or "new" (the first start, or `rotate`). It
    is saved in the state directory, owner-only, for the next start."""
    path = admin_token_file()
    token, source = given or "", "given"
    if not token and not rotate:
        try:
            token, source = path.read_text().strip(), "kept"
        except FileNotFoundError:
            token = ""
        except (OSError, UnicodeDecodeError) as e:  # never taken for no token at all
            raise GpufnError(f"cannot read the token file {path} ({e}): run `gpufn state "
                             f"restore {path}`, or give the token with --token") from None
    if not token:
        token, source = secrets.token_hex(16), "new"
    try:
        if source == "kept":
            os.chmod(path, 0o600)  # already there, whole: only its mode is checked
        else:
            _write_private(path, token + "\n")
    except OSError as e:
        raise GpufnError(f"cannot write the token file {path} ({e.strerror}): free space "
                         "on the state directory and start again") from None
    return token, source
