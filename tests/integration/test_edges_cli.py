"""Every edge answers in one line (issue 19, section 3), through real subprocesses in a user's
shell with no GPUFN_* variable set: malformed addresses, a taken port, `--help` text, deploy
tracebacks, the embedded cluster's own output (retries, a killed worker, the progress bar and
the line while it starts)."""

from __future__ import annotations

import os
import pty
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._userenv import ROOT, Detached, User

pytestmark = pytest.mark.timeout(300)
APP = ROOT / "examples" / "deploy" / "app.py"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Detached]:
    server = Detached(User(tmp_path_factory.mktemp("edges-user")), devices=1).start()
    try:
        yield server
    finally:
        server.stop()


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "error: error" not in r.stderr
    return r.stderr


@pytest.mark.parametrize("argv", [
    ["deploy", str(APP)], ["app", "list"], ["app", "history", "demo"], ["app", "rollback", "demo"],
    ["app", "stop", "demo"], ["status"], ["logs", "demo"], ["usage"], ["shutdown"],
])
def test_an_http_address_is_one_line_naming_the_form(argv: list[str], tmp_path: Path) -> None:
    r = User(tmp_path).gpufn(*argv, "--address", "http://127.0.0.1:7555")
    assert r.returncode == 2
    # longer than 80 columns, and not a terminal: still one line, never hard-wrapped
    assert "tcp://HOST:PORT" in _one_line(r) and len(r.stderr) > 80


def test_an_http_address_from_python_is_a_gpufn_error(tmp_path: Path) -> None:
    code = ("import gpufn\ntry:\n    gpufn.connect('http://127.0.0.1:7555')\n"
            "except gpufn.GpufnError as e:\n    print(type(e).__name__, '|', e)\n")
    r = User(tmp_path).python(code)
    assert r.returncode == 0 and r.stdout.startswith("InvalidSpec | "), r.stdout + r.stderr
    assert "tcp://HOST:PORT" in r.stdout and "zmq" not in r.stdout.lower()


def test_serve_on_a_taken_port_says_by_what_in_one_line(served: Detached, tmp_path: Path) -> None:
    again = served.user.gpufn("serve", "--port", str(served.port))
    assert again.returncode == 1
    line = _one_line(again)
    assert f"port {served.port}" in line and "taken by the `gpufn serve`" in line
    assert str(served.user.gpufn_home) in line and f"pid {served.pid}" in line
    other = User(tmp_path / "other")  # --detach, from another home
    detached = other.gpufn("serve", "--detach", "--port", str(served.port))
    assert detached.returncode == 1 and "taken by the `gpufn serve`" in _one_line(detached)
    assert not (other.gpufn_home / "serve.pid").exists()


def test_serve_on_a_port_another_program_holds(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = User(tmp_path).gpufn("serve", "--port", str(port))
    assert r.returncode == 1 and "taken by another program" in _one_line(r)


def test_help_keeps_bracketed_text(tmp_path: Path) -> None:
    user = User(tmp_path)
    serve = user.gpufn("serve", "--help").stdout
    assert "gpufn[metrics]" in " ".join(serve.split())
    status = " ".join(user.gpufn("status", "--help").stdout.split())
    assert "tcp://HOST:PORT (default: GPUFN_ADDRESS, else the running `gpufn serve`" in status


@pytest.mark.parametrize(("source", "shown"), [
    ("import gpufn\n\n@gpufn.gpu\ndef f(:\n    pass\n", "def f(:"),
    ("import gpufn\nimport helper_x\n", "import nonexistent_module_x"),
])
def test_a_broken_app_shows_only_the_users_frames(served: Detached, tmp_path: Path,
                                                   source: str, shown: str) -> None:
    (tmp_path / "brokenapp.py").write_text(source)
    (tmp_path / "helper_x.py").write_text("import nonexistent_module_x\n")
    r = served.user.gpufn("deploy", str(tmp_path / "brokenapp.py"))
    assert r.returncode == 1 and shown in r.stderr, r.stderr
    assert "deployment.py" not in r.stderr and "<frozen" not in r.stderr and "gpufn/" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: brokenapp.py failed to import: ")


_RETRY = """
import gpufn

@gpufn.gpu(retries=gpufn.Retries(max_retries=2, initial_delay=0.1))
def flaky():
    raise ValueError("boom")

try:
    flaky.remote()
except ValueError as e:
    print("caller got", e, flush=True)
print("LAST LINE", flush=True)
"""


def test_a_retried_exception_is_not_a_warning_and_states_its_delay_once(tmp_path: Path) -> None:
    user = User(tmp_path)
    quiet = user.python(_RETRY)
    assert quiet.returncode == 0 and "caller got boom" in quiet.stdout, quiet.stderr
    assert "WARNING" not in quiet.stderr and "retry" not in quiet.stderr, quiet.stderr
    loud = user.python(_RETRY, GPUFN_LOG_LEVEL="INFO")
    lines = [ln for ln in loud.stderr.splitlines() if "raised ValueError; retry" in ln]
    assert len(lines) == 2, loud.stderr
    for ln in lines:
        assert " INFO " in ln and len(re.findall(r"\d+(\.\d+)?s\b", ln.split("flaky:")[1])) == 1, ln


_TIMEOUT = """
import time, gpufn

@gpufn.gpu(timeout=1)
def hang():
    time.sleep(30)

for _ in range(2):
    try:
        hang.remote()
    except gpufn.Timeout:
        print("timed out", flush=True)
print("LAST LINE", flush=True)
time.sleep(0.5)  # the script goes on a little (or exits slowly): what is printed meanwhile?
"""


def test_nothing_is_printed_after_the_scripts_last_line(tmp_path: Path) -> None:
    """A worker the scheduler killed (a timeout) is reported to the caller; the supervisor's
    note of its end must not trail the script's own last line as a WARNING."""
    r = subprocess.run([sys.executable, "-c", _TIMEOUT], env=User(tmp_path).env(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("timed out") == 2, r.stdout
    after = r.stdout.split("LAST LINE", 1)[1]
    assert "WARNING" not in after and "supervisor" not in after, r.stdout


def _in_a_terminal(user: User, code: str, timeout: float = 120) -> str:
    """Run `code` with stdout and stderr on a pseudo-terminal, as in a user's shell."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], env=user.env(TERM="xterm"),
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            cwd=user.home)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))


def test_the_terminal_bar_shows_a_rate_and_the_embedded_start_says_so(tmp_path: Path) -> None:
    code = ("import gpufn\nsq = gpufn.gpu(lambda x: x * x)\n"
            "print('sum', sum(sq.map(range(20))), flush=True)\n")
    out = _in_a_terminal(User(tmp_path), code)
    assert "sum 2470" in out, out
    # the line, or the notice that says why (another `gpufn serve` runs on this machine)
    said = re.search(r"gpufn: (starting a local cluster for this process|.*starts an embedded "
                     r"cluster of its own)", out)
    assert said, out
    start = said.start()
    bar = re.findall(r"20/20\s+(\d+(?:\.\d+)?)/s", out)
    assert bar and float(bar[-1]) > 0, out
    assert start < out.index("20/20"), out  # the line comes before the bar, not behind 0/20
