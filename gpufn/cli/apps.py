"""`gpufn deploy` and `gpufn app list|history|rollback|stop|logs`: thin commands over
`gpufn.api.deployment`, rendered with rich (or `--json`), exiting non-zero with a one-line
reason on an expected failure."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from gpufn.cli import common
from gpufn.cli.common import ADDRESS_HELP, TOKEN_HELP, fail
from gpufn.exceptions import GpufnError

app_cli = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                      help="Deployed apps: list, history, rollback, stop, logs.")
console = Console()

ADDRESS = typer.Option(None, "--address", help=ADDRESS_HELP)
TOKEN = typer.Option(None, "--token", help=TOKEN_HELP)
JSON = typer.Option(False, "--json", help="Print JSON.")


@contextlib.contextmanager
def _client(address: str | None, token: str | None) -> Iterator[Any]:
    """A client of a running scheduler (never the embedded one: a deployment must outlive
    this command); expected failures exit with one line."""
    client = common.connect(address, token, 10.0)
    try:
        yield client
    except GpufnError as e:
        fail(f"{type(e).__name__}: {e}")
    finally:
        client.close()


def _print_json(data: Any) -> None:
    console.print_json(json.dumps(data, default=str))


def _functions_table(functions: list[dict[str, Any]], extra: bool = False) -> Table:
    t = Table(box=None, pad_edge=False)
    for col in ("function", "spec", "models") + (("calls 1h", "queued", "running") if extra else ()):
        t.add_column(col)
    for f in functions:
        row = [f["name"], f.get("describe", ""), ", ".join(f.get("models", [])) or "-"]
        if extra:
            row += [str(f.get("calls_1h", 0)), str(f.get("queued", 0)), str(f.get("running", 0))]
        t.add_row(*row)
    return t


def deploy_command(
    path: Path = typer.Argument(..., help="The app file, e.g. app.py."),
    name: str | None = typer.Option(None, "--name", help="App name [the file's stem]."),
    tag: str = typer.Option("", "--tag", help="A label for this version (e.g. a release)."),
    strategy: str = typer.Option("rolling", "--strategy",
                                 help="rolling: running calls finish on the old version; "
                                      "recreate: stop them, then switch."),
    check: bool = typer.Option(False, "--check",
                               help="Run each model loader once on a worker before switching."),
    address: str | None = ADDRESS,
    token: str | None = TOKEN,
    as_json: bool = JSON,
) -> None:
    """Deploy every @gpu function and @gpufn.model in an app file under a name and version."""
    from gpufn.api.deployment import DeployError, deploy

    if strategy not in ("rolling", "recreate"):
        fail(f"--strategy {strategy!r}: use rolling or recreate", 2)
    with _client(address, token) as client:
        try:
            d = deploy(path, name=name, tag=tag, strategy=strategy, check=check, client=client)
        except DeployError as e:
            if e.details:
                typer.echo(e.details.rstrip(), err=True)
            fail(str(e))
    if as_json:
        _print_json(d.__dict__)
        return
    state = "unchanged" if d.unchanged else "deployed"
    console.print(f"[bold]{d.app}[/] v{d.version} {state}"
                  + (f" (was v{d.previous})" if d.previous else ""))
    console.print(_functions_table(d.functions))
    for m in d.checked:
        console.print(f"checked: model {m} loaded on a worker")
    for note in d.notes:
        console.print(f"note: {note}")
    if d.functions:
        console.print(f"call: gpufn.lookup({d.app!r}, {d.functions[0]['name']!r}).remote(...)")


@app_cli.command("list")
def list_command(address: str | None = ADDRESS, token: str | None = TOKEN,
                 as_json: bool = JSON) -> None:
    """Apps, their current version, functions, specs and calls in the last hour."""
    from gpufn.api.deployment import list_apps

    with _client(address, token) as client:
        apps = list_apps(client)
    if as_json:
        _print_json(apps)
        return
    if not apps:
        console.print("no apps deployed (gpufn deploy app.py)")
        return
    for a in apps:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(a["created"]))
        tag = f" tag {a['tag']}" if a.get("tag") else ""
        state = "" if a["state"] == "active" else f" [yellow]{a['state']}[/]"
        broken = " [red]broken[/]" if a.get("broken") else ""
        console.print(f"[bold]{a['name']}[/] v{a['version']}{state}{broken}{tag} "
                      f"({when}, {a.get('who') or '?'})")
        console.print(_functions_table(a["functions"], extra=True))
        for f in a["functions"]:
            for e in f.get("errors", []):
                console.print(f"  [red]{f['name']}[/]: {e}", highlight=False)


@app_cli.command("history")
def history_command(app: str = typer.Argument(..., help="The app."),
                    address: str | None = ADDRESS, token: str | None = TOKEN,
                    as_json: bool = JSON) -> None:
    """An app's versions: when, who, tag, git commit, code hash, rollbacks."""
    from gpufn.api.deployment import history

    with _client(address, token) as client:
        h = history(app, client)
    if as_json:
        _print_json(h)
        return
    t = Table(title=f"{h['app']} ({h['state']}, current v{h['current']})", box=None)
    for col in ("version", "time", "who", "tag", "git", "code", "note"):
        t.add_column(col)
    for v in h["versions"]:
        git = (v["git_commit"][:10] + ("+dirty" if v["git_dirty"] else "")) if v["git_commit"] else "-"
        note = f"rollback of v{v['rollback_of']}" if v.get("rollback_of") else v.get("strategy", "")
        mark = "*" if v["version"] == h["current"] else ""
        t.add_row(f"v{v['version']}{mark}", time.strftime("%Y-%m-%d %H:%M:%S",
                                                          time.localtime(v["created"])),
                  v.get("who") or "-", v.get("tag") or "-", git, v["code_hash"][:10], note)
    console.print(t)


def _version(text: str | None) -> int | None:
    if not text:
        return None
    digits = text[1:] if text.lower().startswith("v") else text
    if not digits.isdigit() or int(digits) < 1:
        fail(f"version {text!r}: write it as v3 or 3", 2)
    return int(digits)


@app_cli.command("rollback")
def rollback_command(app: str = typer.Argument(..., help="The app."),
                     version: str | None = typer.Argument(None, help="The version to bring back, "
                                                          "e.g. v2 [the one before the current]."),
                     address: str | None = ADDRESS, token: str | None = TOKEN,
                     as_json: bool = JSON) -> None:
    """Create a new version with an older version's code."""
    from gpufn.api.deployment import rollback

    n = _version(version)
    with _client(address, token) as client:
        d = rollback(app, n, client)
    if as_json:
        _print_json(d.__dict__)
        return
    console.print(f"[bold]{d.app}[/] v{d.version} deployed (the code of an older version; "
                  f"was v{d.previous})")
    for note in d.notes:
        console.print(f"note: {note}")


@app_cli.command("stop")
def stop_command(app: str = typer.Argument(..., help="The app."),
                 address: str | None = ADDRESS, token: str | None = TOKEN,
                 as_json: bool = JSON) -> None:
    """Stop an app: queued calls fail with AppStopped, running calls finish, models leave."""
    from gpufn.api.deployment import stop

    with _client(address, token) as client:
        out = stop(app, client)
    if as_json:
        _print_json(out)
        return
    console.print(f"[bold]{out['app']}[/] stopped; {out['failed_queued']} queued call(s) failed "
                  "with AppStopped; running calls finish")


def register(app: typer.Typer) -> None:
    """Add `deploy` and `app ...` to the main CLI."""
    from gpufn.cli import ops

    app.command("deploy")(deploy_command)
    app_cli.command("logs", help="The same as `gpufn logs` (Modal's spelling): function "
                    "output with invocation ids.")(ops.logs)
    app.add_typer(app_cli, name="app")
