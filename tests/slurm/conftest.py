"""The SLURM fixture: a real controller and two real node daemons (`tests.slurm.cluster`),
and the shipped `examples/slurm/gpufn.sbatch` submitted to them with `sbatch`, overriding
only what a site would (node count, GPUs per node, CPUs, time limit, paths, environment).
Clients run on the login host, outside the job, from the address file the job writes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.conftest import Driver
from tests.slurm.cluster import GPUS_PER_NODE, SlurmCluster, slurm_unavailable

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "gpufn.sbatch"
HEARTBEAT_TIMEOUT = 4.0
BIN = str(Path(sys.executable).parent)  # this venv: `gpufn` and `python3` for the job


def report(line: str) -> None:
    """Measured numbers, for `pytest -s -m slurm | grep SLURM`."""
    print(f"\nSLURM: {line}", flush=True)


@dataclass
class Job:
    cluster: SlurmCluster
    root: Path
    job_id: str = ""
    clients: list[Driver] = field(default_factory=list)
    started: float = 0.0

    @property
    def run_dir(self) -> Path:
        return self.root / "shared" / "run"

    @property
    def address_file(self) -> Path:
        return self.run_dir / "head.json"

    @property
    def output(self) -> Path:
        return self.root / f"job-{self.job_id}.out"

    def address(self) -> str:
        return str(json.loads(self.address_file.read_text())["address"])

    def token(self) -> str:
        return (self.run_dir / "token").read_text().strip()

    def job_env(self) -> dict[str, str]:
        """What the submitting user has in their environment: sbatch passes it on to the
        job (its default --export=ALL), as on a site where gpufn is in a venv."""
        return self.cluster.env(
            PATH=f"{BIN}:{self.cluster.env()['PATH']}", PYTHONPATH=str(REPO),
            GPUFN_RUN_DIR=str(self.run_dir), GPUFN_HOME=str(self.root / "home"),
            GPUFN_LOG_DIR=str(self.root / "worker-logs"), GPUFN_LOG_LEVEL="INFO",
            GPUFN_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT), GPUFN_PROGRESS="0")

    def client_env(self, **extra: str) -> dict[str, str]:
        """A client on the login host: the address and token from the job's run folder."""
        return self.cluster.env(
            PATH=f"{BIN}:{self.cluster.env()['PATH']}", PYTHONPATH=str(REPO),
            GPUFN_ADDRESS=self.address(), GPUFN_TOKEN=self.token(),
            GPUFN_HOME=str(self.root / "client-home"), GPUFN_PROGRESS="0", **extra)

    def submit(self) -> None:
        r = self.cluster.cmd(
            "sbatch", "--parsable", "--nodes=2", f"--gpus-per-node={GPUS_PER_NODE}",
            "--cpus-per-task=1", "--time=00:15:00", f"--output={self.root}/job-%j.out",
            str(SCRIPT), env=self.job_env())
        self.job_id = r.stdout.strip().split(";")[0]
        self.started = time.monotonic()

    def diagnostics(self) -> str:
        def tail(p: Path, n: int = 2500) -> str:
            return p.read_text(errors="replace")[-n:] if p.exists() else "(none)"
        return (f"\n--- job output {self.output}:\n{tail(self.output)}"
                f"\n--- slurmctld.log:\n{tail(self.cluster.logs / 'slurmctld.log', 1500)}")

    def status(self) -> dict[str, Any]:
        return self.clients[0].call("status", 30)

    def devices(self) -> dict[str, str]:
        return {d["key"]: d["state"] for d in self.status()["devices"]}

    def wait_devices(self, pred: Any, timeout: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            devs = self.devices()
            if pred(devs):
                return devs
            assert time.monotonic() < deadline, f"devices never {what}: {devs}"
            time.sleep(0.2)

    def wait_running(self, timeout: float = 120.0) -> None:
        """Until the job runs, the head has written its address and both nodes' simulated
        devices are ready."""
        deadline = time.monotonic() + timeout
        while not self.address_file.exists():
            state = self.cluster.job_state(self.job_id)
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), \
                f"job {self.job_id} is {state}" + self.diagnostics()
            assert time.monotonic() < deadline, \
                f"job {self.job_id} ({state}) never wrote {self.address_file}" + self.diagnostics()
            time.sleep(0.2)
        login = self.cluster.login
        self.clients.append(Driver(self.cluster.net, login, self.client_env()))
        try:
            self.clients[0].wait("ready", 60)
        except AssertionError as e:
            log = (login.log_dir / "driver.log").read_text(errors="replace")[-1500:]
            raise AssertionError(f"{e}; the client on the login host could not reach the "
                                 f"head at {self.address()}:\n{log}{self.diagnostics()}") from None
        n = 2 * GPUS_PER_NODE
        try:
            self.wait_devices(lambda d: len(d) == n and all(s == "ready" for s in d.values()),
                              max(10.0, deadline - time.monotonic()), f"{n} ready")
        except AssertionError as e:
            raise AssertionError(f"{e}; job steps: {self.cluster.steps(self.job_id)}"
                                 f"{self.diagnostics()}") from None


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    why = slurm_unavailable()
    if why is not None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    cluster = SlurmCluster(root / "cluster")
    j = Job(cluster, root)
    try:
        t0 = time.monotonic()
        cluster.start()
        report(f"munged, slurmctld and 2 slurmd up, both nodes idle: {time.monotonic() - t0:.1f}s")
        j.submit()
        j.wait_running()
        report(f"sbatch to 4 devices ready (job {j.job_id}): {time.monotonic() - j.started:.1f}s")
        yield j
    finally:
        if j.job_id and cluster.job_state(j.job_id) in ("PENDING", "RUNNING", "CONFIGURING"):
            cluster.cmd("scancel", j.job_id, check=False)
        cluster.close()
        left = cluster.leftovers()
        assert not left, f"namespaces left behind: {left}"
