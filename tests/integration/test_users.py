"""Users against a real `gpufn serve`, through the CLI and user processes as people run them:
tokens made, listed (never shown), rotated and revoked; each user reads only their own calls,
results, output and usage while the admin reads all; operations need the admin or an
operator; the device cap; and a token that outlives a restart (or, rotated, fails every
pending call at once instead of hanging)."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..conftest import assert_all_gone
from .served import Served, gpufn_cmd, serve_env

pytestmark = pytest.mark.timeout(300)
DRIVER = Path(__file__).with_name("_users_driver.py")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("users")).start()
    try:
        yield s
    finally:
        s.stop()


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_driver_left() -> Iterator[None]:
    """A failing test leaves no user process behind (they would wait for their calls)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait(check: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _cli(s: Served, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """A `gpufn` command on the head host: with `token`, as that user; else as the admin
    (the token of the cluster file)."""
    env = s.env(**({"GPUFN_TOKEN": token} if token else {}))
    return subprocess.run([*gpufn_cmd(), *args], env=env, cwd=s.home / "cwd",
                          capture_output=True, text=True, timeout=120)


def _driver(s: Served, token: str, *args: str) -> subprocess.Popen[str]:
    env = s.env(GPUFN_ADDRESS=s.address, GPUFN_TOKEN=token)
    proc = subprocess.Popen([sys.executable, str(DRIVER), *args], env=env, cwd=s.home / "cwd",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(proc)
    return proc


def _as(s: Served, token: str, *args: str) -> str:
    """Run one driver command as a user; its last line."""
    out, _ = _driver(s, token, *args).communicate(timeout=120)
    return out.strip().splitlines()[-1]


def _spawned(proc: subprocess.Popen[str]) -> str:
    """The id a `spawn` driver printed (after whatever it logged before)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        if line.startswith("id "):
            return line.split()[1]
        seen.append(line)
    raise AssertionError(f"the driver printed no call id: {''.join(seen)}")


def _create(s: Served, name: str, *options: str) -> str:
    r = _cli(s, "token", "create", name, *options)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"[0-9a-f]{48}\n", r.stdout), r.stdout  # the token alone on stdout
    return r.stdout.strip()


def _json(r: subprocess.CompletedProcess[str]) -> object:
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


# --------------------------------------------------------------------------- the CLI


def test_token_commands_print_tokens_once_and_store_only_hashes(served: Served) -> None:
    tok = _create(served, "erin", "--max-priority", "5", "--max-devices", "1")
    table, listed = _cli(served, "token", "list"), _cli(served, "token", "list", "--json")
    assert "erin" in table.stdout and "admin" in table.stdout
    assert tok not in table.stdout + listed.stdout
    users = _json(listed)
    assert isinstance(users, list)
    erin = next(u for u in users if u["name"] == "erin")
    assert (erin["max_priority"], erin["max_devices"], erin["operator"]) == (5, 1, False)
    assert not any("token" in k for u in users for k in u)
    store = served.home / "state" / "users.json"
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    assert tok not in store.read_text() and hashlib.sha256(tok.encode()).hexdigest() in store.read_text()
    updated = _json(_cli(served, "token", "update", "erin", "--max-devices", "none",
                         "--max-priority", "2", "--json"))
    assert isinstance(updated, dict) and (updated["max_devices"], updated["max_priority"]) == (None, 2)
    dup = _cli(served, "token", "create", "erin")
    assert dup.returncode == 1 and dup.stderr.count("\n") == 1 and "exists already" in dup.stderr
    assert _cli(served, "token", "update", "erin").returncode == 2  # nothing to change
    assert _cli(served, "token", "revoke", "admin").returncode == 2
    assert _cli(served, "token", "create", "not a name").returncode == 1
    # rotate: the new token alone on stdout; the old one is refused from now on
    rotated = _cli(served, "token", "rotate", "erin")
    assert rotated.returncode == 0 and re.fullmatch(r"[0-9a-f]{48}\n", rotated.stdout)
    old = _cli(served, "status", token=tok)
    assert old.returncode == 1 and "AuthenticationError" in old.stderr
    assert _cli(served, "status", token=rotated.stdout.strip()).returncode == 0
    made = _json(_cli(served, "token", "create", "fred", "--json"))
    assert isinstance(made, dict) and made["user"]["name"] == "fred" and len(made["token"]) == 48
    # a user's token manages no users
    denied = _cli(served, "token", "list", token=made["token"])
    assert denied.returncode == 1 and "PermissionDenied" in denied.stderr


# --------------------------------------------------------------------------- isolation


def test_two_users_read_only_their_own_and_the_admin_reads_all(served: Served,
                                                               tmp_path: Path) -> None:
    a, b = _create(served, "alice"), _create(served, "bob")
    flags = tmp_path / "flags"
    flags.mkdir()
    alice = _driver(served, a, "spawn", "alice", str(flags))
    call = _spawned(alice)
    _wait((flags / "started-alice").exists, "alice's call to start")

    # status: bob sees no row of alice's running call; the admin sees it, with its user
    bob_view = _json(_cli(served, "status", "--json", token=b))
    assert isinstance(bob_view, dict) and call not in json.dumps(bob_view["devices"])
    assert bob_view["you"] == {"user": "bob", "admin": False}
    admin_view = _json(_cli(served, "status", "--json"))
    assert isinstance(admin_view, dict)
    rows = [r for d in admin_view["devices"] for r in d["running"]]
    assert any(r["id"] == call and r["user"] == "alice" for r in rows), rows

    # bob: alice's call id is an unknown one, for attaching and for cancelling
    theirs, unknown = _as(served, b, "attach", call), _as(served, b, "attach", "0123nosuchcall")
    assert theirs.startswith("error GpufnError") and "knows no call" in theirs
    assert theirs.replace(call, "ID") == unknown.replace("0123nosuchcall", "ID")
    assert _as(served, b, "cancel", call) == "cancel False"  # and it runs on (below)

    # each prints a secret; alice's call ends with her result
    assert _as(served, b, "call", "bob") == "result quick bob"
    (flags / "release-alice").touch()
    out, _ = alice.communicate(timeout=120)
    assert out.strip().splitlines()[-1] == "result result of alice"
    assert _as(served, a, "call", "alice") == "result quick alice"
    # her result from another process of hers; never for bob
    assert _as(served, a, "attach", call) == "result result of alice"
    assert _as(served, b, "attach", call).startswith("error GpufnError")

    def logs(token: str | None) -> str:
        return _cli(served, "logs", "quick", token=token).stdout

    mine, others = logs(b), logs(a)
    assert "secret of bob" in mine and "secret of alice" not in mine
    assert "secret of alice" in others and "secret of bob" not in others
    assert "secret of alice" in logs(None) and "secret of bob" in logs(None)

    def usage(token: str | None) -> set[str]:
        got = _json(_cli(served, "usage", "--by", "user", "--json", token=token))
        assert isinstance(got, dict)
        return {r["user"] for r in got["rows"]}

    assert usage(b) == {"bob"} and usage(a) == {"alice"}
    assert {"alice", "bob"} <= usage(None)


def test_a_revoked_token_fails_at_once(served: Served, tmp_path: Path) -> None:
    c = _create(served, "carol")
    flags = tmp_path / "flags"
    flags.mkdir()
    carol = _driver(served, c, "spawn", "carol", str(flags))
    _spawned(carol)
    _wait((flags / "started-carol").exists, "carol's call to start")
    revoked = _cli(served, "token", "revoke", "carol")
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
    # Her connected process: its pending call fails now (not after get()'s 120 s).
    out, _ = carol.communicate(timeout=60)
    last = out.strip().splitlines()[-1]
    assert last.startswith("error AuthenticationError") and "revoked" in last, out
    assert _as(served, c, "call", "carol").startswith("error AuthenticationError")
    st = _cli(served, "status", token=c)
    assert st.returncode == 1 and "AuthenticationError" in st.stderr
    assert "carol" not in _cli(served, "token", "list").stdout


def test_operations_need_the_admin_or_an_operator(served: Served, tmp_path: Path) -> None:
    d, o = _create(served, "dave"), _create(served, "olga", "--operator")
    app = tmp_path / "uapp.py"
    app.write_text("import gpufn\n\n\n@gpufn.gpu\ndef hello(x: str) -> str:\n"
                   "    return f'hello {x}'\n")
    refused = _cli(served, "deploy", str(app), "--name", "uapp", token=d)
    assert refused.returncode != 0 and "PermissionDenied" in refused.stderr, refused.stderr
    deployed = _cli(served, "deploy", str(app), "--name", "uapp", token=o)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert _as(served, d, "lookup", "uapp", "hello", "dave") == "result hello dave"  # for all
    assert _cli(served, "app", "list", token=d).returncode == 0
    for args in (("app", "stop", "uapp"), ("app", "rollback", "uapp")):
        r = _cli(served, *args, token=d)
        assert r.returncode != 0 and "PermissionDenied" in r.stderr, r.stderr
    down = _cli(served, "shutdown", "--grace", "1", token=d)
    assert down.returncode != 0 and "PermissionDenied" in down.stderr, down.stderr
    assert served.proc is not None and served.proc.poll() is None
    assert _as(served, d, "lookup", "uapp", "hello", "again") == "result hello again"


def test_calls_over_the_device_cap_wait_their_turn_and_say_why(served: Served,
                                                               tmp_path: Path) -> None:
    f = _create(served, "frank", "--max-devices", "1")
    flags = tmp_path / "flags"
    flags.mkdir()
    first = _driver(served, f, "spawn", "frank1", str(flags))
    _spawned(first)
    _wait((flags / "started-frank1").exists, "frank's first call")
    second = _driver(served, f, "spawn", "frank2", str(flags))
    _spawned(second)

    def capped() -> list[dict[str, object]]:
        st = _json(_cli(served, "status", "--json", token=f))
        assert isinstance(st, dict)
        return list(st["capped"])

    _wait(capped, "the second call to wait at the cap")
    assert not (flags / "started-frank2").exists()  # a device is free, but frank holds 1
    shown = _cli(served, "status", token=f).stdout
    assert "wait their turn" in " ".join(shown.split()) and "max-devices" in shown
    (flags / "release-frank1").touch()
    _wait((flags / "started-frank2").exists, "frank's second call to get its turn")
    (flags / "release-frank2").touch()
    for proc in (first, second):
        out, _ = proc.communicate(timeout=60)
        assert out.strip().splitlines()[-1].startswith("result result of frank")


# --------------------------------------------------------------------------- restarts


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Head:
    """`gpufn serve` on a fixed port (clients reconnect to the same address) and home."""

    def __init__(self, home: Path) -> None:
        self.home, self.port = home, _free_port()
        self.proc: subprocess.Popen[str] | None = None
        (home / "cwd").mkdir(parents=True, exist_ok=True)

    def start(self, *args: str) -> dict[str, str]:
        (self.home / "cluster.json").unlink(missing_ok=True)
        log = open(self.home / "serve.log", "a")  # noqa: SIM115 (the child keeps writing it)
        self.proc = subprocess.Popen(
            [*gpufn_cmd(), "serve", "--port", str(self.port), "--cpu-devices", "1", *args],
            env=serve_env(self.home), cwd=self.home / "cwd", stdout=log,
            stderr=subprocess.STDOUT, text=True)
        log.close()
        path = self.home / "cluster.json"
        _wait(lambda: path.exists() or (self.proc and self.proc.poll() is not None), "serve")
        assert path.exists(), (self.home / "serve.log").read_text()
        return dict(json.loads(path.read_text()))

    def kill(self) -> None:
        """SIGKILL everything, the scheduler first, so no client is told it stops."""
        assert self.proc is not None
        def children(pid: int) -> list[int]:
            out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
            return [int(x) for x in out.stdout.split()]

        found = children(self.proc.pid)  # the scheduler and the supervisor
        sched = [pid for pid in found if "gpufn.scheduler" in Path(f"/proc/{pid}/cmdline").read_text()]
        pids = sched + [x for pid in found if pid not in sched for x in [pid, *children(pid)]]
        pids.append(self.proc.pid)
        for pid in pids:
            try:
                subprocess.run(["kill", "-KILL", str(pid)], check=False)
            except OSError:
                pass
        self.proc.wait(30)
        self.proc = None
        assert_all_gone(pids)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def test_serve_keeps_its_token_and_a_refused_reconnect_fails_calls_at_once(tmp_path: Path) -> None:
    head = _Head(tmp_path / "head")
    worker_host: subprocess.Popen[str] | None = None
    client: subprocess.Popen[str] | None = None
    try:
        first = head.start()
        head.stop()
        kept = head.start()
        assert kept["token"] == first["token"]  # a restart changes nothing for token holders
        _wait(lambda: "the same token as the last start" in (head.home / "serve.log").read_text(),
              "serve to say it kept its token")
        token, address = first["token"], kept["address"]
        key = head.home / "state" / "admin.token"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        # A worker host and a client with a pending call, both with the token of now.
        log = open(tmp_path / "worker.log", "w")  # noqa: SIM115
        worker_host = subprocess.Popen(
            [*gpufn_cmd(), "worker", "--address", address, "--cpu-devices", "1", "--node", "other"],
            env=serve_env(tmp_path / "wh", GPUFN_TOKEN=token), stdout=log,
            stderr=subprocess.STDOUT, text=True)
        log.close()
        flags = tmp_path / "flags"
        flags.mkdir()
        env = serve_env(tmp_path / "cl", GPUFN_ADDRESS=address, GPUFN_TOKEN=token)
        client = subprocess.Popen([sys.executable, str(DRIVER), "spawn", "x", str(flags)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=tmp_path)
        _STARTED.append(client)
        _spawned(client)
        _wait((flags / "started-x").exists, "the client's call to start")
        _wait(lambda: "other" in json.dumps(_head_status(head)), "the worker host to join")
        # The head dies, and comes back with a new token.
        head.kill()
        rotated = head.start("--new-token")
        assert rotated["token"] != token
        out, _ = client.communicate(timeout=90)  # failed, not waiting for get()'s 120 s
        last = out.strip().splitlines()[-1]
        assert last.startswith("error AuthenticationError") and "--new-token" in last, out
        # The worker host keeps trying, saying why; with the old token back it rejoins.
        wlog = tmp_path / "worker.log"
        _wait(lambda: "wrong token" in wlog.read_text() and "keeps trying" in wlog.read_text(),
              "the worker host to log its refusal and the fix")
        assert worker_host.poll() is None
        head.stop()
        back = head.start("--token", token)
        assert back["token"] == token
        _wait(lambda: "other" in json.dumps(_head_status(head)), "the worker host to rejoin", 90)
    finally:
        for proc in (client, worker_host):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        head.stop()


def _head_status(head: _Head) -> object:
    r = subprocess.run([*gpufn_cmd(), "status", "--json"], env=serve_env(head.home),
                       capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {}
