"""The embedded local cluster: a scheduler and a supervisor as child processes.

Started by the first `.remote()` when no cluster is found (`gpufn.net.discovery`): one
worker per detected GPU, or simulated CPU devices (GPUFN_CPU_DEVICES, GPUFN_DEVICE_MEMORY),
with a state dir of its own. It lives as long as the interpreter and is torn down at exit;
the children also watch their parent and stop by themselves if it dies, so no process is
left behind.
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpufn.exceptions import ConnectionLost
from gpufn.net.curve import LOCAL_KEY_NAME, ServerSecurity, ensure_keypair
from gpufn.net.private_files import open_private_append, private_dir
from gpufn.net.processes import alive
from gpufn.wire import config

# The scheduler writes this before a one-line reason on its ready pipe when it cannot start.
START_FAILED = "!"


def private_state_dir() -> Path:
    """A new state dir of an embedded cluster's own (deployments, worker logs), never a
    served cluster's: `$TMPDIR/gpufn-$UID/embedded/<pid>-<random>`, 0700. Folders left by
    processes that died without cleaning up are removed here."""
    runtime = config.runtime_dir()
    runtime.mkdir(mode=0o700, exist_ok=True)
    root = runtime / "embedded"
    root.mkdir(mode=0o700, exist_ok=True)
    for old in root.iterdir():
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))


def _extra_pythonpath() -> list[str]:
    """sys.path entries of this process that a fresh interpreter would not have
    (the script's folder, test roots), so workers import the same user modules."""
    prefixes = {os.path.realpath(x) for x in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(path) or any(path.startswith(pre + os.sep) or path == pre
                                          for pre in prefixes):
            continue
        if path not in out:
            out.append(path)
    return out


class LocalCluster:
    """A scheduler process and (optionally) a supervisor for this host's devices.

    The embedded cluster uses it with a Unix socket; `gpufn serve` with a TCP address and
    `head_grace` (see `gpufn.cluster.head`): then the scheduler keeps its books on disk
    and the supervisor does not follow this process, so it outlives a restart.
    """

    def __init__(
        self, cpu_devices: int | None = None, device_memory: str | int | None = None,
        islands: int | None = None, extra_env: dict[str, str] | None = None, *,
        host: str = "127.0.0.1", port: int = 0, token: str | None = None,
        transport: str | None = None, workers: bool = True, keys: Path | None = None,
        allow_keys: Path | None = None, private_state: bool = False,
        head_grace: float = 0.0, final_on_sigterm: bool = False,
    ) -> None:
        self.cpu_devices = cpu_devices
        self.device_memory = device_memory
        self.islands = islands
        self.extra_env = extra_env or {}
        self.host, self.port, self.workers = host, port, workers
        self.transport = transport or config.embedded_transport()
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.supervisor: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.token = token or secrets.token_hex(16)
        self.keys, self.allow_keys = keys, allow_keys  # CURVE (see gpufn.net.curve)
        # The embedded cluster keeps its state (and worker logs) in a folder of its own,
        # removed when it stops; `gpufn serve` uses GPUFN_STATE_DIR.
        self.private_state = private_state
        self.state_dir: Path | None = None
        self.label = "the embedded gpufn scheduler" if private_state else "the gpufn scheduler"
        self.head_grace = head_grace  # >0: `gpufn serve`'s, whose workers outlive it
        self.final_on_sigterm = final_on_sigterm  # SIGTERM ends the scheduler for good
        self._env_cache: dict[str, str] | None = None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("GPUFN_ADDRESS", None)
        env["GPUFN_TOKEN"] = self.token
        paths = _extra_pythonpath() + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.update(self.extra_env)
        if self.state_dir is not None:
            env["GPUFN_STATE_DIR"] = str(self.state_dir)
        return env

    def _security_args(self, env: dict[str, str]) -> list[str]:
        """Scheduler arguments for CURVE; refuses here, before any process starts, what
        the scheduler would refuse (an off-loopback bind without keys, an unsafe key)."""
        ipc = self.transport == "ipc"
        if ServerSecurity.for_bind(self.host, ipc, self.keys, self.allow_keys) is None:
            return []
        assert self.keys is not None
        args = ["--keys", str(self.keys)]
        if self.allow_keys is not None:
            # This host's supervisor and workers get in with a key pair of their own.
            _, secret = ensure_keypair(self.keys, LOCAL_KEY_NAME)
            env["GPUFN_CLIENT_KEY"] = str(secret)
            args += ["--allow-keys", str(self.allow_keys)]
        return args

    def start(self, timeout: float = 60.0, supervise: bool = True) -> tuple[str, str]:
        """Start the scheduler and (with `workers`, unless `supervise` is False) the
        supervisor; returns (address, token)."""
        if self.private_state and self.state_dir is None:
            self.state_dir = private_state_dir()
        env = self._env_cache = self._env()
        # Before the pipe: a refusal here leaves nothing to clean up.
        security_args = self._security_args(env)
        self.address = self._start_scheduler(env, security_args, timeout)
        if self.workers and supervise:
            self.start_supervisor(env)
        return self.address, self.token

    def restart_scheduler(self, timeout: float = 60.0) -> str:
        """Start the scheduler again (it died), on the same address."""
        env = self._env_cache or self._env()
        self.address = self._start_scheduler(env, self._security_args(env), timeout)
        return self.address

    def _start_scheduler(self, env: dict[str, str], security_args: list[str],
                         timeout: float) -> str:
        r, w = os.pipe()
        cmd = [sys.executable, "-m", "gpufn.scheduler", "--host", self.host, "--port",
               str(self.port), "--ready-fd", str(w), "--parent-pid", str(os.getpid()),
               *security_args]
        if self.head_grace:
            cmd.append("--durable")
        if self.final_on_sigterm:
            cmd.append("--final-on-sigterm")
        if self.transport == "ipc":
            sock_dir = config.runtime_dir()
            sock_dir.mkdir(mode=0o700, exist_ok=True)
            cmd += ["--ipc", str(sock_dir / f"sched-{os.getpid()}-{secrets.token_hex(4)}.sock")]
        self.scheduler = subprocess.Popen(
            cmd,
            env=env, pass_fds=(w,), stdin=subprocess.DEVNULL, start_new_session=True,
        )
        os.close(w)
        try:
            return self._read_address(r, timeout)
        except BaseException:
            self._remove_state()
            raise
        finally:
            os.close(r)

    def start_supervisor(self, env: dict[str, str] | None = None) -> None:
        env = env or self._env_cache or self._env()
        cmd = [sys.executable, "-m", "gpufn.worker.supervisor", "--address", self.address]
        out = None
        if self.head_grace:  # outlives us: its own log, no parent to follow
            cmd += ["--head-grace", f"{self.head_grace:g}"]
            logs = private_dir(config.log_dir())
            out = os.fdopen(open_private_append(logs / f"supervisor-{config.node_id()}.log"), "ab")
        else:
            cmd += ["--parent-pid", str(os.getpid())]
        if self.cpu_devices:
            cmd += ["--cpu-devices", str(self.cpu_devices)]
        if self.device_memory:
            cmd += ["--device-memory", str(self.device_memory)]
        if self.islands:
            cmd += ["--islands", str(self.islands)]
        try:
            self.supervisor = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                               stdout=out, stderr=out, start_new_session=True)
        finally:
            if out is not None:
                out.close()

    def wait(self) -> int:
        """Block until the scheduler exits (gpufn serve); returns its exit code."""
        assert self.scheduler is not None
        return self.scheduler.wait()

    def _read_address(self, fd: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            assert self.scheduler is not None
            if left <= 0 or self.scheduler.poll() is not None:
                if self.scheduler.poll() is None:
                    self.scheduler.kill()
                self.scheduler.wait()
                raise ConnectionLost(
                    f"{self.label} did not start (see the output above); set "
                    "GPUFN_LOG_LEVEL=INFO for details")
            if select.select([fd], [], [], min(left, 0.2))[0]:
                chunk = os.read(fd, 4096)
                if not chunk and self.scheduler.poll() is not None:
                    continue
                buf += chunk
        line = buf.decode().strip()
        if line.startswith(START_FAILED):
            self.stop()
            raise ConnectionLost(f"{self.label} did not start: {line[len(START_FAILED):]}")
        return line

    def wait_for_devices(self, client: Any, timeout: float = 60.0) -> None:
        """Block until the supervisor has announced its devices (workers may still start)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.status().get("devices"):
                return
            if self.supervisor is not None and self.supervisor.poll() is not None:
                raise ConnectionLost(
                    f"the embedded gpufn supervisor exited with code {self.supervisor.returncode} "
                    "(see the output above)")
            time.sleep(0.02)
        raise ConnectionLost(f"no devices registered within {timeout:.0f}s")

    def stop(self, grace: float = 5.0) -> None:
        """Stop both for good: the scheduler's SIGINT fails its clients' calls (SIGTERM
        would have them wait for a restart)."""
        for proc, sig in ((self.supervisor, signal.SIGTERM), (self.scheduler, signal.SIGINT)):
            if proc is not None and proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass
        for proc in (self.supervisor, self.scheduler):
            if proc is None:
                continue
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.supervisor = self.scheduler = None
        self._remove_state()

    def _remove_state(self) -> None:
        if self.private_state and self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None
