"""Security pieces without processes: address keys, loopback, key files, no pickle in
the scheduler."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest
import zmq

from gpufn.exceptions import InvalidSpec
from gpufn.net import curve as security
from gpufn.wire import config

ROOT = Path(__file__).resolve().parents[2]


def test_address_key_is_parsed_in_one_place() -> None:
    key = zmq.curve_keypair()[0].decode()
    assert config.split_address(f"tcp://h:1?key={key}") == ("tcp://h:1", key)
    assert config.split_address("tcp://h:1") == ("tcp://h:1", None)
    assert config.normalize_address(f"h:1?key={key}") == f"tcp://h:1?key={key}"
    assert config.address_host(f"tcp://[::1]:7?key={key}") == "::1"
    assert config.address_host("ipc:///tmp/x") == ""
    with pytest.raises(InvalidSpec, match="40-character"):
        config.split_address("tcp://h:1?key=short")
    with pytest.raises(InvalidSpec, match="only option"):
        config.split_address("tcp://h:1?token=x")


def test_loopback_and_when_curve_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFN_CURVE", raising=False)
    for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert security.is_loopback(h) and not security.needs_curve(h)
    for h in ("0.0.0.0", "*", "10.0.0.1", "::", "headnode"):
        assert not security.is_loopback(h) and security.needs_curve(h)
    assert not security.needs_curve("0.0.0.0", ipc=True)
    monkeypatch.setenv("GPUFN_CURVE", "1")
    assert security.needs_curve("127.0.0.1")


def test_key_files_are_private_even_under_umask_0(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        public, secret = security.ensure_keypair(tmp_path / "keys", "server")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pair = security.server_keys(tmp_path / "keys", create=False)
    assert len(pair.public) == 40 and len(pair.secret) == 40
    os.chmod(secret, 0o644)
    with pytest.raises(security.SecurityError, match="chmod 600"):
        security.server_keys(tmp_path / "keys", create=False)


def test_an_off_loopback_bind_needs_keys(tmp_path: Path) -> None:
    assert security.ServerSecurity.for_bind("127.0.0.1", False, None, None) is None
    assert security.ServerSecurity.for_bind("0.0.0.0", True, None, None) is None  # ipc
    with pytest.raises(security.SecurityError, match="off loopback"):
        security.ServerSecurity.for_bind("0.0.0.0", False, None, None)
    security.ensure_keypair(tmp_path, "server")
    sec = security.ServerSecurity.for_bind("10.1.2.3", False, tmp_path, None)
    assert sec is not None and sec.allow_keys is None


def test_client_key_file_is_used_and_checked(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _, secret = security.ensure_keypair(tmp_path, "me")
    monkeypatch.setenv("GPUFN_CLIENT_KEY", str(secret))
    assert security.client_keys() == security.load_keypair(secret)
    os.chmod(secret, 0o604)
    with pytest.raises(security.SecurityError, match="readable by others"):
        security.client_keys()
    monkeypatch.delenv("GPUFN_CLIENT_KEY")
    assert security.client_keys() == security.client_keys()  # one pair per process


def test_the_scheduler_never_unpickles() -> None:
    """No scheduler module imports pickle, cloudpickle or gpufn.wire.serialization: user
    payloads pass through it as opaque frames."""
    banned = {"pickle", "cloudpickle", "dill", "gpufn.wire.serialization", "marshal"}
    for path in sorted((ROOT / "scheduler").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            assert not banned & set(names), f"{path.name} imports {banned & set(names)}"
