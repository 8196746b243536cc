"""Hosts in network namespaces: a bridge namespace (the switch) and one namespace per host,
each joined to the bridge by a veth pair. Nothing touches the machine's own network: the
bridge lives in its own namespace and every address exists only inside these namespaces.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` is not permitted)"
    probe = f"gfnprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip` is not usable: {e}"
    if r.returncode != 0:
        return f"`ip netns add` is not permitted: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    ns: str
    address: str
    home: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"


class Network:
    """Namespaces, links and the processes started in them; `close()` removes them all."""

    def __init__(self, root: Path, prefix: str = "") -> None:
        # Namespace names start with `prefix` (else $NETNS_PREFIX, else "gfn"): several
        # people's test runs on one machine each keep to their own.
        prefix = prefix or os.environ.get("NETNS_PREFIX", "gfn")
        self.tag = f"{prefix}{secrets.token_hex(2)}"
        self.root = root
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: dict[str, Host] = {}
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")

    def add_host(self, name: str, octet: int) -> Host:
        ns = f"{self.tag}-{name}"
        host = Host(name, ns, f"{SUBNET}.{octet}", self.root / name)
        host.log_dir.mkdir(parents=True, exist_ok=True)
        self.hosts[name] = host
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        # Created directly inside the two namespaces: no name in the machine's own stack.
        _ip("link", "add", "eth0", "netns", ns, "type", "veth",
            "peer", "name", self.port(name), "netns", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", self.port(name), "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        return host

    @staticmethod
    def port(name: str) -> str:
        return f"p-{name}"[:15]

    def link(self, name: str, up: bool) -> None:
        """Plug or pull a host's cable at the switch: its own stack notices nothing."""
        _ip("-n", self.bridge_ns, "link", "set", self.port(name), "up" if up else "down")

    def spawn(self, host: Host, argv: list[str], env: dict[str, str], log_name: str,
              cwd: str | None = None, stdin: int | None = subprocess.DEVNULL,
              stdout: int | None = None) -> subprocess.Popen[bytes]:
        """Run `argv` inside `host`'s namespace (its own session, so teardown can reach
        its children by process group); output goes to a log in the host's folder."""
        log = open(host.log_dir / log_name, "ab")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], env=env, cwd=cwd,
                                stdin=stdin, stdout=stdout if stdout is not None else log,
                                stderr=log, start_new_session=True)
        log.close()
        host.procs.append(proc)
        return proc

    def pids_in(self, host: Host) -> list[int]:
        r = _ip("netns", "pids", host.ns, check=False)
        return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait_gone(self, host: Host, timeout: float = 30.0) -> list[int]:
        """Wait until no process runs in `host`'s namespace; the pids left, if any."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.pids_in(host)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def stop_host(self, host: Host, grace: float = 5.0) -> None:
        """SIGTERM what we started there, then SIGKILL whatever still runs in the namespace
        (by pid: all of it descends from processes this harness started)."""
        for proc in host.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace
        for proc in host.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in self.pids_in(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in host.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.wait_gone(host, 10)

    def close(self) -> None:
        for host in self.hosts.values():
            self.stop_host(host)
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)
        _ip("netns", "del", self.bridge_ns, check=False)  # removes the bridge and veth ends

    def leftovers(self) -> list[str]:
        r = _ip("netns", "list", check=False)
        return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(self.tag)]
