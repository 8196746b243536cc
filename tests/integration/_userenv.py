"""A user's shell for subprocess tests: no GPUFN_* variable at all (the suite's own fixtures
export some; they are stripped), a HOME of its own (so ~/.gpufn is the test's), and the
`gpufn` command, a `python -c` script and a detached `gpufn serve` run as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..conftest import assert_all_gone

ROOT = Path(__file__).resolve().parents[2]


def user_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_") and k != "PYTHONPATH"}
    env.update({"HOME": str(home), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}, **extra)
    return env


@dataclass
class User:
    """One user's home; `gpufn(...)` and `python(...)` run there with no GPUFN_* set."""

    home: Path
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)

    @property
    def gpufn_home(self) -> Path:
        return self.home / ".gpufn"

    def env(self, **extra: str) -> dict[str, str]:
        return user_env(self.home, **{**self.extra, **extra})

    def gpufn(self, *args: str, timeout: float = 120, cwd: Path | None = None,
              **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpufn.cli.main", *args], env=self.env(**extra),
                              capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT)

    def python(self, code: str, *args: str, timeout: float = 120, cwd: Path | None = None,
               **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, *args], env=self.env(**extra),
                              capture_output=True, text=True, timeout=timeout, cwd=cwd or self.home)

    def cluster_file(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.gpufn_home / "cluster.json").read_text())
        return data


@dataclass
class Detached:
    """`gpufn serve --detach --port 0` in a user's home; `stop()` shuts it down (or kills
    it) and checks that none of its processes is left."""

    user: User
    devices: int = 2
    info: dict[str, Any] = field(default_factory=dict)

    def start(self) -> Detached:
        r = self.user.gpufn("serve", "--detach", "--port", "0", "--cpu-devices", str(self.devices),
                            "--json", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        self.info = json.loads(r.stdout)
        return self

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return int(self.info["pid"])

    def pids(self) -> list[int]:
        """The serve process and every process under it (scheduler, supervisor, workers)."""
        out = [self.pid]
        todo = [self.pid]
        while todo:
            kids = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True,
                                  text=True).stdout.split()
            out += [int(k) for k in kids]
            todo += [int(k) for k in kids]
        return out

    def scheduler_pid(self) -> int:
        found = subprocess.run(["pgrep", "-f", f"gpufn.scheduler .*--parent-pid {self.pid}"],
                               capture_output=True, text=True).stdout.split()
        assert found, "no scheduler process under the detached server"
        return int(found[0])

    def stop(self) -> None:
        pids = self.pids()
        r = self.user.gpufn("shutdown", "--grace", "5", timeout=90)
        if r.returncode != 0:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert_all_gone(pids, timeout=30)


def wait_for(cond: Any, timeout: float = 30.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
