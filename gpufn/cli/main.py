"""`gpufn serve | worker` (and the operator's commands from `ops`): parse, call the library,
render, exit with a code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from gpufn.cli import apps, ops, plan, state, tokens
from gpufn.cli.common import fail
from gpufn.exceptions import GpufnError
from gpufn.net import address_file as addrfile
from gpufn.wire import config

# Help texts are plain text: rich markup would eat "[metrics]" in `gpufn[metrics]`.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="gpufn: self-hosted serverless GPU functions.")
console = Console()
err = Console(stderr=True)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind (0.0.0.0 for a cluster; off loopback, traffic is CURVE-encrypted)."),
    port: int = typer.Option(config.DEFAULT_PORT, help="Port to bind (0 picks a free one)."),
    cpu_devices: int | None = typer.Option(None, help="Simulated devices when no GPU is found (default: GPUFN_CPU_DEVICES, else 2)."),
    device_memory: str | None = typer.Option(None, help="Memory of each simulated device, e.g. 8GiB (default: GPUFN_DEVICE_MEMORY, else 8GiB)."),
    islands: int | None = typer.Option(None, help="Split simulated devices into NVLink-like islands."),
    token: str | None = typer.Option(None, envvar="GPUFN_TOKEN", help="The cluster's (admin) token clients and workers present [the state dir's from the last start, else a new one]."),
    new_token: bool = typer.Option(False, "--new-token", help="Make a new admin token instead of keeping the state dir's: clients and worker hosts with the old one are refused."),
    workers: bool = typer.Option(True, help="Start workers for this host's devices (--no-workers: scheduler only)."),
    address_file: Path | None = typer.Option(None, help="Write the address here (e.g. on a shared filesystem) for `gpufn worker --address-file`."),
    detach_: bool = typer.Option(False, "--detach", "-d", help="Run in the background (pid and log files in the state dir); stop it with `gpufn shutdown`."),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="GPUFN_STATE_DIR", help="Where the scheduler keeps deployments and CURVE keys (in keys/), worker logs (in logs/), and --detach its pid and log files (default: GPUFN_HOME)."),
    metrics_port: int | None = typer.Option(None, help="Serve Prometheus metrics on this port at /metrics (needs `pip install gpufn[metrics]`)."),
    allow_keys: str | None = typer.Option(None, "--allow-keys", help="Also admit only CURVE clients whose public key (*.key) is in this folder."),
    curve: bool = typer.Option(False, "--curve", envvar="GPUFN_CURVE", help="Encrypt with CURVE on loopback too (always on off loopback)."),
    as_json_: bool = typer.Option(False, "--json", help="Print the address and where the token is as JSON."),
    http_port: int | None = typer.Option(None, help="Serve deployed apps over HTTP (JSON, SSE, OpenAI chat, a dashboard) on this port (0 picks one; needs `pip install gpufn[http]`)."),
    http_host: str = typer.Option("127.0.0.1", help="Interface of the HTTP gateway (off loopback it needs --http-cert and --http-key)."),
    http_cert: Path | None = typer.Option(None, help="TLS certificate (PEM) for the HTTP gateway."),
    http_key: Path | None = typer.Option(None, help="TLS private key (PEM, mode 0600) for the HTTP gateway."),
    worker_host_memory: str | None = typer.Option(None, help="Host memory each worker may use, e.g. 32GiB; over it a worker is replaced and its calls fail with HostOutOfMemory (0: unwatched) [GPUFN_WORKER_HOST_MEMORY, 80% of RAM split between workers]."),
    on_sigterm: str = typer.Option("restart", "--on-sigterm", help="restart: SIGTERM stops this server so that a new one takes over (clients and this host's workers wait for it, GPUFN_HEAD_GRACE); stop: SIGTERM stops everything, as Ctrl-C does (a batch job's end)."),
) -> None:
    """Run the scheduler and this host's workers (until Ctrl-C or `gpufn shutdown`).

    With --detach it runs in the background, with a pid file and a log file in the state dir."""
    from gpufn.cluster.serve import Serve, ServeOptions, ServeRefused, as_json, detach

    options = ServeOptions(
        host, port, cpu_devices, device_memory, islands, token, new_token, workers,
        address_file, state_dir, metrics_port, Path(allow_keys) if allow_keys else None, curve,
        http_port, http_host, http_cert, http_key, worker_host_memory, on_sigterm)
    try:
        if detach_:
            _print_detached(detach(options, sys.argv[1:]), as_json_)
            return
        server = Serve(options)
        started = server.start()
    except ServeRefused as e:
        fail(str(e), e.code)
    if as_json_:
        typer.echo(as_json(started))
    else:
        _print_serving(started, workers)
    sys.stdout.flush()
    code = server.run()
    if not as_json_:
        console.print("gpufn scheduler stopped" + ("" if server.final else
                      "; this host's workers wait for the next `gpufn serve`"))
    raise typer.Exit(code)


def _print_serving(started: Any, workers: bool) -> None:
    """The banner of a `gpufn serve` that listens: where, the token, how to connect."""
    address = started.address
    console.print(f"gpufn scheduler listening on [bold]{escape(address)}[/]"
                  + (" (CURVE-encrypted)" if started.encrypted else " (loopback: token only)"),
                  soft_wrap=True)
    console.print(f"the token is in {started.token_file} (readable by you only); give it to "
                  "clients and workers as GPUFN_TOKEN over a channel you trust", soft_wrap=True)
    kept = {"kept": "the same token as the last start (a new one: --new-token)",
            "new": "a new token, made now (one from an earlier start, if any, is refused)",
            "given": "the token given by --token or GPUFN_TOKEN"}[started.token_source]
    console.print(f"token: {kept}; users get their own with `gpufn token create NAME`",
                  soft_wrap=True, markup=False)
    # Z85 keys hold shell characters ($ & ( ...) but never a single quote.
    console.print(f"connect with: export GPUFN_ADDRESS='{address}' GPUFN_TOKEN=<the token> "
                  "(on other hosts: here, this GPUFN_HOME's scripts, notebooks and CLI "
                  "find it by themselves)", soft_wrap=True, markup=False)
    if started.http is not None:
        console.print(f"HTTP gateway on {started.http} (Authorization: Bearer <the token>; "
                      f"the dashboard is at {started.http}/)", soft_wrap=True, markup=False)
    if not workers:
        console.print(f"add workers with: GPUFN_TOKEN=<the token> gpufn worker --address "
                      f"'{address}'", soft_wrap=True, markup=False)


def _print_detached(info: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(info))
        return
    console.print(f"gpufn server started in the background (pid {info['pid']}), listening on "
                  f"[bold]{escape(str(info['address']))}[/]", soft_wrap=True)
    console.print(f"log: {info['log_file']} · stop with: gpufn shutdown")
    if info["http"]:
        console.print(f"HTTP gateway on {info['http']}", soft_wrap=True, markup=False)
    console.print(f"the token is in {info['token_file']} (readable by you only)")
    console.print(f"connect with: export GPUFN_ADDRESS='{info['address']}' GPUFN_TOKEN=<the "
                  "token> (on other hosts: here, this GPUFN_HOME's scripts, notebooks and CLI "
                  "find it by themselves)", soft_wrap=True, markup=False)


def _size(value: str, option: str) -> str:
    """A size option checked here (exit 2 naming it), passed on as bytes."""
    from gpufn.wire.units import parse_memory

    try:
        return str(parse_memory(value, option.lstrip("-")))
    except GpufnError as e:
        fail(str(e), 2)


@app.command()
def worker(
    address: str | None = typer.Option(None, envvar="GPUFN_ADDRESS", help="Scheduler to join, tcp://host:port?key=<its public key>, as `gpufn serve` printed it."),
    token: str | None = typer.Option(None, envvar="GPUFN_TOKEN", help="The cluster's token."),
    cpu_devices: int | None = typer.Option(None, help="Simulated devices when no GPU is found."),
    device_memory: str | None = typer.Option(None, help="Memory of each simulated device."),
    node: str | None = typer.Option(None, help="This host's name in device keys [hostname]."),
    address_file: Path | None = typer.Option(None, help="Wait for `gpufn serve --address-file` to write this file, and join that scheduler."),
    wait: float = typer.Option(0.0, help="With --address-file: give up after this many seconds (0: wait forever)."),
    worker_host_memory: str | None = typer.Option(None, help="Host memory each worker may use, e.g. 32GiB; over it a worker is replaced and its calls fail with HostOutOfMemory (0: unwatched) [GPUFN_WORKER_HOST_MEMORY, 80% of RAM split between workers]."),
) -> None:
    """Join a cluster: start a supervisor and one worker per device of this host.

    It waits for the scheduler, and rejoins it after a restart, retrying with bounded
    backoff; only `gpufn shutdown` (an operator's explicit stop) ends it remotely."""
    if address_file is not None:
        found = addrfile.wait_for(address_file, wait, on_wait=lambda: err.print(
            f"waiting for the head to write {address_file} ..."))
        if found is None:
            fail(f"no address in {address_file} after {wait:g}s")
        address = found["address"]
    if not address:
        fail("no scheduler address: pass --address tcp://HEAD:7555 or set GPUFN_ADDRESS", 2)
    try:
        argv = ["--address", config.normalize_address(address)]
    except GpufnError as e:
        fail(str(e), 2)
    if cpu_devices:
        argv += ["--cpu-devices", str(cpu_devices)]
    if device_memory:
        argv += ["--device-memory", device_memory]
    if node:
        argv += ["--node", node]
    if worker_host_memory is not None:
        argv += ["--worker-host-memory", _size(worker_host_memory, "--worker-host-memory")]
    if token:
        os.environ["GPUFN_TOKEN"] = token
    from gpufn.worker.supervisor.daemon import main as supervisor_main

    supervisor_main(argv)


ops.register(app)
plan.register(app)
tokens.register(app)  # gpufn token ...
state.register(app)  # gpufn state check|restore


apps.register(app)  # gpufn deploy, gpufn app ...


def main() -> None:
    app()


if __name__ == "__main__":
    main()
