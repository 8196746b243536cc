"""A real SLURM cluster on one machine: `munged`, `slurmctld` and two `slurmd` nodes, each
daemon in its own network namespace (the multi-host harness's `Network`), plus a login
namespace for `sbatch`, `scancel` and clients. Nothing touches the machine's own SLURM or
munge: every file, socket and port lives under one folder and inside the namespaces.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.multihost.netns import Host, Network, netns_unavailable

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol", "sinfo")
GPUS_PER_NODE = 2  # GRES the nodes advertise (the devices behind them are simulated)
# The daemons live in sbin, which a user's PATH may lack.
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def slurm_unavailable() -> str | None:
    """Why a SLURM cluster cannot be started here, or None if it can."""
    missing = [d for d in DAEMONS if shutil.which(d, path=PATH) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found): "
                "`apt-get install slurmctld slurmd slurm-client munge` (.ci/run does)")
    why = netns_unavailable()
    return None if why is None else f"the SLURM nodes need network namespaces: {why}"


@dataclass
class Node:
    name: str
    host: Host


class SlurmCluster:
    """`start()` brings the daemons up and waits for both nodes to be idle; `close()` stops
    every process the cluster started (jobs' too) and removes the namespaces."""

    def __init__(self, root: Path, nodes: int = 2) -> None:
        self.root = root
        self.etc = root / "etc"
        self.state = root / "state"
        self.logs = root / "logs"
        # munged wants every folder above its socket searchable by all (pytest's are 0700):
        # it runs with --force, and the socket lives in a 0755 folder of its own.
        self.munge_dir = root / "munge"
        for d in (self.etc, self.state, self.logs, self.munge_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o755)
        self.socket = self.munge_dir / "munge.socket"
        self.conf = self.etc / "slurm.conf"
        self.net = Network(root / "hosts")
        try:
            self.ctl = self.net.add_host("ctl", 1)
            self.nodes = [Node(f"node{i}", self.net.add_host(f"node{i}", 10 + i))
                          for i in range(1, nodes + 1)]
            self.login = self.net.add_host("login", 21)
        except BaseException:
            self.net.close()
            raise

    # ------------------------------------------------------------------ config

    def _write_config(self) -> None:
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        s = self.state
        nodes = "\n".join(
            f"NodeName={n.name} NodeAddr={n.host.address} NodeHostname={n.name} CPUs=2 "
            f"RealMemory=2000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN" for n in self.nodes)
        names = ",".join(n.name for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=gpufntest
SlurmctldHost={socket.gethostname()}({self.ctl.address})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/spool-%n
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd-%n.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: processes are tracked by their parent chain.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
InactiveLimit=0
MinJobAge=300
GresTypes=gpu
{nodes}
PartitionName=gpufn Nodes={names} Default=YES MaxTime=INFINITE State=UP
""")
        # slurmd loads a cgroup plugin even when nothing uses it; autodetection fails on a
        # hybrid v1/v2 layout, so name it (no cgroup is created: linuxproc, task/none).
        (self.etc / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        # GPUs SLURM counts and hands out (CUDA_VISIBLE_DEVICES per step). slurmd only
        # stat()s the device files; these are character devices like /dev/null, and the
        # gpufn workers find no GPU behind them, so they simulate their devices.
        dev = self.root / "dev"
        dev.mkdir(exist_ok=True)
        for i in range(GPUS_PER_NODE):
            os.mknod(dev / f"nvidia{i}", 0o644 | stat.S_IFCHR, os.makedev(1, 3))
        (self.etc / "gres.conf").write_text(
            f"Name=gpu File={dev}/nvidia[0-{GPUS_PER_NODE - 1}]\n")

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GPUFN_", "GLOO_", "NCCL_", "SLURM_", "SBATCH_", "SRUN_"))}
        env.update(SLURM_CONF=str(self.conf), PATH=PATH)
        env.update(extra)
        return env

    # ------------------------------------------------------------------ daemons

    def start(self, timeout: float = 60.0) -> None:
        self._write_config()
        m = self.munge_dir
        self.net.spawn(self.ctl, ["munged", "--foreground", "--force", f"--socket={self.socket}",
                                  f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                                  f"--seed-file={m / 'munged.seed'}",
                                  f"--log-file={self.logs / 'munged.log'}"],
                       self.env(), "munged.out")
        self._wait(lambda: self.socket.exists(), 20, "munged never made its socket",
                   self.logs / "munged.log")
        self.net.spawn(self.ctl, ["slurmctld", "-D", "-i", "-f", str(self.conf)], self.env(),
                       "slurmctld.out")
        for n in self.nodes:
            (self.state / f"spool-{n.name}").mkdir(exist_ok=True)
            self.net.spawn(n.host, ["slurmd", "-D", "-N", n.name, "-f", str(self.conf)],
                           self.env(), "slurmd.out")
        self._wait(self._all_idle, timeout, "the nodes never became idle",
                   self.logs / "slurmctld.log")

    def _all_idle(self) -> bool:
        r = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

    @staticmethod
    def _wait(pred: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
                raise AssertionError(f"{what} within {timeout:.0f}s; {log}:\n{tail}")
            time.sleep(0.2)

    def cmd(self, *argv: str, check: bool = True, timeout: float = 30.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A SLURM client command, run on the login host."""
        r = subprocess.run(["ip", "netns", "exec", self.login.ns, *argv],
                           env=env or self.env(), capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}): "
                                 f"{r.stderr.strip() or r.stdout.strip()}")
        return r

    # ------------------------------------------------------------------ jobs

    def job_state(self, job_id: str) -> str:
        """The job's state as `scontrol` reports it (e.g. PENDING, RUNNING, CANCELLED)."""
        r = self.cmd("scontrol", "show", "job", "-o", job_id, check=False)
        for field in r.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def steps(self, job_id: str) -> list[str]:
        r = self.cmd("squeue", "-h", "-s", "-j", job_id, "-o", "%i", check=False)
        return [line.strip() for line in r.stdout.splitlines() if line.strip()]

    def processes(self, node: Node) -> dict[int, str]:
        """pid -> command line of every process in `node`'s namespace but its slurmd."""
        out = {}
        for pid in self.net.pids_in(node.host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            line = " ".join(a.decode(errors="replace") for a in argv if a)
            if line and not line.startswith("slurmd "):
                out[pid] = line
        return out

    @staticmethod
    def environ(pid: int) -> dict[str, str]:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)

    def close(self) -> None:
        self.net.close()

    def leftovers(self) -> list[str]:
        return self.net.leftovers()


__all__ = ["GPUS_PER_NODE", "Node", "SlurmCluster", "slurm_unavailable"]
