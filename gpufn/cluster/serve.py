"""`gpufn serve`'s lifecycle as one object: every option checked before anything starts,
the environment the head's processes read, CURVE keys, the port, the token, the head
(scheduler and supervisor), the HTTP gateway, the cluster and address files, signals,
and a stop that leaves nothing behind. The CLI command parses options and renders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufn.cluster import gateway as http_process
from gpufn.cluster import state_check
from gpufn.cluster.embedded import LocalCluster
from gpufn.cluster.head import Head
from gpufn.exceptions import GpufnError
from gpufn.net import address_file as addrfile
from gpufn.net import curve as security
from gpufn.net.cluster_file import home, load_cluster_file, serve_token, write_cluster_file
from gpufn.net.discovery import port_holder
from gpufn.net.private_files import open_private_append
from gpufn.net.processes import alive
from gpufn.wire import config
from gpufn.wire.units import parse_memory

ON_SIGTERM = ("restart", "stop")


class ServeRefused(GpufnError):
    """`gpufn serve` did not start: `code` 2 for a bad option, 1 for anything else."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def pid_file() -> Path:
    return config.state_dir() / "serve.pid"


def log_file() -> Path:
    return config.state_dir() / "serve.log"


def read_pid() -> int | None:
    """The detached server's pid, if its pid file names a live process."""
    try:
        pid = int(pid_file().read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def forget_server(pid: int) -> None:
    """The server is stopping: remove its pid file and address file if they name it."""
    if read_pid() in (pid, None):
        pid_file().unlink(missing_ok=True)
    saved = load_cluster_file()
    if saved is not None and saved.get("pid") == pid:
        (config.home() / "cluster.json").unlink(missing_ok=True)


def forget_dead_server() -> list[Path]:
    """After `gpufn shutdown --force`: the pid file and cluster file a server that died
    left (their pid no longer runs) are removed, so nothing names a stopped server."""
    gone = []
    try:
        pid: int | None = int(pid_file().read_text().strip())
    except FileNotFoundError:
        pid = 0
    except (OSError, ValueError):
        pid = None  # unreadable: it names nothing
    if pid != 0 and (pid is None or not alive(pid)):
        pid_file().unlink(missing_ok=True)
        gone.append(pid_file())
    saved = load_cluster_file()
    cpid = saved.get("pid") if saved is not None else None
    if isinstance(cpid, int) and not alive(cpid):
        (config.home() / "cluster.json").unlink(missing_ok=True)
        gone.append(config.home() / "cluster.json")
    return gone


def public_address(address: str, host: str) -> str:
    """The scheduler's address as other hosts reach it (a wildcard bind names this host)."""
    endpoint, key = config.split_address(address)
    if host in ("0.0.0.0", "*", "::"):
        endpoint = f"tcp://{config.node_id()}:{endpoint.rsplit(':', 1)[1]}"
    return config.join_address(endpoint, key)


@dataclass(frozen=True)
class ServeOptions:
    """What `gpufn serve` was asked for (the CLI's options, one field each)."""

    host: str = "127.0.0.1"
    port: int = config.DEFAULT_PORT
    cpu_devices: int | None = None
    device_memory: str | None = None
    islands: int | None = None
    token: str | None = None
    new_token: bool = False
    workers: bool = True
    address_file: Path | None = None
    state_dir: Path | None = None
    metrics_port: int | None = None
    allow_keys: Path | None = None
    curve: bool = False
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    http_cert: Path | None = None
    http_key: Path | None = None
    worker_host_memory: str | None = None
    on_sigterm: str = "restart"

    def check(self) -> None:
        """Every option judged before anything starts (`ServeRefused`, code 2, naming it)."""
        def bad(why: str) -> ServeRefused:
            return ServeRefused(why, 2)

        for name, port in (("--port", self.port), ("--http-port", self.http_port),
                           ("--metrics-port", self.metrics_port)):
            if port is not None and not 0 <= port <= 65535:
                raise bad(f"{name} {port} is not a port: give 1-65535 (0 picks a free one)")
        if self.cpu_devices is not None and self.cpu_devices < 1:
            raise bad("--cpu-devices must be at least 1")
        if self.islands is not None and self.islands < 1:
            raise bad("--islands must be at least 1")
        for name, size in (("--device-memory", self.device_memory),
                           ("--worker-host-memory", self.worker_host_memory)):
            if size is not None:
                try:
                    parse_memory(size, name.lstrip("-"))
                except GpufnError as e:
                    raise bad(str(e)) from None
        if self.on_sigterm not in ON_SIGTERM:
            raise bad(f"--on-sigterm must be restart or stop, not {self.on_sigterm!r}")
        if self.token and self.new_token:
            raise bad("--new-token makes a new token, and --token (or GPUFN_TOKEN) gives one: "
                      "use one of them (unset GPUFN_TOKEN for --new-token)")
        if self.allow_keys is not None and not self.allow_keys.is_dir():
            raise bad(f"--allow-keys {self.allow_keys} is not a folder of *.key files")
        if self.metrics_port is not None:
            try:
                import prometheus_client  # noqa: F401
            except ImportError:
                raise bad("--metrics-port needs prometheus-client: pip install 'gpufn[metrics]'") from None
        if self.http_port is not None:
            why = http_process.needs_extra() or http_process.refusal(
                self.http_host, self.http_cert, self.http_key)
            if why is not None:
                raise bad(f"--http-port: {why}")

    def check_state(self) -> None:
        """The state directory's files, before anything reads or writes them: a damaged
        one refuses the start (`ServeRefused`, code 1: one line naming it and the fix)."""
        state = self.state_dir.resolve() if self.state_dir is not None else config.state_dir()
        why = state_check.refusal(state, token_given=bool(self.token) or self.new_token)
        if why is not None:
            raise ServeRefused(why)


@dataclass(frozen=True)
class Started:
    """What a started `gpufn serve` tells its user."""

    address: str
    token_file: Path
    token_source: str  # "kept", "new" or "given"
    http: str | None

    @property
    def encrypted(self) -> bool:
        return config.split_address(self.address)[1] is not None


class Serve:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.head: Head | None = None
        self.gateway: http_process.GatewayProcess | None = None
        self.metrics_dir: Path | None = None
        self.final = True  # a final stop (else SIGTERM: the next serve adopts the workers)
        self._interrupted: list[int] = []

    def start(self) -> Started:
        """Check, then start everything; `ServeRefused` says why not (nothing is left)."""
        o = self.options
        # SIGINT stops for good, also when this was started with SIGINT ignored (a shell's
        # background job `gpufn serve &`): it is what Ctrl-C and `gpufn shutdown --force`
        # send. Until the head runs it is only noted, so that one arriving while the head
        # starts still stops everything it started.
        signal.signal(signal.SIGINT, lambda *_: self._interrupted.append(1))
        o.check()
        o.check_state()
        keys = self._environment()
        try:
            tok, token_source = serve_token(o.token, rotate=o.new_token)  # kept across restarts
        except GpufnError as e:
            raise ServeRefused(str(e)) from None
        cluster = LocalCluster(o.cpu_devices, o.device_memory, o.islands, host=o.host,
                               port=o.port, token=tok, transport="tcp", workers=o.workers,
                               keys=keys, allow_keys=o.allow_keys,
                               head_grace=config.head_grace(),
                               final_on_sigterm=o.on_sigterm == "stop")
        self.head = Head(cluster, config.state_dir())
        try:
            address, tok = self.head.start()
        except security.SecurityError as e:
            raise ServeRefused(f"the scheduler did not start: {e}") from None
        except GpufnError as e:
            taken = " (pick another port with --port, or --port 0 for any free one)"
            raise ServeRefused(f"{e}" + (taken if "in use" in str(e) else "")) from None
        address = public_address(address, o.host)
        if o.http_port is not None:
            self.gateway = http_process.GatewayProcess(
                address, o.http_host, o.http_port, o.http_cert, o.http_key,
                http_process.gateway_env(self.metrics_dir, keys, o.allow_keys))
            try:
                self.gateway.start()
            except GpufnError as e:
                self.head.stop()
                raise ServeRefused(f"{e} (pick another --http-port, or 0 for any free one)") from None
        url = self.gateway.url if self.gateway else None
        try:
            token_file = write_cluster_file(address, tok, url)
        except OSError as e:  # a full disk: nothing is left running
            if self.gateway is not None:
                self.gateway.stop()
            self.head.stop()
            raise ServeRefused(f"cannot write {home() / 'cluster.json'} ({e.strerror}): free "
                               "space there and start again") from None
        if o.address_file is not None:
            addrfile.write(o.address_file, address, public_key=config.split_address(address)[1])
        return Started(address, token_file, token_source, url)

    def _environment(self) -> Path:
        """What the head's processes read from the environment; the CURVE keys (made on
        the first start, their mode checked); the port free. Returns the keys' folder."""
        o = self.options
        if o.metrics_port is not None:
            os.environ["GPUFN_METRICS_PORT"] = str(o.metrics_port)  # read by the scheduler
            if o.http_port is not None:  # the scheduler serves the gateway's metrics too
                self.metrics_dir = http_process.metrics_folder()
                os.environ["GPUFN_HTTP_METRICS_DIR"] = str(self.metrics_dir)
        _use_state_dir(o)
        if o.worker_host_memory is not None:
            os.environ["GPUFN_WORKER_HOST_MEMORY"] = str(
                parse_memory(o.worker_host_memory, "worker-host-memory"))
        if o.curve:
            os.environ["GPUFN_CURVE"] = "1"  # the scheduler process decides by it
        keys = security.keys_dir()
        made = [f for f in (keys / f"{security.SERVER_KEY_NAME}.key",
                            keys / f"{security.SERVER_KEY_NAME}.key_secret") if not f.exists()]
        try:
            security.server_keys(keys, create=True)
        except security.SecurityError as e:
            raise ServeRefused(f"the scheduler did not start: {e}") from None
        except OSError as e:  # a full state disk: no half-made key pair is left
            for f in made:
                f.unlink(missing_ok=True)
            raise ServeRefused(f"cannot make the CURVE keys in {keys} ({e.strerror}): free "
                               "space on the state directory and start again") from None
        holder = port_holder(o.host, o.port)
        if holder is not None:
            raise ServeRefused(
                f"port {o.port} on {o.host} is taken by {holder}: pick another with --port "
                "(--port 0 picks a free one)"
                + (", or stop that server with `gpufn shutdown`" if "gpufn" in holder else ""))
        return keys

    def run(self) -> int:
        """Until a final stop (Ctrl-C, `gpufn shutdown`) or SIGTERM (with --on-sigterm
        restart: stop so that a new `gpufn serve` takes over; this host's workers keep
        running their calls meanwhile). Returns the exit code; everything is stopped."""
        head = self.head
        assert head is not None
        restart = self.options.on_sigterm == "restart"
        signal.signal(signal.SIGTERM, lambda *_: head.leave() if restart
                      else signal.default_int_handler(signal.SIGINT, None))
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if self._interrupted:
                raise KeyboardInterrupt
            code = head.run()
            self.final = not head.leaving
        except KeyboardInterrupt:
            code = 0
            head.stop()
        except BaseException:
            head.stop()
            raise
        finally:
            self._close()
        return code if code and code > 0 else 0

    def _close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        if self.final:
            forget_server(os.getpid())
            if self.options.address_file is not None:
                addrfile.remove_if_ours(self.options.address_file)
        else:  # the address (and its key) stay for the clients and the next `gpufn serve`
            assert self.head is not None
            self.head.wait_left()
            if read_pid() == os.getpid():
                pid_file().unlink(missing_ok=True)


def _use_state_dir(o: ServeOptions) -> None:
    """--state-dir, for this process and the ones it starts (they read GPUFN_STATE_DIR)."""
    if o.state_dir is not None:
        os.environ["GPUFN_STATE_DIR"] = str(o.state_dir.resolve())


def detach(options: ServeOptions, argv: list[str]) -> dict[str, Any]:
    """Start this same `gpufn serve` (`argv`) in its own session, logging to the state
    dir; return what it said once it listens (`ServeRefused` with the tail of its log)."""
    options.check()
    _use_state_dir(options)
    options.check_state()
    running = read_pid()
    if running is not None:
        raise ServeRefused(f"a detached gpufn server is already running (pid {running}, pid "
                           f"file {pid_file()}); stop it with `gpufn shutdown`")
    try:
        token, _ = serve_token(options.token, rotate=options.new_token)
    except GpufnError as e:
        raise ServeRefused(str(e)) from None
    argv = [a for a in argv if a not in ("--detach", "-d", "--new-token")]
    config.state_dir().mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GPUFN_TOKEN=token)  # not on the command line, where ps shows it
    # 0600: the log holds what the head says of every call and user.
    with os.fdopen(open_private_append(log_file()), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpufn.cli.main", *argv], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pid_file().write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 120
    while True:
        saved = load_cluster_file()
        if saved is not None and saved.get("pid") == proc.pid:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            pid_file().unlink(missing_ok=True)
            tail = log_file().read_text(errors="replace").strip().splitlines()[-1:]
            last = tail[0].removeprefix("error: ") if tail else "no output"
            raise ServeRefused(f"the detached server did not start: {last} (log: {log_file()})")
        time.sleep(0.1)
    return {"address": saved["address"], "token_file": str(home() / "cluster.json"),
            "pid": proc.pid, "pid_file": str(pid_file()), "log_file": str(log_file()),
            "http": saved.get("http")}


def as_json(started: Started) -> str:
    return json.dumps({"address": started.address, "token_file": str(started.token_file),
                       "encrypted": started.encrypted, "pid": os.getpid(),
                       "http": started.http, "token_source": started.token_source})
