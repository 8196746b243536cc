"""A real `gpufn serve --http-port 0 --metrics-port N` for the HTTP gateway tests: the
scheduler, two simulated devices and the gateway, with the test app deployed."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import gpufn
from gpufn.net.cluster_file import read_cluster_file

from .served import Served, gpufn_cmd

APP = Path(__file__).with_name("http_app.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedGateway(Served):
    def __init__(self, home: Path, **env: str) -> None:
        super().__init__(home, devices=2, memory="8GiB")
        self.extra_env = env
        self.metrics_port = free_port()
        self.url = ""

    def start(self) -> ServedGateway:
        (self.home / "cluster.json").unlink(missing_ok=True)
        log_path = self.home / "serve.log"
        log = open(log_path, "a")  # noqa: SIM115 (the child keeps writing it)
        self.proc = subprocess.Popen(
            [*gpufn_cmd(), "serve", "--port", "0", "--cpu-devices", str(self.devices),
             "--device-memory", self.memory, "--http-port", "0", "--metrics-port",
             str(self.metrics_port), "--json"],
            env=self.env(**self.extra_env), cwd=self.home / "cwd", stdout=log,
            stderr=subprocess.STDOUT, text=True)
        log.close()
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            lines = [x for x in log_path.read_text().splitlines() if x.startswith("{")]
            data = read_cluster_file(self.home / "cluster.json")  # None while half written
            if lines and data is not None:
                break
            time.sleep(0.05)
        info = json.loads(lines[-1])
        self.address, self.token, self.url = data["address"], data["token"], info["http"]
        return self

    def client(self) -> gpufn.Client:
        return gpufn.Client(self.address, self.token)

    def wait_ready(self, client: gpufn.Client, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            st = client.status()
            if st["devices"] and all(d["state"] == "ready" for d in st["devices"]):
                return
            assert time.monotonic() < deadline, st["devices"]
            time.sleep(0.1)

    def log(self) -> str:
        return (self.home / "serve.log").read_text()
