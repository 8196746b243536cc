"""A real `gpufn serve` subprocess on a temporary home and state directory, started in a
folder of its own (so its workers cannot import the tests' app files by name)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpufn.net.cluster_file import read_cluster_file

from ..conftest import assert_all_gone


def serve_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_") and k != "PYTHONPATH"}
    env.update({"GPUFN_HOME": str(home), "GPUFN_STATE_DIR": str(home / "state"),
                "GPUFN_PROGRESS": "0", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}, **extra)
    return env


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def gpufn_cmd() -> list[str]:
    return [sys.executable, "-m", "gpufn.cli.main"]


class Served:
    """`gpufn serve --port 0` with `devices` simulated devices; `restart()` keeps the
    state directory (deployments) and gets a new address."""

    def __init__(self, home: Path, devices: int = 2, memory: str = "8GiB",
                 **extra_env: str) -> None:
        self.home = home
        self.devices, self.memory = devices, memory
        self.extra_env = extra_env  # GPUFN_* settings of the server's processes
        self.proc: subprocess.Popen[str] | None = None
        self.address = self.token = ""
        (home / "cwd").mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        return serve_env(self.home, **{**self.extra_env, **extra})

    def start(self) -> Served:
        (self.home / "cluster.json").unlink(missing_ok=True)
        log = open(self.home / "serve.log", "a")  # noqa: SIM115 (the child keeps writing it)
        # Started as a shell's background job is (SIGINT ignored): `stop` still stops it.
        self.proc = subprocess.Popen(
            [*gpufn_cmd(), "serve", "--port", "0", "--cpu-devices", str(self.devices),
             "--device-memory", self.memory],
            env=self.env(), cwd=self.home / "cwd", stdout=log, stderr=subprocess.STDOUT, text=True,
            preexec_fn=_ignore_sigint)
        log.close()
        deadline = time.monotonic() + 90
        path = self.home / "cluster.json"
        # Until it parses: serve writes it in place, so it may be seen empty for a moment.
        while (data := read_cluster_file(path)) is None:
            assert self.proc.poll() is None, (self.home / "serve.log").read_text()
            assert time.monotonic() < deadline, (self.home / "serve.log").read_text()
            time.sleep(0.05)
        self.address, self.token = data["address"], data["token"]
        return self

    def pids(self) -> list[int]:
        """The scheduler (started with our pid as its parent) and the workers (by port)."""
        assert self.proc is not None
        out = []
        patterns = [f"--parent-pid {self.proc.pid}( |$)"]
        if self.address:  # (none yet if it failed to start)
            patterns.append(self.address.rsplit(":", 1)[1])
        for pattern in patterns:
            out += subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True,
                                  text=True).stdout.split()
        return sorted({int(x) for x in out})

    def stop(self) -> None:
        if self.proc is None:
            return
        pids = self.pids()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        assert_all_gone(pids)

    def restart(self) -> Served:
        self.stop()
        return self.start()
