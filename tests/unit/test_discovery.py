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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def _fake_serve(tmp_path: Path, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A process that looks like `gpufn serve` in /proc (`python .../gpufn serve`), with
    exactly the environment `env` (no GPUFN_* of the test's own)."""
    fake = tmp_path / name / "bin" / "gpufn"
    fake.parent.mkdir(parents=True)
    fake.write_text("import time\ntime.sleep(60)\n")
    return subprocess.Popen([sys.executable, str(fake), "serve"], env=env)


def _seen(pid: int) -> discovery.ServeProcess:
    """`pid` as serve_processes() lists it, once it shows its argv in /proc."""
    deadline = time.monotonic() + 10
    while True:
        found = [s for s in discovery.serve_processes() if s.pid == pid]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"the fake `gpufn serve` {pid} was not seen"
        time.sleep(0.05)


@pytest.mark.parametrize(("argv", "serve"), [
    (["gpufn", "serve"], True),
    (["/home/u/.venv/bin/gpufn", "serve", "--detach"], True),
    (["python3", "/home/u/.venv/bin/gpufn", "serve"], True),
    (["python3", "-m", "gpufn.cli.main", "serve"], True),
    (["python3", "/src/gpufn/cli/main.py", "serve", "--port", "7555"], True),
    (["gpufn", "status"], False),  # another gpufn command
    (["mkdocs", "serve"], False),  # another program's serve
    (["jekyll", "serve", "--source", "gpufn"], False),  # gpufn only as a later argument
    (["serve", "gpufn"], False),  # a program named serve, serving a folder named gpufn
    (["gpufn", "logs", "--app", "x", "serve"], False),  # past where a launch puts its command
])
def test_a_gpufn_serve_is_told_by_how_it_was_launched(argv: list[str], serve: bool) -> None:
    """The command word is looked for where the launches put it: argv[1] (`gpufn`), [2]
    (`python path/gpufn`) or [3] (`python -m gpufn.cli.main`); the program among the
    first three words."""
    assert discovery._is_serve(argv) is serve


def test_a_serve_s_home_without_gpufn_home_and_its_address_only_from_its_own_file(
        home: Path, tmp_path: Path) -> None:
    """A serve started without GPUFN_HOME serves $HOME/.gpufn; a home with no cluster file,
    or one that names another pid, gives no address."""
    user = tmp_path / "user"
    (user / ".gpufn").mkdir(parents=True)
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    plain = _fake_serve(tmp_path, "a", {**base, "HOME": str(user)})
    other = tmp_path / "other"
    other.mkdir()
    _cluster_file(other, "tcp://127.0.0.1:7998", os.getpid())  # not that serve's pid
    named = _fake_serve(tmp_path, "b", {**base, "GPUFN_HOME": str(other)})
    try:
        seen = _seen(plain.pid)
        assert (seen.home, seen.address) == (user / ".gpufn", None)
        seen = _seen(named.pid)
        assert (seen.home, seen.address) == (other, None)
    finally:
        for proc in (plain, named):
            proc.kill()
            proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process of another user needs root")
def test_a_process_of_another_user_is_passed_over_not_the_end_of_the_list(
        home: Path, tmp_path: Path) -> None:
    """Another user's look-alike of `gpufn serve` is not ours to list; our own serve,
    further on in /proc, still is."""
    theirs = subprocess.Popen(["gpufn", "-", "serve"], executable="/bin/cat", user=65534,
                              stdin=subprocess.PIPE)  # argv `gpufn - serve`, reading stdin
    other = tmp_path / "other"
    other.mkdir()
    mine = _fake_serve(tmp_path, "a", {"PATH": os.environ.get("PATH", ""),
                                       "GPUFN_HOME": str(other)})
    try:
        if mine.pid < theirs.pid:
            pytest.skip("the pids wrapped: our serve is listed before the other user's")
        assert _seen(mine.pid).home == other
        assert theirs.pid not in [s.pid for s in discovery.serve_processes()]
    finally:
        for proc in (theirs, mine):
            proc.kill()
            proc.wait()


def test_a_process_gone_while_the_list_is_read_is_passed_over(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process can end between the listing of /proc and the reading of its files: it is
    passed over, and the rest are still read. (The race cannot be timed from a test: the
    listing is given the pid of a process that has just ended, ahead of the others.)"""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    other = tmp_path / "other"
    other.mkdir()
    mine = _fake_serve(tmp_path, "a", {"PATH": os.environ.get("PATH", ""),
                                       "GPUFN_HOME": str(other)})
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: (
        [str(gone.pid), *listdir(path)] if str(path) == "/proc" else listdir(path)))
    try:
        assert _seen(mine.pid).home == other
    finally:
        mine.kill()
        mine.wait()


def test_the_same_home_is_told_also_where_it_cannot_be_resolved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Homes are compared resolved (a link and its target are one home); where resolving
    fails (relative paths in a working folder that is gone) they are compared as written."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert discovery._same(tmp_path / "link", real)
    assert not discovery._same(tmp_path / "link", tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cwd.rmdir()
    with pytest.raises(OSError):
        Path("h").resolve()
    assert discovery._same(Path("h"), Path("h"))
    assert not discovery._same(Path("h"), Path("g"))
    # a symlink loop: Python 3.11 raises RuntimeError from resolve(), not OSError
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    assert discovery._same(loop, loop)
    assert not discovery._same(loop, real)


def test_a_home_is_owned_by_its_folder_or_if_gone_by_its_parent(tmp_path: Path) -> None:
    assert discovery._owned(tmp_path)
    assert discovery._owned(tmp_path / "gone")  # gone: its parent is ours
    assert not discovery._owned(tmp_path / "gone" / "deeper")  # neither: not named
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        assert not discovery._owned(theirs)
        assert not discovery._owned(theirs / "gone")  # its parent is someone else's


def test_the_notice_names_the_one_serve_of_ours_and_counts_the_others(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve_processes` stands in for /proc here (other tests' and users' servers may run
    on this machine): the notice is worded from the serves it lists."""
    mine, gone = tmp_path / "mine", tmp_path / "a" / "b"
    mine.mkdir()
    one = discovery.ServeProcess(41, mine, "tcp://127.0.0.1:7001")
    serves = [one]
    monkeypatch.setattr(discovery, "serve_processes", lambda: list(serves))
    notice, advice = discovery._other_servers()
    assert notice == (f"no `gpufn serve` runs for GPUFN_HOME={home}, but one of another "
                      f"GPUFN_HOME of yours does at tcp://127.0.0.1:7001 (pid 41, "
                      f"GPUFN_HOME={mine})")
    assert advice == f"to use it, set GPUFN_HOME={mine} or GPUFN_ADDRESS"
    serves.append(discovery.ServeProcess(42, gone, None))  # neither it nor its parent exists
    notice, _ = discovery._other_servers()
    assert notice.endswith(f"(pid 41, GPUFN_HOME={mine}) (and 1 of other folders)")
    serves.append(discovery.ServeProcess(43, tmp_path / "more", None))  # a second of ours
    notice, advice = discovery._other_servers()
    assert notice.endswith("; 3 of another GPUFN_HOME run on this machine (their folders are "
                           "not named: not all yours)")
    assert str(mine) not in notice and "GPUFN_ADDRESS=<its address>" in advice
    serves[:] = [discovery.ServeProcess(44, home, None)]  # our own home's: not another
    assert discovery._other_servers() == ("", "")


def test_a_closed_stderr_does_not_stop_the_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    err = io.StringIO()
    err.close()
    monkeypatch.setattr(sys, "stderr", err)
    discovery.announce(discovery.Target(None, None, Source.EMBEDDED, notice="n2 unique-9c1"))
    assert "n2 unique-9c1" in discovery._announced  # said (as far as it could be): once


def test_what_to_check_names_where_the_address_came_from() -> None:
    t = discovery.Target("tcp://h:1", None, Source.ARGUMENT, "--address")
    assert t.unreachable_hint() == ("The address came from --address: check it. Is `gpufn "
                                    "serve` running there?")
    assert discovery.Target(None, None, Source.EMBEDDED).unreachable_hint() == ""


def test_a_port_left_in_time_wait_by_a_stopped_scheduler_is_free() -> None:
    """A `gpufn serve` stopped and started again on its port finds it free: the closed
    connections' TIME_WAIT does not hold it (ZeroMQ binds with SO_REUSEADDR too)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ's listener
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    peer = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server's side closes first: its end of the connection waits
    assert peer.recv(1) == b""
    peer.close()
    srv.close()
    deadline = time.monotonic() + 5
    while discovery.port_holder("127.0.0.1", port) is not None:
        assert time.monotonic() < deadline, "a port held only by TIME_WAIT is not free"
        time.sleep(0.05)


@pytest.mark.skipif(os.geteuid() != 0, reason="listening on port 1 needs root")
def test_port_one_is_checked_like_any_other() -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 1))
        except OSError:
            pytest.skip("port 1 is taken here")
        s.listen()
        assert discovery.port_holder("127.0.0.1", 1) == "another program"


def test_a_silent_port_is_probed_for_about_a_second() -> None:
    """`answers` (each connect's probe of the cluster file's port) gives up on a port that
    never completes a connection (its accept queue full) after a second."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        held = []
        for _ in range(3):  # fill the accept queue: later connects get no answer at all
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            held.append(s)
        time.sleep(0.2)
        t0 = time.monotonic()
        assert not discovery.answers(f"tcp://127.0.0.1:{port}")
        took = time.monotonic() - t0
        for s in held:
            s.close()
    assert 0.9 < took < 1.8, took


class _Router:
    """A ZeroMQ ROUTER on a TCP port that answers each Hello with `welcome` after `delay`
    seconds, as a scheduler (of another cluster: it owes our empty token nothing)."""

    def __init__(self, welcome: Any, delay: float = 0.0) -> None:
        import zmq

        from gpufn.net import sockets
        from gpufn.wire import protocol as p

        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # as the scheduler's: a probe that reconnects under the identity of one just closed
        # (not yet noticed gone, on a loaded machine) takes it over instead of being ignored
        sockets.configure(self._sock, router=True)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()

        def serve() -> None:
            while not self._stop.is_set():
                if not self._sock.poll(50):
                    continue
                peer, *frames = self._sock.recv_multipart()
                if any(isinstance(m, p.Hello) for m in p.decode_all(frames)):
                    time.sleep(delay)
                    self._sock.send_multipart([peer, *p.encode_batch([welcome])])

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def test_a_port_held_by_a_gpufn_scheduler_is_named_so() -> None:
    """One that refuses our empty token and one that lets it in are both schedulers; one
    that answers within the probe's 1.5 s too (after 0.6 s: a full second of slack, as a
    loaded CI machine needs it); a silent holder is given up on by then."""
    from gpufn.wire import protocol as p

    refused = p.Welcome(False, "AuthenticationError", "bad token")
    for welcome, delay in ((refused, 0.0), (p.Welcome(True), 0.0), (p.Welcome(True), 0.6)):
        router = _Router(welcome, delay)
        try:
            for host in ("127.0.0.1", "0.0.0.0", ""):
                assert discovery.port_holder(host, router.port) == "a gpufn scheduler", (
                    welcome, delay, host)
        finally:
            router.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        t0 = time.monotonic()
        assert discovery.port_holder("127.0.0.1", s.getsockname()[1]) == "another program"
        assert time.monotonic() - t0 < 2.2


def test_a_port_held_by_a_gpufn_serve_names_its_home(home: Path, tmp_path: Path,
                                                      listener: socket.socket) -> None:
    """The serve whose cluster file names the port is named, not another serve listed
    before it."""
    port = listener.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        elsewhere = s.getsockname()[1]
    first, second = tmp_path / "first", tmp_path / "second"
    procs = []
    try:
        for name, where in ((first, elsewhere), (second, port)):
            name.mkdir()
            proc = _fake_serve(tmp_path, name.name + "-bin",
                               {"PATH": os.environ.get("PATH", ""), "GPUFN_HOME": str(name)})
            procs.append(proc)
            _cluster_file(name, f"tcp://127.0.0.1:{where}", proc.pid)
            _seen(proc.pid)
        assert discovery.port_holder("127.0.0.1", port) == (
            f"the `gpufn serve` of GPUFN_HOME={second} (pid {procs[1].pid})")
        if os.geteuid() == 0:  # another user's folder: not named
            os.chown(second, 65534, 65534)
            assert discovery.port_holder("127.0.0.1", port) == (
                f"a `gpufn serve` of another GPUFN_HOME (pid {procs[1].pid})")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
