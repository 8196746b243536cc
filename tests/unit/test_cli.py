"""Parsing and rendering of every `gpufn` command with typer's CliRunner, against a fake
client (no processes): options, --json, exit codes and one-line failures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufn.cli import common, ops
from gpufn.cli.main import app
from gpufn.exceptions import AuthenticationError

runner = CliRunner()

STATUS: dict[str, Any] = {
    "devices": [{"key": "n:0", "name": "cpu", "kind": "cpu", "state": "ready", "capacity": 8 << 30,
                 "used": 6 << 30, "running": [{"id": "abcdef0123", "function": "f", "seconds": 1.5}],
                 "completed": 3, "restarts": 0, "models": [
                     {"name": "llm", "key": "llm", "state": "offloaded", "nbytes": 1 << 30,
                      "users": [], "in_use": 0, "uses": 2}]}],
    "functions": [{"name": "f", "queued": 2, "calls": 3, "runtime_ewma": 0.01, "app": "", "version": 0}],
    "queue_by_priority": [{"function": "f", "app": "", "version": 0, "priority": 5, "queued": 2}],
    "hosts": [{"host": "n", "devices": 1, "workers": {"ready": 1}, "connected": True}],
    "queued": 2, "running": 1, "clients": 1, "counters": {"submitted": 5}, "models": [],
    "draining": False,
}
LINES = [{"seq": 1, "age": 5.0, "app": "shop", "function": "embed", "invocation_id": "0123456789ab",
          "stream": "stdout", "text": "hello from embed"}]
ROWS = [{"app": "shop", "function": "embed", "user": "", "calls": 4, "device_seconds": 7200.0,
         "queue_wait_seconds": 0.4, "outcomes": {"succeeded": 4}, "mean_queue_wait_seconds": 0.1}]


class FakeClient:
    def __init__(self) -> None:
        self.asked: list[tuple[str, Any]] = []
        self.closed = False

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return STATUS

    def query(self, kind: str, args: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        self.asked.append((kind, args))
        if kind == "logs":
            if args["target"] == "nope":
                return {"found": False, "known": ["shop"], "lines": [], "next": 0}
            return {"found": True, "lines": LINES, "next": 1}
        return {"rows": ROWS}

    def drain(self, grace: float, reason: str = "", timeout: float = 5.0) -> dict[str, Any]:
        self.asked.append(("drain", grace))
        return {"running": 1, "dropped_queued": 2, "grace": grace, "already_draining": False}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeClient:
    monkeypatch.setenv("GPUFN_HOME", str(tmp_path))
    monkeypatch.delenv("GPUFN_STATE_DIR", raising=False)
    client = FakeClient()
    monkeypatch.setattr(common, "connect", lambda *a, **k: client)
    monkeypatch.setattr(ops, "_wait_gone", lambda *a, **k: True)
    # The tests pass COLUMNS per invocation; a console built while COLUMNS was already set
    # (a pytest-xdist worker starts with COLUMNS=80) keeps that width: let it read COLUMNS.
    monkeypatch.setattr(ops.console, "_width", None)
    return client


def test_status_renders_bars_hosts_models_and_queue(fake: FakeClient) -> None:
    r = runner.invoke(app, ["status", "--address", "tcp://h:1"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for text in ("█", "hosts", "1 ready", "offloaded", "queue by priority", "f abcdef0123"):
        assert text in r.output
    r = runner.invoke(app, ["status", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["hosts"][0]["host"] == "n"
    assert fake.closed


def test_status_of_deployed_apps_has_app_and_version_columns() -> None:
    from rich.console import Console

    from gpufn.cli import render

    st = {**STATUS, "functions": [
        {"name": "embed", "queued": 0, "calls": 3, "runtime_ewma": None, "app": "demo", "version": 2,
         "model_keys": ["enc@b"]},
        {"name": "embed", "queued": 0, "calls": 9, "runtime_ewma": None, "app": "demo", "version": 1,
         "model_keys": ["enc@a"]},
        {"name": "adhoc", "queued": 0, "calls": 1, "runtime_ewma": None, "app": "", "version": 0}],
        "models": [{"name": "enc", "key": "enc@a", "bytes": 1 << 20, "loads": 1, "count": 1,
                    "mean_load_s": None, "restores": 0, "mean_restore_s": None, "offloads": 0,
                    "evictions": 0, "failures": 0}]}
    console = Console(width=200, record=True)
    console.print(render.status_view(st))
    text = console.export_text()
    fns = text[text.index("functions"):].splitlines()
    assert "app" in fns[2] and "version" in fns[2]
    rows = [ln.split("│")[1:4] for ln in fns if "embed" in ln]
    assert [[c.strip() for c in r] for r in rows] == [["embed", "demo", "v1"], ["embed", "demo", "v2"]]
    assert "demo v1" in text[text.index("model pool"):text.index("functions")]
    footer = render.status_view({**STATUS, "counters": {"succeeded": 0}, "clients": 1,
                                 "queued": 0, "running": 0,
                                 "you": {"user": "admin", "admin": True}}).renderables[-1]
    assert str(footer) == "queued 0 · running 0 · clients 1 · you: admin (admin: every call)"


def test_logs_usage_shutdown_parse_and_render(fake: FakeClient) -> None:
    r = runner.invoke(app, ["logs", "shop.embed", "--since", "10m"])
    assert r.exit_code == 0 and "[shop.embed 0123456789ab] hello from embed" in r.output
    assert fake.asked[-1] == ("logs", {"target": "shop.embed", "since": 600.0})
    r = runner.invoke(app, ["logs", "shop", "--json"])
    assert json.loads(r.output)[0]["invocation_id"] == "0123456789ab"
    r = runner.invoke(app, ["logs", "nope"])
    assert r.exit_code == 1 and r.output.strip() == ("error: no app, function or call 'nope' has output kept; "
                                                "functions with output: shop")
    r = runner.invoke(app, ["logs", "shop", "--since", "soon"])
    assert r.exit_code == 2 and "not a duration" in r.output

    r = runner.invoke(app, ["usage", "--since", "1h30m", "--by", "app"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "shop" in r.output and "2.000" in r.output  # device-hours
    assert fake.asked[-1] == ("usage", {"since": 5400.0, "by": "app"})
    r = runner.invoke(app, ["usage", "--json"])
    assert json.loads(r.output)["rows"][0]["device_seconds"] == 7200.0
    r = runner.invoke(app, ["usage", "--by", "host"])
    assert r.exit_code == 2 and "--by must be app, function or user" in r.output

    r = runner.invoke(app, ["shutdown", "--grace", "12", "--address", "tcp://h:1"])
    assert r.exit_code == 0 and "1 running call(s) had 12s" in r.output
    assert fake.asked[-1] == ("drain", 12.0)
    r = runner.invoke(app, ["shutdown", "--json", "--address", "tcp://h:1"])
    assert json.loads(r.output)["stopped"] is True


def test_no_server_is_one_line_without_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUFN_HOME", str(tmp_path))
    monkeypatch.delenv("GPUFN_ADDRESS", raising=False)
    for cmd in (["status"], ["logs", "x"], ["usage"], ["shutdown"]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 2, (cmd, r.output)
        assert r.output.count("\n") == 1 and "gpufn serve" in r.output
        assert r.exception is None or isinstance(r.exception, SystemExit)


def test_wrong_token_and_bad_address_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpufn.client.client

    class Refused:
        def __init__(self, *a: Any, **k: Any) -> None:
            raise AuthenticationError("wrong or missing token: set GPUFN_TOKEN")

    monkeypatch.setattr(gpufn.client.client, "Client", Refused)
    r = runner.invoke(app, ["status", "--address", "tcp://h:1", "--token", "x"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "AuthenticationError" in r.output
    monkeypatch.undo()
    r = runner.invoke(app, ["status", "--address", "tcp://no such host:1", "--timeout", "1"])
    assert r.exit_code in (1, 2) and r.output.count("\n") == 1 and "Traceback" not in r.output


def test_run_arguments_are_literals_json_or_strings() -> None:
    assert ops.parse_call_args(["1", "2.5", "'x'", "[1, 2]", '{"a": null}', "hello", "n=3",
                                "flag=True"]) == (
        [1, 2.5, "x", [1, 2], {"a": None}, "hello"], {"n": 3, "flag": True})
    assert ops.parse_value("-1") == -1 and ops.parse_value("null") is None


def test_run_refuses_bad_references(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("import gpufn\n@gpufn.gpu\ndef f(x):\n    return x\n"
                                     "def plain(x):\n    return x\n")
    r = runner.invoke(app, ["run", str(tmp_path / "app.py")])
    assert r.exit_code == 2 and "FILE.py::FUNCTION" in r.output
    r = runner.invoke(app, ["run", f"{tmp_path / 'app.py'}::plain", "1"])
    assert r.exit_code == 2 and "plain is not a @gpufn.gpu function" in r.output and ": f" in r.output
    r = runner.invoke(app, ["run", f"{tmp_path / 'missing.py'}::f"])
    assert r.exit_code == 2 and "no such file" in r.output
    r = runner.invoke(app, ["run", f"{tmp_path / 'app.py'}::f", "a=1", "2"])
    assert r.exit_code == 2 and "positional argument '2' after a keyword" in r.output
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    r = runner.invoke(app, ["run", f"{tmp_path / 'broken.py'}::f"])
    assert r.exit_code == 1 and "RuntimeError: boom" in r.output and "Traceback" not in r.output


def test_serve_options_parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    r = runner.invoke(app, ["serve", "--cpu-devices", "0"])
    assert r.exit_code == 2 and "--cpu-devices must be at least 1" in r.output
    monkeypatch.setenv("GPUFN_HOME", str(tmp_path))
    monkeypatch.setenv("GPUFN_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "serve.pid").write_text(f"{__import__('os').getpid()}\n")
    r = runner.invoke(app, ["serve", "--detach", "--port", "0"])
    assert r.exit_code == 1 and "already running" in r.output
    r = runner.invoke(app, ["serve", "--help"])
    for opt in ("--detach", "--state-dir", "--metrics-port", "--json"):
        assert opt in r.output


def test_durations() -> None:
    assert [common.parse_duration(t) for t in ("90", "30s", "10m", "2h", "1d", "1w", "1h30m")] == [
        90, 30, 600, 7200, 86400, 604800, 5400]


def test_gpufn_stop_says_which_command_stops_what() -> None:
    """`gpufn stop` (Modal's and many servers' word) is no command: it says `shutdown` for
    the server and `app stop` for an app, and is not listed in the help."""
    from gpufn.cli.main import app

    for argv in (["stop"], ["stop", "demo", "--now"]):
        r = runner.invoke(app, argv)
        assert r.exit_code == 2 and "`gpufn shutdown` stops the server" in r.output
        assert "`gpufn app stop APP`" in r.output
    assert " stop " not in runner.invoke(app, ["--help"]).output
