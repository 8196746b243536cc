"""The gateway as a child process of `gpufn serve`: started once the scheduler listens,
restarted if it dies, stopped with the server. (No web framework is imported here.)

A child, not a thread of `serve`: a gateway that fails (a bug, memory exhausted by a huge
body) cannot take the scheduler's lifetime with it and is simply started again; it holds
no state a restart loses (its spawned calls are kept by the scheduler, and found there
again); and the same process runs on its own
(`python -m gpufn.http --address ...`) beside a scheduler on another host.
"""

from __future__ import annotations

import logging
import os
import select
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpufn.exceptions import GpufnError
from gpufn.net.curve import is_loopback

log = logging.getLogger("gpufn.http")

RESTART_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0)


def needs_extra() -> str | None:
    """Why the gateway cannot run here (its packages are missing), or None."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return (f"the HTTP gateway needs {e.name}: pip install 'gpufn[http]'")
    return None


def refusal(host: str, cert: Path | None, key: Path | None) -> str | None:
    """Why the gateway may not bind as asked (the scheduler's rules: off loopback only
    encrypted, here with TLS), or None."""
    if (cert is None) != (key is None):
        return "give both --http-cert and --http-key (a TLS certificate and its private key)"
    if cert is None:
        if not is_loopback(host):
            return (f"an HTTP gateway bound to {host} (off loopback) must use TLS, as the "
                    "scheduler's port uses CURVE: pass --http-cert CERT.pem --http-key KEY.pem, "
                    "or bind 127.0.0.1 behind a TLS-terminating proxy on this host")
        return None
    assert key is not None
    for f in (cert, key):
        if not f.is_file():
            return f"{f} is not a file"
    mode = key.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"the TLS private key {key} is readable by others (mode "
                f"{stat.S_IMODE(mode):o}); fix it with: chmod 600 {key}")
    return None


@dataclass
class GatewayProcess:
    address: str  # the scheduler's
    host: str
    port: int
    cert: Path | None = None
    key: Path | None = None
    env: dict[str, str] | None = None  # extra environment (metrics folder, client key)

    def __post_init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._started = 0.0

    @property
    def url(self) -> str:
        scheme = "https" if self.cert else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> str:
        """Start the gateway and return its URL once it listens (GpufnError if it fails)."""
        self._spawn(timeout)
        self._watcher = threading.Thread(target=self._watch, name="gpufn-http-watch", daemon=True)
        self._watcher.start()
        return self.url

    def _spawn(self, timeout: float) -> None:
        r, w = os.pipe()
        cmd = [sys.executable, "-m", "gpufn.http", "--address", self.address, "--host", self.host,
               "--port", str(self.port), "--ready-fd", str(w), "--parent-pid", str(os.getpid())]
        if self.cert is not None and self.key is not None:
            cmd += ["--cert", str(self.cert), "--key", str(self.key)]
        env = {**os.environ, **(self.env or {})}
        env.pop("GPUFN_TOKEN", None)  # it acts with its callers' tokens, never the cluster's
        self._started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, pass_fds=(w,), stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(w)
        try:
            port = self._read_port(r, timeout)
        finally:
            os.close(r)
        self.port = port  # a restart binds the same port (--http-port 0 picked it)

    def _read_port(self, fd: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            assert self.proc is not None
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self._kill()
                raise GpufnError(f"the HTTP gateway did not start on {self.host}:{self.port} "
                                 "(see its output above; is the port taken?)")
            if select.select([fd], [], [], min(left, 0.2))[0]:
                buf += os.read(fd, 64) or b""
        return int(buf.decode().strip())

    def _watch(self) -> None:
        tries = 0
        while not self._stopping.is_set():
            proc = self.proc
            if proc is None:
                return
            code = proc.wait()
            if self._stopping.is_set():
                return
            tries = 0 if time.monotonic() - self._started > 60 else tries + 1  # a crash loop backs off
            delay = RESTART_BACKOFF[min(tries, len(RESTART_BACKOFF)) - 1] if tries else 0.0
            log.warning("the HTTP gateway exited (code %s); starting it again in %.1fs", code, delay)
            print(f"gpufn: the HTTP gateway exited (code {code}); restarting it", file=sys.stderr)
            if self._stopping.wait(delay):
                return
            try:
                self._spawn(60.0)
            except GpufnError as e:
                log.warning("%s", e)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace: float = 5.0) -> None:
        self._stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(2)


def metrics_folder() -> Path:
    """A fresh private folder for the gateway's metrics files (the scheduler's exporter
    reads it: set GPUFN_HTTP_METRICS_DIR to it before the scheduler starts)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="gpufn-http-metrics-"))


def gateway_env(metrics: Path | None, keys: Path | None, allow_keys: Path | None) -> dict[str, str]:
    """The gateway's environment beside the server's own: its metrics folder, and with an
    allow-list the head's own client key (its connections get in like the local workers).
    It prints none of its callers' output (it would land in serve.log, for anyone who
    reads that: each caller reads their own with `gpufn logs`)."""
    env: dict[str, str] = {"GPUFN_PRINT_CALL_OUTPUT": "0"}
    if metrics is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
    if allow_keys is not None and keys is not None:
        from gpufn.net.curve import LOCAL_KEY_NAME, ensure_keypair

        _, secret = ensure_keypair(keys, LOCAL_KEY_NAME)
        env["GPUFN_CLIENT_KEY"] = str(secret)
    return env
