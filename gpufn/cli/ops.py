"""`gpufn status | logs | usage | run | shutdown`: the operator's commands (thin: parse, ask
the library, render, exit with a code)."""

from __future__ import annotations

import ast
import json
import re
import time
from datetime import datetime
from typing import Any

import typer
from rich.console import Console

from gpufn.cli import common, render
from gpufn.cli.common import ADDRESS_HELP, TOKEN_HELP, fail
from gpufn.cluster.serve import forget_dead_server, read_pid
from gpufn.exceptions import GpufnError
from gpufn.net.processes import alive

console = Console()

_ADDRESS = typer.Option(None, help=ADDRESS_HELP)
_TOKEN = typer.Option(None, help=TOKEN_HELP)
_JSON = typer.Option(False, "--json", help="Print JSON instead of tables.")
_TIMEOUT = typer.Option(5.0, help="Seconds to wait for the scheduler.")


def status(
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh live until Ctrl-C."),
    interval: float = typer.Option(1.0, help="Seconds between refreshes with --watch."),
) -> None:
    """Devices with memory bars, models, queue depth by priority, running calls, hosts."""
    client = common.connect(address, token, timeout)
    try:
        if not watch:
            st = _status(client, timeout)
            if as_json:
                common.print_json(st)
            else:
                console.print(render.status_view(st))
            return
        if as_json:  # a JSON object per refresh, one per line
            while True:
                typer.echo(json.dumps(_status(client, timeout), default=str))
                time.sleep(interval)
        from rich.live import Live

        with Live(render.status_view(_status(client, timeout)), console=console,
                  refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(render.status_view(_status(client, timeout)))
    except KeyboardInterrupt:
        pass
    finally:
        client.close()


def _status(client: Any, timeout: float) -> dict[str, Any]:
    try:
        st: dict[str, Any] = client.status(timeout)
    except GpufnError as e:
        fail(f"{type(e).__name__}: {e}")
    return st


def logs(
    target: str = typer.Argument(..., help="APP, APP.FN for a deployed app, an ad-hoc function's name, or a call's id."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output."),
    since: str | None = typer.Option(None, help="Only output newer than this, e.g. 10m, 2h, 1d."),
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Function output with invocation ids, from the scheduler's bounded log store."""
    window = common.parse_duration(since) if since else None
    client = common.connect(address, token, timeout)
    try:
        res = _query(client, "logs", {"target": target, "since": window}, timeout)
        if not res["found"]:
            known = ", ".join(res.get("known", [])) or "none yet"
            fail(f"no app, function or call {target!r} has output kept; functions with "
                 f"output: {known}")
        if as_json and not follow:
            common.print_json(res["lines"])
            return
        _print_lines(res["lines"], as_json)
        after = res["next"]
        while follow:
            time.sleep(0.5)
            res = _query(client, "logs", {"target": target, "after": after}, timeout)
            _print_lines(res["lines"], as_json)
            after = res["next"]
    except KeyboardInterrupt:
        pass
    finally:
        client.close()


def _print_lines(lines: list[dict[str, Any]], as_json: bool) -> None:
    now = time.time()
    for ln in lines:
        if as_json:
            typer.echo(json.dumps(ln))
        else:
            when = datetime.fromtimestamp(now - ln["age"]).strftime("%H:%M:%S")
            typer.echo(render.log_line(ln, when), err=ln["stream"] == "stderr")


def _query(client: Any, kind: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    try:
        data: dict[str, Any] = client.query(kind, args, timeout)
    except GpufnError as e:
        fail(f"{type(e).__name__}: {e}")
    return data


def usage(
    since: str = typer.Option("1d", help="The window, e.g. 1h, 1d, 1w."),
    by: str = typer.Option("function", help="Group by app, function or user."),
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Device-seconds, calls and queue wait per app, function or user."""
    if by not in ("app", "function", "user"):
        fail(f"--by must be app, function or user, not {by!r}", 2)
    window = common.parse_duration(since)
    client = common.connect(address, token, timeout)
    try:
        rows = _query(client, "usage", {"since": window, "by": by}, timeout)["rows"]
    finally:
        client.close()
    if as_json:
        common.print_json({"since_seconds": window, "by": by, "rows": rows})
    else:
        console.print(render.usage_table(rows, by, since))


def shutdown(
    grace: float = typer.Option(30.0, help="Seconds running calls get to finish."),
    address: str | None = _ADDRESS, token: str | None = _TOKEN, as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
    force: bool = typer.Option(False, help="If the scheduler does not answer, stop the "
                               "detached server of this machine by its pid file."),
) -> None:
    """Stop a server cleanly, and every worker host connected to it.

    New calls are refused, queued ones dropped, running ones get --grace seconds to finish."""
    import signal

    from gpufn.net.cluster_file import load_cluster_file

    target = None
    try:
        target = common.resolve(address, token)
        client = common.connect(address, token, timeout, target)
    except typer.Exit:
        if not force:
            raise
        import os

        from gpufn.cluster.head import stop_recorded
        from gpufn.wire import config

        dpid = read_pid()
        if dpid:
            os.kill(dpid, signal.SIGINT)  # for good: SIGTERM would leave the workers waiting
        if not stop_recorded(config.state_dir()) and not dpid:
            raise
        pid: Any = dpid
        ack: dict[str, Any] = {"forced": True}
        addr, tok = (str(target.address) if target else ""), None
    else:
        addr, tok = str(target.address), target.token
        saved = load_cluster_file()
        pid = saved.get("pid") if saved and saved.get("address") == addr else None
        try:
            ack = client.drain(grace, "gpufn shutdown", timeout)
        except GpufnError as e:
            fail(f"{type(e).__name__}: {e}")
        finally:
            client.close()
    stopped = _wait_gone(addr, tok, pid if isinstance(pid, int) else None, grace + 30)
    if ack.get("forced"):  # a server that crashed cleans up nothing: its files go here
        forget_dead_server()
    if not stopped:
        fail(f"the scheduler at {addr} accepted the shutdown but is still running after "
             f"{grace + 30:.0f}s")
    if as_json:
        common.print_json({"address": addr, "stopped": True, **ack})
    elif ack.get("forced"):
        typer.echo(f"gpufn server (pid {pid}) stopped by signal")
    else:
        typer.echo(f"gpufn scheduler at {addr} stopped ({ack['running']} running call(s) "
                   f"had {grace:g}s to finish, {ack['dropped_queued']} queued call(s) dropped)")


def _wait_gone(addr: str, tok: str | None, pid: int | None, limit: float) -> bool:
    """Wait for the server process to end (a local one by pid) or stop answering."""
    deadline = time.monotonic() + limit
    if pid:
        while alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
    from gpufn.client.client import Client

    while time.monotonic() < deadline:
        try:
            c = Client(addr, tok, connect_timeout=1.0)
        except Exception:
            return True
        c.close()
        time.sleep(0.2)
    return False


_KWARG = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)


def parse_value(text: str) -> Any:
    """A command-line argument as a Python literal, else JSON, else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_call_args(args: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """ARG... -> (positional, keyword): NAME=VALUE is a keyword argument."""
    pos: list[Any] = []
    kw: dict[str, Any] = {}
    for a in args:
        m = _KWARG.match(a)
        if m:
            kw[m.group(1)] = parse_value(m.group(2))
        elif kw:
            fail(f"positional argument {a!r} after a keyword argument", 2)
        else:
            pos.append(parse_value(a))
    return pos, kw


def load_function(ref: str) -> tuple[Any, list[Any]]:
    """'path/app.py::fn' -> the `@gpu` function, and the modules that travel by value with
    it: the file's and its local modules, as `gpufn deploy` sends them (app_modules)."""
    import sys
    from pathlib import Path

    from gpufn.api.deployment import DeployError, app_modules, load_module
    from gpufn.api.function import Function

    path_s, sep, name = ref.partition("::")
    if not sep or not name:
        fail(f"expected FILE.py::FUNCTION, got {ref!r}", 2)
    path = Path(path_s).resolve()
    if not path.is_file():
        fail(f"no such file: {path_s}", 2)
    try:
        module = load_module(path)
    except DeployError as e:
        fail(f"importing {path_s} failed: {str(e).partition(': ')[2] or e} (run "
             f"`python {path_s}` for the traceback)")
    if str(path.parent) not in sys.path:  # what it imports later, here and on embedded workers
        sys.path.insert(0, str(path.parent))
    fn = getattr(module, name, None)
    if not isinstance(fn, Function):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, Function))
        what = "is not a @gpufn.gpu function" if fn is not None else "is not defined there"
        fail(f"{name} {what}; @gpu functions in {path_s}: {', '.join(found) or 'none'}", 2)
    return fn, app_modules(module)


def run(
    ref: str = typer.Argument(..., metavar="FILE.py::FUNCTION", help="The function to call."),
    args: list[str] | None = typer.Argument(None, metavar="ARG...", help=(
        "Arguments as Python literals or JSON (strings otherwise); NAME=VALUE for keywords.")),
    address: str | None = typer.Option(None, help=(
        "Run on this scheduler (default: GPUFN_ADDRESS, else the running `gpufn serve` of "
        "this GPUFN_HOME, else a local cluster started for this run).")),
    token: str | None = _TOKEN, as_json: bool = _JSON,
) -> None:
    """Call a function once, print its result, clean up (an ephemeral run)."""
    from gpufn.client import default as client_mod
    from gpufn.exceptions import InvalidSpec
    from gpufn.net.discovery import resolve
    from gpufn.wire.byvalue import by_value

    pos, kw = parse_call_args(list(args or []))
    fn, modules = load_function(ref)
    try:
        target = resolve(address, token, label="--address")
    except InvalidSpec as e:
        fail(str(e), 2)
    try:
        try:
            client_mod.connect_to(target)
            with by_value(modules):  # worker hosts need none of the files (as for deploy)
                value = fn.remote(*pos, **kw)
        except GpufnError as e:
            fail(f"{type(e).__name__}: {e}")
        except Exception as e:  # the function raised: its own exception, one line
            fail(f"{fn.name} raised {type(e).__name__}: {e}")
        finally:
            client_mod._shutdown_default()
    except KeyboardInterrupt:
        fail("interrupted", 130)
    if as_json:
        typer.echo(json.dumps({"function": fn.name, "result": value}, default=repr))
    else:
        typer.echo(value if isinstance(value, str) else repr(value))


def stop(args: list[str] | None = typer.Argument(None, hidden=True)) -> None:
    """(Not a command: says which one stops what.)"""
    fail("there is no `gpufn stop`: `gpufn shutdown` stops the server (running calls "
         "finish first), `gpufn app stop APP` stops a deployed app", 2)


def register(app: typer.Typer) -> None:
    """Add these commands to the `gpufn` app."""
    app.command()(status)
    app.command()(logs)
    app.command()(usage)
    app.command(context_settings={"ignore_unknown_options": True})(run)
    app.command()(shutdown)
    app.command(hidden=True, context_settings={"ignore_unknown_options": True})(stop)
