"""Security: CURVE off loopback, the token inside the encrypted channel, the ZAP
allow-list, key file modes, and refusals (see gpufn/net/curve.py).

The attacks send Hello, Register and Submit at once, without waiting to be welcomed, and
the function would write a sentinel file: each refused peer must leave it absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

import gpufn
from gpufn.api.calls import decode_result
from gpufn.cluster.embedded import LocalCluster
from gpufn.net import curve as security
from gpufn.net.connection import Connection, ConnectionConfig
from gpufn.wire import config
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser

from ..conftest import assert_all_gone

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update({"GPUFN_HOME": str(home), "GPUFN_PROGRESS": "0", "GPUFN_CPU_DEVICES": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}, **extra)
    return env


def _gpufn() -> list[str]:
    return [sys.executable, "-m", "gpufn.cli.main"]


def _by_value() -> tuple[Any, Any]:
    """The remote functions, made in a closure so they travel by value."""

    def touch(path: str) -> str:  # the sentinel: writes the file it is given
        with open(path, "w") as f:
            f.write("ran")
        return path

    def echo(x: str) -> str:
        return x

    return gpufn.gpu(touch), gpufn.gpu(echo)


TOUCH, ECHO = _by_value()


def _call(c: gpufn.Client, fn: Any, arg: str) -> Any:
    reg = fn.register_message()
    sub = p.Submit(c.new_id(), reg.function_id, {}, frames=tuple(ser.dump_args(fn.name, (arg,), {})))
    return decode_result(c.call(reg, sub, fn.name), fn.name)


@contextlib.contextmanager
def _serve(home: Path, *args: str, umask: int | None = None) -> Iterator[tuple[str, list[str]]]:
    """`gpufn serve --port 0 ARGS` with GPUFN_HOME=home: (printed address, output lines)."""
    proc = subprocess.Popen(
        [*_gpufn(), "serve", "--port", "0", "--cpu-devices", "1", *args], env=_env(home),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)  # type: ignore[misc]
    assert proc.stdout is not None
    lines: list[str] = []
    address = ""
    try:
        while not (lines and "connect with" in lines[-1]):
            line = proc.stdout.readline()
            if not line:
                raise AssertionError("gpufn serve exited:\n" + "".join(lines))
            lines.append(line)
            if m := re.search(r"listening on (tcp://\S+)", line):
                address = m.group(1)
        yield address, lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if address:
            port = config.split_address(address)[0].rsplit(":", 1)[1]
            out = subprocess.run(["pgrep", "-f", f":{port}"], capture_output=True,
                                 text=True).stdout.split()
            assert_all_gone([int(x) for x in out])


def _key_of(address: str) -> str:
    key = config.split_address(address)[1]
    assert key is not None, address
    return key


def _local(address: str, key: str | None) -> str:
    """The printed address, reached through loopback (the printed host is this host's name)."""
    port = config.split_address(address)[0].rsplit(":", 1)[1]
    return config.join_address(f"tcp://127.0.0.1:{port}", key)


@contextlib.contextmanager
def _client_key(monkeypatch: pytest.MonkeyPatch, secret: Path | None) -> Iterator[None]:
    """Present this key pair (None: a fresh one) as a CURVE client."""
    if secret is None:
        monkeypatch.delenv("GPUFN_CLIENT_KEY", raising=False)
        monkeypatch.setattr(security, "_ephemeral", None)
    else:
        monkeypatch.setenv("GPUFN_CLIENT_KEY", str(secret))
    yield


def _attack(address: str, token: str, sentinel: Path) -> BaseException | None:
    """Hello + Register + Submit(TOUCH(sentinel)) at once, then Hello again and wait for
    its answer (the scheduler handles a connection's messages in order, so by then the
    Submit was handled). Returns the error the handshake raised (None: welcomed)."""
    ctx = zmq.Context()
    conn = Connection(ctx, ConnectionConfig(address, token), f"c/attack/{uuid.uuid4().hex[:8]}",
                      p.Role.CLIENT)
    reg = TOUCH.register_message()
    sub = p.Submit(uuid.uuid4().hex, reg.function_id, {},
                   frames=tuple(ser.dump_args(TOUCH.name, (str(sentinel),), {})))
    try:
        for m in (conn.hello_message(), reg, sub):
            conn.sock.send_multipart(p.encode(m))
        try:
            early = conn.handshake(20)  # the answer to the first Hello (or a refusal)
        except gpufn.GpufnError as e:
            if "token" in str(e):  # refused by the scheduler itself, not below the protocol
                conn.hello()  # answered after the Submit: then the Submit was handled
                _wait_for(conn, p.Welcome, 20)
            return e
        # Welcomed (the control case): wait until the call has run.
        if not any(isinstance(m, p.Result) for m in early):
            _wait_for(conn, p.Result, 90)
        return None
    finally:
        conn.close()
        ctx.term()


def _wait_for(conn: Connection, kind: type, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while conn.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        if any(isinstance(m, kind) for m in p.decode_all(conn.sock.recv_multipart())):
            return
    raise AssertionError(f"no {kind.__name__} from the scheduler within {timeout}s")


# ------------------------------------------------------------------ a CURVE server


@pytest.fixture(scope="module")
def curve_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`gpufn serve --host 0.0.0.0 --allow-keys DIR` (off loopback: CURVE by policy), with
    one allowed client key ("friend") and one not ("stranger"), started under umask 0."""
    home = tmp_path_factory.mktemp("home")
    allowed = tmp_path_factory.mktemp("allowed")
    mine = tmp_path_factory.mktemp("clientkeys")
    security.ensure_keypair(mine, "friend")
    security.ensure_keypair(mine, "stranger")
    shutil.copy(mine / "friend.key", allowed / "friend.key")
    with _serve(home, "--host", "0.0.0.0", "--allow-keys", str(allowed), umask=0) as (addr, out):
        token = json.loads((home / "cluster.json").read_text())["token"]
        yield {"home": home, "address": addr, "key": _key_of(addr), "token": token,
               "output": "".join(out), "friend": mine / "friend.key_secret",
               "stranger": mine / "stranger.key_secret"}


def test_serve_makes_private_keys_and_prints_no_token(curve_server: dict[str, Any]) -> None:
    home: Path = curve_server["home"]
    keys = home / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / "server.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((keys / "server.key").stat().st_mode) == 0o644
    assert stat.S_IMODE((home / "cluster.json").stat().st_mode) == 0o600
    public, _ = zmq.auth.load_certificate(keys / "server.key")
    assert curve_server["key"] == public.decode()  # the printed ?key= is the server's
    assert curve_server["token"] not in curve_server["output"]
    assert str(home / "cluster.json") in curve_server["output"]


def test_the_allowed_key_with_the_token_runs(curve_server: dict[str, Any], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same attack with every credential right does execute."""
    sentinel = tmp_path / "ran"
    with _client_key(monkeypatch, curve_server["friend"]):
        assert _attack(_local(curve_server["address"], curve_server["key"]),
                       curve_server["token"], sentinel) is None
    assert sentinel.exists()  # _attack waited for the call's Result


@pytest.mark.parametrize("case", ["wrong token", "no token", "stranger key", "wrong server key",
                                  "plaintext"])
def test_a_refused_peer_executes_nothing(case: str, curve_server: dict[str, Any],
                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = tmp_path / "ran"
    key, token, secret = curve_server["key"], curve_server["token"], curve_server["friend"]
    if case == "wrong token":
        token = "not-the-token"
    elif case == "no token":
        token = ""
    elif case == "stranger key":
        secret = curve_server["stranger"]
    elif case == "wrong server key":
        key = zmq.curve_keypair()[0].decode()
    elif case == "plaintext":
        key = None
    address = _local(curve_server["address"], key)
    t0 = time.monotonic()
    with _client_key(monkeypatch, secret):
        err = _attack(address, token, sentinel)
        assert err is not None, "refused peer was welcomed"
        assert isinstance(err, gpufn.AuthenticationError), err
        if case == "plaintext":
            assert "CURVE" in str(err)
        assert time.monotonic() - t0 < 15, "refusal took too long"
        # A real client gets the same error class from the constructor.
        with pytest.raises(type(err)):
            gpufn.Client(address, token, connect_timeout=15)
    # Then a welcomed client's call runs on the one worker: had the attack's Submit been
    # accepted, it would have been queued before this one.
    monkeypatch.setenv("GPUFN_CLIENT_KEY", str(curve_server["friend"]))
    good = gpufn.Client(_local(curve_server["address"], curve_server["key"]),
                        curve_server["token"], connect_timeout=20)
    try:
        assert _call(good, TOUCH, str(tmp_path / "ok")) == str(tmp_path / "ok")
    finally:
        good.close()
    assert (tmp_path / "ok").exists() and not sentinel.exists()


# ------------------------------------------------------------------ what is on the wire


class RecordingProxy:
    """A TCP forwarder that keeps every byte it carries (both directions)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socks: dict[socket.socket, socket.socket] = {}
        self.listener.setblocking(False)
        while not self._stop:
            ready, _, _ = select.select([self.listener, *socks], [], [], 0.1)
            for s in ready:
                if s is self.listener:
                    a, _ = self.listener.accept()
                    b = socket.create_connection(self.upstream)
                    socks[a], socks[b] = b, a
                    continue
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    peer = socks.pop(s)
                    socks.pop(peer, None)
                    s.close()
                    peer.close()
                    continue
                self.seen += data
                socks[s].sendall(data)
        for s in socks:
            s.close()
        self.listener.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)


def test_a_proxy_never_sees_a_marker_under_curve(curve_server: dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    port = int(config.split_address(curve_server["address"])[0].rsplit(":", 1)[1])
    marker = "MARKER-" + uuid.uuid4().hex
    proxy = RecordingProxy(("127.0.0.1", port))
    monkeypatch.setenv("GPUFN_CLIENT_KEY", str(curve_server["friend"]))
    try:
        c = gpufn.Client(f"tcp://127.0.0.1:{proxy.port}?key={curve_server['key']}",
                         curve_server["token"], connect_timeout=20)
        try:
            assert _call(c, ECHO, marker) == marker  # it went through, and came back
        finally:
            c.close()
    finally:
        proxy.close()
    assert len(proxy.seen) > 1000  # the call went through the proxy
    assert marker.encode() not in proxy.seen
    assert curve_server["token"].encode() not in proxy.seen


def test_the_proxy_does_see_a_marker_in_plaintext() -> None:
    """The control: the same proxy against a loopback (token-only) scheduler sees it."""
    cluster = LocalCluster(transport="tcp", workers=False)
    address, token = cluster.start()
    try:
        assert config.split_address(address)[1] is None  # loopback stays plaintext
        port = int(address.rsplit(":", 1)[1])
        marker = "MARKER-" + uuid.uuid4().hex
        proxy = RecordingProxy(("127.0.0.1", port))
        try:
            c = gpufn.Client(f"tcp://127.0.0.1:{proxy.port}", token, connect_timeout=20)
            try:
                reg = ECHO.register_message()
                c.ensure_registered(reg)
                c.submit(p.Submit(c.new_id(), reg.function_id, {},
                                  frames=tuple(ser.dump_args(ECHO.name, (marker,), {}))), "echo")
                deadline = time.monotonic() + 20
                while marker.encode() not in proxy.seen and time.monotonic() < deadline:
                    time.sleep(0.02)
            finally:
                c.close()
        finally:
            proxy.close()
        assert marker.encode() in proxy.seen
        assert token.encode() in proxy.seen
    finally:
        pids = [x.pid for x in (cluster.scheduler, cluster.supervisor) if x is not None]
        cluster.stop()
        assert_all_gone(pids)


# ------------------------------------------------------------------ refusals


def test_a_non_loopback_bind_without_keys_is_refused(tmp_path: Path) -> None:
    with pytest.raises(security.SecurityError, match="off loopback"):
        LocalCluster(host="0.0.0.0", transport="tcp", workers=False).start()
    # The scheduler refuses by itself too (before binding anything).
    r = subprocess.run([sys.executable, "-m", "gpufn.scheduler", "--host", "0.0.0.0"],
                       env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must encrypt with CURVE" in r.stderr, r.stderr


def test_a_secret_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    _, secret = security.ensure_keypair(keys, "server")
    os.chmod(secret, 0o640)
    r = subprocess.run([*_gpufn(), "serve", "--port", "0", "--no-workers"], env=_env(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"chmod 600 {secret}" in r.stderr.replace("\n", ""), r.stderr
    r = subprocess.run([sys.executable, "-m", "gpufn.scheduler", "--host", "0.0.0.0",
                        "--keys", str(keys)], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "readable by others" in r.stderr, r.stderr


def test_an_allow_list_on_loopback_encrypts_or_refuses_to_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--allow-keys on loopback is never ignored: with keys the scheduler encrypts and
    refuses a key outside the folder; without them it does not start."""
    monkeypatch.delenv("GPUFN_CURVE", raising=False)
    keys, allowed, mine = tmp_path / "keys", tmp_path / "allowed", tmp_path / "mine"
    allowed.mkdir()
    security.server_keys(keys, create=True)
    _, friend = security.ensure_keypair(mine, "friend")
    _, stranger = security.ensure_keypair(mine, "stranger")
    shutil.copy(mine / "friend.key", allowed / "friend.key")
    with pytest.raises(security.SecurityError, match="--allow-keys needs CURVE"):
        LocalCluster(transport="tcp", workers=False, allow_keys=allowed).start()
    r = subprocess.run([sys.executable, "-m", "gpufn.scheduler", "--allow-keys", str(allowed)],
                       env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-keys needs CURVE" in r.stderr, r.stderr
    cluster = LocalCluster(transport="tcp", workers=False, keys=keys, allow_keys=allowed)
    address, token = cluster.start()
    try:
        assert config.split_address(address)[1] is not None, "not encrypted"
        with _client_key(monkeypatch, stranger), pytest.raises(gpufn.AuthenticationError):
            gpufn.Client(address, token, connect_timeout=15)
        with _client_key(monkeypatch, friend):
            gpufn.Client(address, token, connect_timeout=20).close()
    finally:
        pids = [x.pid for x in (cluster.scheduler, cluster.supervisor) if x is not None]
        cluster.stop()
        assert_all_gone(pids)


def test_curve_can_be_forced_on_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    security.server_keys(keys, create=True)
    monkeypatch.setenv("GPUFN_CURVE", "1")
    cluster = LocalCluster(transport="tcp", workers=False, keys=keys)
    address, token = cluster.start()
    try:
        assert config.split_address(address)[1] is not None
        c = gpufn.Client(address, token, connect_timeout=20)
        c.close()
        with pytest.raises(gpufn.AuthenticationError, match="CURVE"):
            gpufn.Client(config.split_address(address)[0], token, connect_timeout=15)
    finally:
        cluster.stop()


# ------------------------------------------------------------------ a real non-loopback bind


@pytest.fixture
def veth(tmp_path: Path) -> Iterator[tuple[str, Callable[[list[str]], list[str]]]]:
    """A network namespace joined to this one by a veth pair: (our IP, a wrapper that
    runs a command inside the namespace). Always torn down."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = uuid.uuid4().hex[:6]
    ns, a, b = f"gpufn-t-{tag}", f"gfa{tag}", f"gfb{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    ours, theirs = f"10.213.{octet}.1", f"10.213.{octet}.2"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", a, "type", "veth", "peer", "name", b],
             ["ip", "link", "set", b, "netns", ns], ["ip", "addr", "add", f"{ours}/24", "dev", a],
             ["ip", "link", "set", a, "up"],
             ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{theirs}/24", "dev", b],
             ["ip", "netns", "exec", ns, "ip", "link", "set", b, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for step in steps:
            r = subprocess.run(step, capture_output=True, text=True)
            if r.returncode != 0:
                if step == steps[0]:
                    pytest.skip(f"`ip netns add` is not permitted here: {r.stderr.strip()}")
                raise AssertionError(f"{' '.join(step)}: {r.stderr}")
        yield ours, lambda cmd: ["ip", "netns", "exec", ns, *cmd]
    finally:
        subprocess.run(["ip", "link", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_real_interface_bind_is_encrypted(veth: tuple[str, Callable[[list[str]], list[str]]],
                                            tmp_path: Path) -> None:
    ip, inside = veth
    # Without keys the scheduler refuses this interface.
    with pytest.raises(security.SecurityError, match="off loopback"):
        LocalCluster(host=ip, transport="tcp", workers=False).start()
    with _serve(tmp_path, "--host", ip) as (address, _):
        assert address.startswith(f"tcp://{ip}:") and _key_of(address)
        token = json.loads((tmp_path / "cluster.json").read_text())["token"]
        code = ("import gpufn\n"
                "@gpufn.gpu\ndef f(x):\n    return x + 1\n"
                "print('result', f.remote(41))\n")
        env = _env(tmp_path / "client", GPUFN_ADDRESS=address, GPUFN_TOKEN=token)
        r = subprocess.run(inside([sys.executable, "-c", code]), env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and "result 42" in r.stdout, r.stderr
        # From across the veth, plaintext gets nowhere.
        env["GPUFN_ADDRESS"] = config.split_address(address)[0]
        env["GPUFN_CONNECTION_TIMEOUT"] = "10"
        r = subprocess.run(inside([sys.executable, "-c", code]), env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and "CURVE" in r.stderr, r.stderr


def test_worker_logs_are_owner_only(fresh_cluster: Callable[..., gpufn.Client],
                                    tmp_path: Path) -> None:
    """What user code prints lands in the workers' logs: 0600 files in a 0700 folder, even
    when the folder existed with a looser mode."""
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    os.chmod(logs, 0o755)
    fresh_cluster(GPUFN_CPU_DEVICES=1, GPUFN_LOG_DIR=str(logs))
    files = sorted(logs.glob("worker-*.log"))
    assert files
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
