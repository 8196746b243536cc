"""The multi-host fixture: a head, two worker hosts and two client hosts, each in its own
network namespace (own loopback, own GPUFN_HOME), joined by a bridge on 10.213.0.0/24.

The head runs `gpufn serve --no-workers --address-file`, each worker host
`gpufn worker --address-file ... --cpu-devices 2 --node hostN`, and each client host a
driver (`_driver`) the tests hand jobs to. Everything is torn down afterwards: processes
by pid, then the namespaces (which removes the links and the bridge).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.netns import Host, Network, netns_unavailable

REPO = str(Path(__file__).resolve().parents[2])
PORT = 7555
HEARTBEAT_TIMEOUT = 4.0


class Driver:
    """A client process in a client namespace, running jobs from `tests.multihost.jobs`."""

    def __init__(self, net: Network, host: Host, env: dict[str, str]) -> None:
        self.host = host
        self.proc = net.spawn(host, [sys.executable, "-m", "tests.multihost._driver"], env,
                              "driver.log", cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
        self._results: dict[str, dict[str, Any]] = {}
        self._cv = threading.Condition()
        self._n = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cv:
                self._results[msg["id"]] = msg
                self._cv.notify_all()
        with self._cv:
            self._results.setdefault("_exit", {"ok": False})
            self._cv.notify_all()

    def submit(self, job: str, **args: Any) -> str:
        self._n += 1
        rid = f"{job}-{self._n}"
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": rid, "job": job, "args": args}) + "\n").encode())
        self.proc.stdin.flush()
        return rid

    def wait(self, rid: str, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while rid not in self._results:
                if "_exit" in self._results:
                    raise AssertionError(f"the driver on {self.host.name} exited; see "
                                         f"{self.host.log_dir / 'driver.log'}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"job {rid} on {self.host.name} did not finish "
                                         f"within {timeout:.0f}s")
                self._cv.wait(left)
            return self._results.pop(rid)

    def call(self, job: str, timeout: float = 120.0, **args: Any) -> Any:
        r = self.wait(self.submit(job, **args), timeout)
        assert r["ok"], f"{job} failed on {self.host.name}: {r['error']}: {r['message']}"
        return r["value"]


@dataclass
class Mesh:
    net: Network
    token: str
    address_file: Path
    head: Host
    workers: list[Host]
    clients: list[Driver] = field(default_factory=list)
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    head_extra: dict[str, str] = field(default_factory=dict)
    devices_per_host: int = 2
    head_proc: subprocess.Popen[bytes] | None = None
    sup_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """What the head wrote: off loopback it is CURVE-encrypted, so the address carries
        the server's public key (`?key=`)."""
        from gpufn.net import address_file

        data = address_file.read(self.address_file)
        return data["address"] if data is not None else f"tcp://{self.head.address}:{PORT}"

    def env(self, host: Host, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GPUFN_", "GLOO_", "NCCL_"))}
        env.update(GPUFN_TOKEN=self.token, GPUFN_HOME=str(host.home / "home"),
                   GPUFN_LOG_DIR=str(host.log_dir), GPUFN_PROGRESS="0",
                   PYTHONPATH=REPO, GPUFN_NODE_ID=host.name, **extra)
        return env

    def start_head(self) -> None:
        self.address_file.unlink(missing_ok=True)
        self.head_proc = self.net.spawn(self.head, [
            sys.executable, "-m", "gpufn.cli.main", "serve", "--no-workers",
            "--host", self.head.address, "--port", str(PORT),
            "--address-file", str(self.address_file)],
            self.env(self.head, GPUFN_HEARTBEAT_TIMEOUT=str(self.heartbeat_timeout),
                     GPUFN_LOG_LEVEL="INFO", **self.head_extra), "head.log")

    def start_worker_host(self, host: Host) -> None:
        self.sup_procs[host.name] = self.net.spawn(host, [
            sys.executable, "-m", "gpufn.cli.main", "worker", "--address-file",
            str(self.address_file), "--cpu-devices", str(self.devices_per_host),
            "--node", host.name],
            self.env(host, GPUFN_LOG_LEVEL="INFO"), "supervisor.log")

    def status(self, timeout: float = 30.0) -> dict[str, Any]:
        return self.clients[0].call("status", timeout)

    def devices(self) -> dict[str, str]:
        return {d["key"]: d["state"] for d in self.status()["devices"]}

    def wait_devices(self, pred: Any, timeout: float = 120.0, what: str = "") -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            devs = self.devices()
            if pred(devs):
                return devs
            if time.monotonic() > deadline:
                raise AssertionError(f"devices never {what}: {devs}")
            time.sleep(0.2)

    def wait_all_ready(self, timeout: float = 180.0) -> dict[str, str]:
        n = self.devices_per_host * len(self.workers)
        return self.wait_devices(
            lambda d: len(d) == n and all(s == "ready" for s in d.values()), timeout, "all ready")

    def log(self, host: Host, name: str) -> str:
        try:
            return (host.log_dir / name).read_text(errors="replace")
        except OSError:
            return ""


def report(line: str) -> None:
    """Measured numbers, for `pytest -s tests/multihost | grep MULTIHOST`."""
    print(f"\nMULTIHOST: {line}", flush=True)


@contextmanager
def running_mesh(root: Path, *, prefix: str = "", n_workers: int = 2, n_clients: int = 2,
                 devices_per_host: int = 2, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 head_extra: dict[str, str] | None = None) -> Iterator[Mesh]:
    """A head, `n_workers` worker hosts and `n_clients` client hosts, all ready; torn down
    (processes, then namespaces) on exit. Skips without network namespaces."""
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    net = Network(root, prefix)
    try:
        head = net.add_host("head", 1)
        workers = [net.add_host(f"host{i + 1}", 11 + i) for i in range(n_workers)]
        clients = [net.add_host(f"client{i + 1}", 21 + i) for i in range(n_clients)]
        shared = root / "shared"
        shared.mkdir()
        m = Mesh(net, secrets.token_hex(16), shared / "head.json", head, workers,
                 heartbeat_timeout=heartbeat_timeout, head_extra=dict(head_extra or {}),
                 devices_per_host=devices_per_host)
        # Workers first: they wait for the address file the head writes.
        for w in workers:
            m.start_worker_host(w)
        m.start_head()
        deadline = time.monotonic() + 60
        while not m.address_file.exists():
            assert m.head_proc is not None and m.head_proc.poll() is None, m.log(head, "head.log")
            assert time.monotonic() < deadline, "the head never wrote its address file"
            time.sleep(0.1)
        for c in clients:
            m.clients.append(Driver(net, c, m.env(c, GPUFN_ADDRESS=m.address)))
        for d in m.clients:
            d.wait("ready", 60)
        m.wait_all_ready()
        yield m
    finally:
        net.close()
        left = net.leftovers()
        assert not left, f"namespaces left behind: {left}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("hosts")) as m:
        yield m
