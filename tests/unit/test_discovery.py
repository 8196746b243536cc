"""How every client finds its cluster (`gpufn.net.discovery.resolve`), with real files, real
processes and real sockets: an explicit address, then GPUFN_ADDRESS, then the running
`gpufn serve` of this GPUFN_HOME, then an embedded cluster, remembering where the address
came from; stale files and servers of other homes are noticed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn
from gpufn.client import default as client_mod
from gpufn.net import discovery
from gpufn.net.discovery import Source

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("GPUFN_HOME", str(h))
    for var in ("GPUFN_ADDRESS", "GPUFN_TOKEN", "GPUFN_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    return h


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s
    s.close()


def _cluster_file(home: Path, address: str, pid: int, token: str = "tok") -> Path:
    path = home / "cluster.json"
    path.write_text(json.dumps({"address": address, "token": token, "pid": pid}))
    return path


def test_the_order_argument_environment_cluster_file_embedded(
        home: Path, listener: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    assert discovery.resolve().source is Source.EMBEDDED  # nothing anywhere
    served = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    path = _cluster_file(home, served, os.getpid(), token="saved")
    t = discovery.resolve()
    assert (t.source, t.address, t.token) == (Source.CLUSTER_FILE, served, "saved")
    assert str(path) in t.origin() and f"pid {os.getpid()}" in t.origin()
    monkeypatch.setenv("GPUFN_ADDRESS", "tcp://10.9.9.9:7555")
    t = discovery.resolve()
    assert (t.source, t.address) == (Source.ENVIRONMENT, "tcp://10.9.9.9:7555")
    assert "GPUFN_ADDRESS" in t.unreachable_hint()
    t = discovery.resolve("h:1", token="mine", label="--address")
    assert (t.source, t.address, t.token, t.origin()) == (Source.ARGUMENT, "tcp://h:1", "mine",
                                                          "--address")
    monkeypatch.delenv("GPUFN_ADDRESS")
    monkeypatch.setenv("GPUFN_TOKEN", "from-env")  # an explicit token beats the saved one
    assert discovery.resolve().token == "from-env"


def test_a_stale_cluster_file_is_not_used_and_is_noticed(home: Path, listener: socket.socket) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    port = listener.getsockname()[1]
    _cluster_file(home, f"tcp://127.0.0.1:{port}", dead.pid)
    t = discovery.resolve()
    assert t.embedded and "no longer running" in t.notice and f"pid {dead.pid}" in t.notice
    assert "gpufn serve --detach" in t.advice


def test_a_cluster_file_with_a_bad_address_is_not_used(home: Path) -> None:
    _cluster_file(home, "http://nowhere", os.getpid())
    t = discovery.resolve()
    assert t.embedded and "no usable address" in t.notice


def test_a_live_pid_whose_port_is_closed_is_not_used(home: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    _cluster_file(home, f"tcp://127.0.0.1:{port}", os.getpid())
    t = discovery.resolve()
    assert t.embedded and "does not answer" in t.notice


def test_a_gpufn_serve_of_another_home_is_noticed(home: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that looks like `gpufn serve` (argv) with another GPUFN_HOME, and that
    home's cluster file naming it: the notice says where it is and how to use it."""
    other = tmp_path / "other"
    other.mkdir()
    fake = tmp_path / "bin" / "gpufn"
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    proc = subprocess.Popen([sys.executable, str(fake), "serve", "--port", "7999"],
                            env={**env, "GPUFN_HOME": str(other)})
    try:
        _cluster_file(other, "tcp://127.0.0.1:7999", proc.pid)
        deadline = time.monotonic() + 10
        while not any(s.pid == proc.pid for s in discovery.serve_processes()):
            assert time.monotonic() < deadline, "the fake `gpufn serve` was not seen in /proc"
            time.sleep(0.05)
        seen = next(s for s in discovery.serve_processes() if s.pid == proc.pid)
        assert seen.home == other and seen.address == "tcp://127.0.0.1:7999"
        assert proc.pid in [s.pid for s in discovery.other_serves()]
        t = discovery.resolve()
        assert t.embedded and "another GPUFN_HOME" in t.notice and "GPUFN_HOME=" in t.advice
        if len(discovery.other_serves()) == 1:  # alone on this machine: it is the one named
            assert str(other) in t.notice and "tcp://127.0.0.1:7999" in t.notice
        # the same server seen from its own home is not "another one"
        monkeypatch.setenv("GPUFN_HOME", str(other))
        assert proc.pid not in [s.pid for s in discovery.other_serves()]
    finally:
        proc.kill()
        proc.wait()


def test_the_notice_is_one_line_once(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = discovery.Target(None, None, Source.EMBEDDED, notice="n1 unique-7f3", advice="do x")
    discovery.announce(t)
    discovery.announce(t)
    err = capsys.readouterr().err
    assert err.count("unique-7f3") == 1 and err.count("\n") == 1
    assert err.startswith("gpufn: n1 unique-7f3; this process starts an embedded cluster")


@pytest.mark.parametrize("bad", ["http://127.0.0.1:7555", "https://h:1", "tcp://h", "tcp://h:0",
                                 "tcp://h:x", "   "])
def test_malformed_addresses_are_invalid_spec_naming_the_form(bad: str) -> None:
    with pytest.raises(gpufn.InvalidSpec, match=r"tcp://HOST:PORT"):
        discovery.resolve(bad)
    with pytest.raises(gpufn.InvalidSpec, match=r"tcp://HOST:PORT"):
        gpufn.connect(bad)


def test_an_address_zmq_cannot_parse_is_invalid_spec_not_zmq_error() -> None:
    with pytest.raises(gpufn.InvalidSpec, match="tcp://HOST:PORT"):
        gpufn.Client("tcp://no such host:1", "t", connect_timeout=1)


def test_no_answer_says_where_the_address_came_from(home: Path) -> None:
    with socket.socket() as s:  # accepts, never answers a Hello
        s.bind(("127.0.0.1", 0))
        s.listen()
        addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        path = _cluster_file(home, addr, os.getpid())
        target = discovery.resolve()
        assert target.source is Source.CLUSTER_FILE
        with pytest.raises(gpufn.ConnectionLost) as e:
            gpufn.Client(addr, "t", connect_timeout=0.5, target=target)
    assert str(path) in str(e.value) and "GPUFN_ADDRESS" not in str(e.value)


def test_connect_repr_names_the_address_and_its_origin(home: Path) -> None:
    c = gpufn.Client.__new__(gpufn.Client)  # the repr alone, without a scheduler
    c.address = "tcp://127.0.0.1:7555"
    c.target = discovery.Target(c.address, None, Source.ENVIRONMENT, "GPUFN_ADDRESS")
    import threading
    c._closed = threading.Event()
    assert repr(c) == "<gpufn.Client tcp://127.0.0.1:7555 from GPUFN_ADDRESS>"


def test_deploy_with_no_cluster_refuses_without_starting_one(home: Path, tmp_path: Path) -> None:
    app = tmp_path / "app1.py"
    app.write_text("import gpufn\n\n@gpufn.gpu\ndef f():\n    return 1\n")
    before = client_mod._default
    with pytest.raises(gpufn.ConnectionLost, match=r"gpufn.deploy\(\) needs a running cluster"):
        gpufn.deploy(app)
    assert client_mod._default is before  # no embedded cluster was started for it


def test_port_holder_names_what_holds_a_port(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    assert discovery.port_holder("127.0.0.1", port) == "another program"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert discovery.port_holder("127.0.0.1", free) is None
    assert discovery.port_holder("127.0.0.1", 0) is None


def test_an_address_naming_the_local_serve_without_a_token_uses_its_saved_token(
        home: Path, listener: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    served = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    _cluster_file(home, served, os.getpid(), token="saved")
    monkeypatch.setenv("GPUFN_ADDRESS", served)
    t = discovery.resolve()
    assert (t.source, t.address, t.token) == (Source.ENVIRONMENT, served, "saved")
    monkeypatch.delenv("GPUFN_ADDRESS")
    t = discovery.resolve(served, label="--address")
    assert (t.source, t.token) == (Source.ARGUMENT, "saved")
    # Another address is not that serve: its token is not given away.
    monkeypatch.setenv("GPUFN_ADDRESS", "tcp://10.9.9.9:7555")
    assert discovery.resolve().token is None
