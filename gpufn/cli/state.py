"""`gpufn state check|restore`: the head's state directory, checked file by file, and a
damaged file put right (thin: parse, call `gpufn.cluster.state_check`, render)."""

from __future__ import annotations

from pathlib import Path

import typer

from gpufn.cli.common import fail
from gpufn.exceptions import GpufnError

state_cli = typer.Typer(add_completion=False, no_args_is_help=True, help=(
    "The state directory of `gpufn serve` (deployments, usage, users, token, keys): check "
    "it, and put a damaged file right."))
_DIR = typer.Option(None, "--state-dir", envvar="GPUFN_STATE_DIR",
                    help="The state directory [GPUFN_STATE_DIR, else GPUFN_HOME].")


def _state_dir(given: Path | None) -> Path:
    from gpufn.wire import config

    return (given or config.state_dir()).absolute()


def check(state_dir: Path | None = _DIR) -> None:
    """Check every file of the state directory; exit 1 if one is damaged."""
    from gpufn.cluster import state_check

    d = _state_dir(state_dir)
    damaged = {x.path.name: x for x in state_check.check(d)}
    for name in state_check.CHECKS:
        if not (d / name).exists():
            continue
        found = damaged.get(name)
        typer.echo(f"{'damaged' if found else 'ok':8} {d / name}"
                   + (f": {found.why}" if found else ""))
    for found in damaged.values():
        typer.echo(f"{found.path.name}: {found.fix()}", err=True)
    raise typer.Exit(1 if damaged else 0)


def restore(path: Path = typer.Argument(..., help="The damaged file (as `gpufn serve` or "
                                        "`gpufn state check` named it).")) -> None:
    """Keep a damaged state file aside and put back its newest good backup, else what
    can still be read of it (gpufn serve must be stopped)."""
    from gpufn.cluster import state_check

    try:
        done = state_check.restore(path)
    except (GpufnError, OSError) as e:
        fail(str(e))
    for line in done:
        typer.echo(line)


def register(app: typer.Typer) -> None:
    """Add `gpufn state ...` to the `gpufn` app."""
    state_cli.command()(check)
    state_cli.command()(restore)
    app.add_typer(state_cli, name="state")
