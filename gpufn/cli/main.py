"""`gpufn serve | worker` (and the operator's commands from `ops`): parse, call the library,
render, exit with a code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from gpufn.cli import apps, common, ops, plan, tokens
from gpufn.cli.common import fail
from gpufn.exceptions import GpufnError
from gpufn.net import address_file as addrfile
from gpufn.net.cluster_file import load_cluster_file, serve_token, write_cluster_file
from gpufn.net.discovery import port_holder
from gpufn.wire import config

# Help texts are plain text: rich markup would eat "[metrics]" in `gpufn[metrics]`.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="gpufn: self-hosted serverless GPU functions.")
console = Console()
err = Console(stderr=True)


def _public_address(address: str, host: str) -> str:
    """The scheduler's address as other hosts reach it (a wildcard bind names this host)."""
    endpoint, key = config.split_address(address)
    if host in ("0.0.0.0", "*", "::"):
        endpoint = f"tcp://{config.node_id()}:{endpoint.rsplit(':', 1)[1]}"
    return config.join_address(endpoint, key)


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
    detach: bool = typer.Option(False, "--detach", "-d", help="Run in the background (pid and log files in the state dir); stop it with `gpufn shutdown`."),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="GPUFN_STATE_DIR", help="Where the scheduler keeps deployments and CURVE keys (in keys/), worker logs (in logs/), and --detach its pid and log files (default: GPUFN_HOME)."),
    metrics_port: int | None = typer.Option(None, help="Serve Prometheus metrics on this port at /metrics (needs `pip install gpufn[metrics]`)."),
    allow_keys: str | None = typer.Option(None, "--allow-keys", help="Also admit only CURVE clients whose public key (*.key) is in this folder."),
    curve: bool = typer.Option(False, "--curve", envvar="GPUFN_CURVE", help="Encrypt with CURVE on loopback too (always on off loopback)."),
    as_json: bool = typer.Option(False, "--json", help="Print the address and where the token is as JSON."),
    http_port: int | None = typer.Option(None, help="Serve deployed apps over HTTP (JSON, SSE, OpenAI chat, a dashboard) on this port (0 picks one; needs `pip install gpufn[http]`)."),
    http_host: str = typer.Option("127.0.0.1", help="Interface of the HTTP gateway (off loopback it needs --http-cert and --http-key)."),
    http_cert: Path | None = typer.Option(None, help="TLS certificate (PEM) for the HTTP gateway."),
    http_key: Path | None = typer.Option(None, help="TLS private key (PEM, mode 0600) for the HTTP gateway."),
    worker_host_memory: str | None = typer.Option(None, help="Host memory each worker may use, e.g. 32GiB; over it a worker is replaced and its calls fail with HostOutOfMemory (0: unwatched) [GPUFN_WORKER_HOST_MEMORY, 80% of RAM split between workers]."),
    on_sigterm: str = typer.Option("restart", "--on-sigterm", help="restart: SIGTERM stops this server so that a new one takes over (clients and this host's workers wait for it, GPUFN_HEAD_GRACE); stop: SIGTERM stops everything, as Ctrl-C does (a batch job's end)."),
) -> None:
    """Run the scheduler and this host's workers (until Ctrl-C or `gpufn shutdown`).

    With --detach it runs in the background, with a pid file and a log file in the state dir."""
    import signal

    from gpufn.client.embedded import LocalCluster
    from gpufn.client.head import Head
    from gpufn.net import curve as security

    # SIGINT stops for good, also when this was started with SIGINT ignored (a shell's
    # background job `gpufn serve &`, which Python would leave ignoring it): it is what
    # Ctrl-C and `gpufn shutdown --force` send. Until the head runs it is only noted, so
    # that one arriving while the head starts still stops everything it started.
    interrupted: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
    if cpu_devices is not None and cpu_devices < 1:
        fail("--cpu-devices must be at least 1", 2)
    if on_sigterm not in ("restart", "stop"):
        fail(f"--on-sigterm must be restart or stop, not {on_sigterm!r}", 2)
    if metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            fail("--metrics-port needs prometheus-client: pip install 'gpufn[metrics]'", 2)
        os.environ["GPUFN_METRICS_PORT"] = str(metrics_port)  # read by the scheduler process
    metrics_dir = None
    if http_port is not None:
        from gpufn.http import process as http_process

        why = http_process.needs_extra() or http_process.refusal(http_host, http_cert, http_key)
        if why is not None:
            fail(f"--http-port: {why}", 2)
        if metrics_port is not None and not detach:  # the scheduler serves the gateway's metrics too
            metrics_dir = http_process.metrics_folder()
            os.environ["GPUFN_HTTP_METRICS_DIR"] = str(metrics_dir)
    if state_dir is not None:
        os.environ["GPUFN_STATE_DIR"] = str(state_dir.resolve())
    if worker_host_memory is not None:
        os.environ["GPUFN_WORKER_HOST_MEMORY"] = _size(worker_host_memory, "--worker-host-memory")
    if curve:
        os.environ["GPUFN_CURVE"] = "1"  # the scheduler process decides by it
    keys = security.keys_dir()
    try:
        security.server_keys(keys, create=True)  # made on first start; the mode is checked
    except security.SecurityError as e:
        fail(f"the scheduler did not start: {e}")
    holder = port_holder(host, port)
    if holder is not None:
        fail(f"port {port} on {host} is taken by {holder}: pick another with --port (--port 0 "
             "picks a free one)" + (", or stop that server with `gpufn shutdown`"
                                    if "gpufn" in holder else ""))
    if token and new_token:
        fail("--new-token makes a new token, and --token (or GPUFN_TOKEN) gives one: use "
             "one of them (unset GPUFN_TOKEN for --new-token)", 2)
    tok, token_source = serve_token(token, rotate=new_token)  # kept across restarts
    if detach:
        _detach(tok, as_json)
        return
    cluster = LocalCluster(cpu_devices, device_memory, islands, host=host, port=port,
                           token=tok, transport="tcp", workers=workers,
                           keys=keys, allow_keys=Path(allow_keys) if allow_keys else None,
                           head_grace=config.head_grace(), final_on_sigterm=on_sigterm == "stop")
    head = Head(cluster, config.state_dir())
    try:
        address, tok = head.start()
    except security.SecurityError as e:
        fail(f"the scheduler did not start: {e}")
    except GpufnError as e:
        taken = "in use" in str(e)
        fail(f"{e}" + (" (pick another port with --port, or --port 0 for any free one)"
                       if taken else ""))
    address = _public_address(address, host)
    gateway = None
    if http_port is not None:
        gateway = http_process.GatewayProcess(
            address, http_host, http_port, http_cert, http_key,
            http_process.gateway_env(metrics_dir, keys, Path(allow_keys) if allow_keys else None))
        try:
            gateway.start()
        except GpufnError as e:
            head.stop()
            fail(f"{e} (pick another --http-port, or 0 for any free one)")
    token_file = write_cluster_file(address, tok, gateway.url if gateway else None)
    if address_file is not None:
        addrfile.write(address_file, address, public_key=config.split_address(address)[1])
    encrypted = config.split_address(address)[1] is not None
    if as_json:
        typer.echo(json.dumps({"address": address, "token_file": str(token_file),
                               "encrypted": encrypted, "pid": os.getpid(),
                               "http": gateway.url if gateway else None,
                               "token_source": token_source}))
    else:
        console.print(f"gpufn scheduler listening on [bold]{escape(address)}[/]"
                      + (" (CURVE-encrypted)" if encrypted else " (loopback: token only)"),
                      soft_wrap=True)
        console.print(f"the token is in {token_file} (readable by you only); give it to clients "
                      "and workers as GPUFN_TOKEN over a channel you trust", soft_wrap=True)
        kept = {"kept": "the same token as the last start (a new one: --new-token)",
                "new": "a new token: clients and worker hosts with an older one are refused",
                "given": "the token given by --token or GPUFN_TOKEN"}[token_source]
        console.print(f"token: {kept}; users get their own with `gpufn token create NAME`",
                      soft_wrap=True, markup=False)
        # Z85 keys hold shell characters ($ & ( ...) but never a single quote.
        console.print(f"connect with: export GPUFN_ADDRESS='{address}' GPUFN_TOKEN=<the token> "
                      "(on other hosts: here, this GPUFN_HOME's scripts, notebooks and CLI "
                      "find it by themselves)", soft_wrap=True, markup=False)
        if gateway is not None:
            console.print(f"HTTP gateway on {gateway.url} (Authorization: Bearer <the token>; "
                          f"the dashboard is at {gateway.url}/)", soft_wrap=True, markup=False)
        if not workers:
            console.print(f"add workers with: GPUFN_TOKEN=<the token> gpufn worker --address "
                          f"'{address}'", soft_wrap=True, markup=False)
    sys.stdout.flush()
    # SIGTERM (a service manager's restart): stop so that a new `gpufn serve` takes over;
    # this host's workers keep running their calls meanwhile. Ctrl-C stops everything.
    signal.signal(signal.SIGTERM, lambda *_: head.leave() if on_sigterm == "restart"
                  else signal.default_int_handler(signal.SIGINT, None))
    final = True
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if interrupted:
            raise KeyboardInterrupt
        code = head.run()
        final = not head.leaving
    except KeyboardInterrupt:
        code = 0
        head.stop()
    except BaseException:
        head.stop()
        raise
    finally:
        if gateway is not None:
            gateway.stop()
        if metrics_dir is not None:
            import shutil

            shutil.rmtree(metrics_dir, ignore_errors=True)
        if final:
            forget_server(os.getpid())
            if address_file is not None:
                addrfile.remove_if_ours(address_file)
        else:  # the address (and its key) stay for the clients and the next `gpufn serve`
            head.wait_left()
            if common.read_pid() == os.getpid():
                common.pid_file().unlink(missing_ok=True)
    if not as_json:
        console.print("gpufn scheduler stopped" + ("" if final else
                      "; this host's workers wait for the next `gpufn serve`"))
    raise typer.Exit(code if code and code > 0 else 0)


def _detach(token: str, as_json: bool) -> None:
    """Start this same `gpufn serve` in its own session, logging to the state dir; return
    once it listens (or fail with the tail of its log)."""
    import subprocess
    import time

    running = common.read_pid()
    if running is not None:
        fail(f"a detached gpufn server is already running (pid {running}, pid file "
             f"{common.pid_file()}); stop it with `gpufn shutdown`")
    argv = [a for a in sys.argv[1:] if a not in ("--detach", "-d", "--new-token")]
    state = config.state_dir()
    state.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GPUFN_TOKEN=token)  # not on the command line, where ps shows it
    with open(common.log_file(), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpufn.cli.main", *argv], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    common.pid_file().write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 120
    while True:
        saved = load_cluster_file()
        if saved is not None and saved.get("pid") == proc.pid:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            common.pid_file().unlink(missing_ok=True)
            tail = common.log_file().read_text(errors="replace").strip().splitlines()[-1:]
            last = tail[0].removeprefix("error: ") if tail else "no output"
            fail(f"the detached server did not start: {last} (log: {common.log_file()})")
        time.sleep(0.1)
    from gpufn.net.cluster_file import home

    info = {"address": saved["address"], "token_file": str(home() / "cluster.json"),
            "pid": proc.pid, "pid_file": str(common.pid_file()), "log_file": str(common.log_file()),
            "http": saved.get("http")}
    if as_json:
        typer.echo(json.dumps(info))
        return
    console.print(f"gpufn server started in the background (pid {proc.pid}), listening on "
                  f"[bold]{escape(str(info['address']))}[/]", soft_wrap=True)
    console.print(f"log: {info['log_file']} · stop with: gpufn shutdown")
    if info["http"]:
        console.print(f"HTTP gateway on {info['http']}", soft_wrap=True, markup=False)
    console.print(f"the token is in {info['token_file']} (readable by you only)")
    console.print(f"connect with: export GPUFN_ADDRESS='{info['address']}' GPUFN_TOKEN=<the token> "
                  "(on other hosts: here, this GPUFN_HOME's scripts, notebooks and CLI find it "
                  "by themselves)", soft_wrap=True, markup=False)


def forget_server(pid: int) -> None:
    """The server is stopping: remove its pid file and address file if they name it."""
    if common.read_pid() in (pid, None):
        common.pid_file().unlink(missing_ok=True)
    saved = load_cluster_file()
    if saved is not None and saved.get("pid") == pid:
        (config.home() / "cluster.json").unlink(missing_ok=True)


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


apps.register(app)  # gpufn deploy, gpufn app ...


def main() -> None:
    app()


if __name__ == "__main__":
    main()
