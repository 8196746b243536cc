"""`gpufn serve | worker | status`: parse, call the library, render, exit with a code."""

from __future__ import annotations

import json
import os
import secrets
import sys

import typer
from rich.console import Console

from gpufn import config
from gpufn.cli import apps, render
from gpufn.cli.state import load_cluster_file, saved_token, write_cluster_file
from gpufn.exceptions import GpufnError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="gpufn: self-hosted serverless GPU functions.")
console = Console()
err = Console(stderr=True)


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind (0.0.0.0 for a cluster)."),
    port: int = typer.Option(config.DEFAULT_PORT, help="Port to bind (0 picks a free one)."),
    cpu_devices: int | None = typer.Option(None, help="Simulated devices when no GPU is found [GPUFN_CPU_DEVICES, 2]."),
    device_memory: str | None = typer.Option(None, help="Memory of each simulated device, e.g. 8GiB [GPUFN_DEVICE_MEMORY]."),
    islands: int | None = typer.Option(None, help="Split simulated devices into NVLink-like islands."),
    token: str | None = typer.Option(None, envvar="GPUFN_TOKEN", help="Shared secret clients and workers must present (generated if unset)."),
    workers: bool = typer.Option(True, help="Start workers for this host's devices (--no-workers: scheduler only)."),
) -> None:
    """Run the scheduler (and this host's workers) in the foreground until Ctrl-C."""
    import signal

    from gpufn.embedded import LocalCluster

    if cpu_devices is not None and cpu_devices < 1:
        err.print("[red]--cpu-devices must be at least 1[/]")
        raise typer.Exit(2)
    cluster = LocalCluster(cpu_devices, device_memory, islands, host=host, port=port,
                           token=token or secrets.token_hex(16), transport="tcp", workers=workers)
    try:
        address, tok = cluster.start()
    except GpufnError as e:
        err.print(f"[red]the scheduler did not start[/]: {e} (is another `gpufn serve` using "
                  f"port {port}? pick another with --port, or --port 0 for any free one)")
        raise typer.Exit(1) from None
    if not _is_loopback(host):
        address = f"tcp://{host if host not in ('0.0.0.0', '*') else config.node_id()}:{address.rsplit(':', 1)[1]}"
    write_cluster_file(address, tok)
    console.print(f"gpufn scheduler listening on [bold]{address}[/]")
    console.print(f"connect with: export GPUFN_ADDRESS={address} GPUFN_TOKEN={tok}")
    if not workers:
        console.print(f"add workers with: gpufn worker --address {address} --token {tok}")
    sys.stdout.flush()
    def stop(*_: object) -> None:
        if cluster.scheduler is not None:
            cluster.scheduler.terminate()

    signal.signal(signal.SIGTERM, stop)
    try:
        code = cluster.wait()
    except KeyboardInterrupt:
        code = 0
    finally:
        cluster.stop()
    console.print("gpufn scheduler stopped")
    raise typer.Exit(code if code and code > 0 else 0)


@app.command()
def worker(
    address: str | None = typer.Option(None, envvar="GPUFN_ADDRESS", help="Scheduler to join, tcp://host:port."),
    token: str | None = typer.Option(None, envvar="GPUFN_TOKEN", help="The cluster's token."),
    cpu_devices: int | None = typer.Option(None, help="Simulated devices when no GPU is found."),
    device_memory: str | None = typer.Option(None, help="Memory of each simulated device."),
    node: str | None = typer.Option(None, help="This host's name in device keys [hostname]."),
) -> None:
    """Join a cluster: start a supervisor and one worker per device of this host."""
    if not address:
        err.print("[red]no scheduler address[/]: pass --address tcp://HEAD:7555 or set GPUFN_ADDRESS")
        raise typer.Exit(2)
    argv = ["--address", config.normalize_address(address)]
    if cpu_devices:
        argv += ["--cpu-devices", str(cpu_devices)]
    if device_memory:
        argv += ["--device-memory", device_memory]
    if node:
        argv += ["--node", node]
    if token:
        os.environ["GPUFN_TOKEN"] = token
    from gpufn.worker.supervisor import main as supervisor_main

    supervisor_main(argv)


@app.command()
def status(
    address: str | None = typer.Option(None, envvar="GPUFN_ADDRESS", help="Scheduler address [the last `gpufn serve` on this machine]."),
    token: str | None = typer.Option(None, envvar="GPUFN_TOKEN", help="The cluster's token."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw status as JSON."),
    timeout: float = typer.Option(5.0, help="Seconds to wait for the scheduler."),
) -> None:
    """Show devices (memory, running calls, models), functions and counters."""
    from gpufn.client import Client
    from gpufn.exceptions import GpufnError

    if not address:
        saved = load_cluster_file()
        if saved is None:
            err.print("[red]no scheduler address[/]: start one with `gpufn serve`, or pass "
                      "--address / set GPUFN_ADDRESS")
            raise typer.Exit(2)
        address = saved["address"]
    if not token:
        token = saved_token(address)
    try:
        client = Client(address, token, connect_timeout=timeout)
    except GpufnError as e:
        err.print(f"[red]{type(e).__name__}[/]: {e}")
        raise typer.Exit(1) from None
    try:
        st = client.status(timeout)
    finally:
        client.close()
    if as_json:
        console.print_json(json.dumps(st))
    else:
        console.print(render.status_view(st))


apps.register(app)  # gpufn deploy, gpufn app ...


def main() -> None:
    app()


if __name__ == "__main__":
    main()
