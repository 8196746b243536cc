"""A real `gpufn serve` on a fixed port that tests kill with real signals and start again:
the processes it leaves (supervisor, workers) are tracked from its record (head.json) so
that every one is gone when the test ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..conftest import _alive, assert_all_gone
from ._waits import wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "restart-test-token"  # explicit: the head's token outlives a restart either way


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> set[int]:
    out = set()
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
            out.add(int(e))
    return out


class Head:
    def __init__(self, home: Path, devices: int = 2, **env: str) -> None:
        self.home = home
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.devices = devices
        self.extra = env
        self.proc: subprocess.Popen[str] | None = None
        self.seen: set[int] = set()  # every gpufn process this head had: none may outlive it
        self.serve_args: tuple[str, ...] = ()  # more options of `gpufn serve` (--http-port N)
        self.starts = 0
        (home / "cwd").mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
        env.update({"GPUFN_HOME": str(self.home), "GPUFN_STATE_DIR": str(self.home / "state"),
                    "GPUFN_LOG_DIR": str(self.home / "logs"), "GPUFN_PROGRESS": "0",
                    "GPUFN_LOG_LEVEL": "INFO", "PYTHONPATH": str(ROOT),
                    "PYTHONUNBUFFERED": "1"}, **self.extra, **extra)
        return env

    def record(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.home / "state" / "head.json").read_text()))
        except (OSError, ValueError):
            return {}

    def start(self) -> Head:
        self.starts += 1
        log = open(self.home / f"serve-{self.starts}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpufn.cli.main", "serve", "--port", str(self.port),
             "--cpu-devices", str(self.devices), "--device-memory", "8GiB", "--token", TOKEN,
             *self.serve_args],
            env=self.env(), cwd=self.home / "cwd", stdout=log, stderr=subprocess.STDOUT,
            text=True)
        log.close()
        proc = self.proc

        def up() -> bool:
            assert proc.poll() is None, self.log()
            rec = self.record()
            return rec.get("serve") == proc.pid and bool(rec.get("scheduler"))
        wait_for(up, 120, "gpufn serve to start")
        self.track()
        return self

    def log(self, start: int | None = None) -> str:
        return (self.home / f"serve-{start or self.starts}.log").read_text(errors="replace")

    def track(self) -> set[int]:
        """Note the head's processes now (serve, scheduler, supervisor, workers)."""
        rec = self.record()
        pids = {int(rec.get("serve") or 0)}
        for key in ("scheduler", "supervisor"):
            if rec.get(key):
                pids.add(int(rec[key][0]))
        sup = rec.get("supervisor")
        if sup:
            pids |= children(int(sup[0]))
        if rec.get("serve"):
            pids |= children(int(rec["serve"]))  # the HTTP gateway, with --http-port
        pids.discard(0)
        self.seen |= {p for p in pids if _alive(p)}
        return pids

    def supervisor(self) -> int:
        return int(self.record()["supervisor"][0])

    def scheduler(self) -> int:
        return int(self.record()["scheduler"][0])

    def kill(self, sig: int) -> None:
        """Signal `gpufn serve` and wait for it, its scheduler and its HTTP gateway to be
        gone (the workers stay). An orphaned gateway notices within a second or so; until
        then it still answers, and a test that waits for "the new gateway" must not meet
        the old one."""
        assert self.proc is not None
        self.track()
        sched = self.scheduler()
        sup = self.record().get("supervisor")
        stays = ({int(sup[0])} | children(int(sup[0]))) if sup else set()
        doomed = {sched} | (children(self.proc.pid) - stays)
        self.proc.send_signal(sig)
        self.proc.wait(60)
        assert_all_gone(sorted(doomed), timeout=30)

    def kill_scheduler(self, sig: int) -> int:
        """Signal only the scheduler; `gpufn serve` starts another. Returns the new pid."""
        self.track()
        old = self.scheduler()
        os.kill(old, sig)
        assert_all_gone([old], timeout=30)
        def started() -> int:
            s = self.record().get("scheduler")
            return int(s[0]) if s and int(s[0]) != old else 0
        new = wait_for(started, 60, "gpufn serve to start its scheduler again")
        self.track()
        return new

    def gpufn(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpufn.cli.main", *args],
                              env=self.env(GPUFN_ADDRESS=self.address, GPUFN_TOKEN=TOKEN),
                              capture_output=True, text=True, timeout=timeout)

    def shutdown(self) -> None:
        """`gpufn shutdown`: every process of this head ends."""
        self.track()
        out = self.gpufn("shutdown", "--grace", "5")
        assert out.returncode == 0, out.stdout + out.stderr
        if self.proc is not None:
            self.proc.wait(60)
        assert_all_gone(sorted(self.seen), timeout=30)

    def close(self) -> None:
        """After the test: stop whatever is left (Ctrl-C of serve, then by pid)."""
        self.track()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in self.seen):
            time.sleep(0.1)
        left = [p for p in self.seen if _alive(p)]
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert_all_gone(sorted(self.seen))
        assert not left, f"processes of the head were left behind: {left}"
