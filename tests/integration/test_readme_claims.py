"""One test per README claim that had none: ConnectionLost, a second host joining with
`gpufn worker`, clients reaching a cluster through GPUFN_ADDRESS/GPUFN_TOKEN, the random
per-formation key prefix of the gang store, GPUFN_EVICTION_POLICY, the embedded cluster
leaving no process behind, worker logs in GPUFN_LOG_DIR, the `.map` progress bar, and
examples/tensor_parallel_generate.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import gpufn
from gpufn.cluster.embedded import LocalCluster

from ..conftest import assert_all_gone, shutdown_default, wait_ready
from ._waits import wait_for

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _env(home: Path, **extra: str) -> dict[str, str]:
    """A user's environment: no GPUFN_* settings of the test run, an empty GPUFN_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update({"GPUFN_HOME": str(home), "GPUFN_PROGRESS": "0", "GPUFN_CPU_DEVICES": "1",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT, grace: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """`gpufn serve` on loopback TCP with one simulated device: (address, token)."""
    home = tmp_path_factory.mktemp("serve-home")
    proc = subprocess.Popen([sys.executable, "-m", "gpufn.cli.main", "serve", "--port", "0",
                             "--cpu-devices", "1"], env=_env(home), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    address = token = ""
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (address and token):
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if m := re.search(r"listening on (tcp://\S+)", line):
            address = m.group(1)
        if m := re.search(r"the token is in (\S+)", line):  # never printed itself
            token = json.loads(Path(m.group(1)).read_text())["token"]
    try:
        assert address and token, "".join(lines)
        yield address, token
    finally:
        _stop(proc, grace=30)
        port = address.rsplit(":", 1)[-1] if address else "no-such-port"
        left = subprocess.run(["pgrep", "-f", f"127.0.0.1:{port}"], capture_output=True,
                              text=True).stdout.split()
        assert_all_gone([int(x) for x in left])


def _devices(address: str, token: str) -> list[dict[str, object]]:
    c = gpufn.Client(address, token, connect_timeout=20)
    try:
        return list(c.status(10)["devices"])
    finally:
        c.close()


_WHERE = """
import json, os, time
import gpufn
from gpufn.client import default as client

@gpufn.gpu
def where(seconds):
    time.sleep(seconds)
    return os.getpid()

calls = [where.spawn({seconds}) for _ in range({n})]
print(json.dumps({{"pids": [c.get(timeout=60) for c in calls],
                  "embedded": client._default.cluster is not None}}))
"""


def test_a_client_reaches_a_cluster_through_gpufn_address_and_token(
        served: tuple[str, str], tmp_path: Path) -> None:
    address, token = served
    # an empty GPUFN_HOME: the token can only come from GPUFN_TOKEN, not ~/.gpufn/cluster.json
    env = _env(tmp_path, GPUFN_ADDRESS=address, GPUFN_TOKEN=token)
    r = subprocess.run([sys.executable, "-c", _WHERE.format(seconds=0.0, n=1)], env=env,
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["embedded"] is False  # no local cluster was started
    assert out["pids"] == [d["pid"] for d in _devices(address, token)]  # ran on the served worker
    bad = subprocess.run([sys.executable, "-c", _WHERE.format(seconds=0.0, n=1)],
                         env={**env, "GPUFN_TOKEN": "wrong"}, capture_output=True, text=True,
                         timeout=90)
    assert bad.returncode != 0 and "AuthenticationError" in bad.stderr


def test_a_second_host_joins_with_gpufn_worker(served: tuple[str, str], tmp_path: Path) -> None:
    address, token = served
    host_b = subprocess.Popen(
        [sys.executable, "-m", "gpufn.cli.main", "worker", "--address", address, "--token", token,
         "--node", "hostB", "--cpu-devices", "1"], env=_env(tmp_path, GPUFN_LOG_DIR=str(tmp_path)),
        stdin=subprocess.DEVNULL, text=True)
    b_pid = 0
    try:
        devices = wait_for(lambda: [d for d in _devices(address, token)
                                    if d["key"] == "hostB:0" and d["state"] == "ready"],
                           60, "hostB:0 to be ready")
        b_pid = int(devices[0]["pid"])
        # two concurrent calls (concurrency=1 per worker): one runs on each host
        env = _env(tmp_path, GPUFN_ADDRESS=address, GPUFN_TOKEN=token)
        r = subprocess.run([sys.executable, "-c", _WHERE.format(seconds=1.0, n=2)], env=env,
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        pids = json.loads(r.stdout.strip().splitlines()[-1])["pids"]
        assert b_pid in pids and len(set(pids)) == 2, (pids, b_pid)
    finally:
        _stop(host_b)
    assert host_b.returncode == 0
    assert_all_gone([b_pid] if b_pid else [])


def test_connection_lost_when_the_scheduler_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_CONNECTION_TIMEOUT", "2")
    local = LocalCluster(cpu_devices=1, transport="tcp")
    address, token = local.start()
    pids = [p.pid for p in (local.scheduler, local.supervisor) if p is not None]
    try:
        shutdown_default()
        c = gpufn.connect(address, token=token)
        wait_ready(c)
        pids += [d["pid"] for d in c.status()["devices"]]

        @gpufn.gpu
        def long_call() -> int:
            time.sleep(30)
            return 1

        call = long_call.spawn()
        wait_for(lambda: any(d["running"] for d in c.status()["devices"]), 20, "the call to run")
        assert local.scheduler is not None
        local.scheduler.kill()  # silent: no Shutdown message, the connection just goes quiet
        t0 = time.monotonic()
        with pytest.raises(gpufn.ConnectionLost):
            call.get(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        shutdown_default()
        local.stop()
    assert_all_gone(pids)


@gpufn.gpu(count=2, gather=True, timeout=60)
def store_keys(fail: bool) -> list[str]:
    """The keys of the gang's rendezvous store, as the raw (unprefixed) store lists them."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if fail and gpufn.context().rank == 1:
        raise ValueError("break the group")
    return sorted(store.list_keys())


def _formation_prefixes(keys: list[str]) -> set[tuple[str, str, str]]:
    """(gang id, generation, the next path component) of each gpufn key."""
    return {tuple(k.split("/")[1:4]) for k in keys if k.startswith("gpufn/")}  # type: ignore[misc]


def test_gang_store_keys_carry_a_random_per_formation_prefix(cluster: gpufn.Client) -> None:
    first = _formation_prefixes(store_keys.remote(False)[0])
    with pytest.raises(ValueError, match="break the group"):
        store_keys.remote(True)  # a failure: the same devices form a new group next time
    second = _formation_prefixes(store_keys.remote(False)[0])
    new = second - first
    assert len(new) == 1, (first, second)
    (gang, generation, nonce), = new
    assert re.fullmatch(r"[0-9a-f]{16}", nonce), f"keys not under a random nonce: {nonce!r}"
    earlier = {n for g, _, n in first if g == gang}
    assert earlier and nonce not in earlier  # every formation of these devices gets a new one
    # a reader who knows the gang id and generation (both guessable) sees nothing
    import torch.distributed as dist

    raw = dist.TCPStore("127.0.0.1", int(_store_port(cluster)), is_master=False,
                        timeout=__import__("datetime").timedelta(seconds=10))
    guessed = dist.PrefixStore(f"gpufn/{gang}/{generation}", raw)
    mine = [k.split("/", 4)[4] for k in raw.list_keys()
            if k.startswith(f"gpufn/{gang}/{generation}/{nonce}/")]
    assert mine and not guessed.check(mine)
    assert dist.PrefixStore(f"gpufn/{gang}/{generation}/{nonce}", raw).check(mine)


def _store_port(c: gpufn.Client) -> int:
    @gpufn.gpu(count=2, timeout=60)
    def port() -> int:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return int(store.port)

    return int(port.remote())


@gpufn.model(memory="1MiB")
def m_one() -> torch.nn.Module:
    return torch.nn.Linear(8, 8)


@gpufn.model(memory="1MiB")
def m_two() -> torch.nn.Module:
    return torch.nn.Linear(8, 8)


@gpufn.model(memory="1MiB")
def m_three() -> torch.nn.Module:
    return torch.nn.Linear(8, 8)


@gpufn.gpu(models=[m_one])
def use_one() -> int:
    return m_one.get().in_features


@gpufn.gpu(models=[m_two])
def use_two() -> int:
    return m_two.get().in_features


@gpufn.gpu(models=[m_three])
def use_three() -> int:
    return m_three.get().in_features


def _resident(c: gpufn.Client) -> set[str]:
    return {m["name"] for m in c.status()["devices"][0]["models"] if m["state"] == "resident"}


def test_lru_count_eviction_policy_from_the_environment(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    c = fresh_cluster(GPUFN_CPU_DEVICES=1, GPUFN_EVICTION_POLICY="lru-count",
                      GPUFN_LRU_MAX_MODELS=2)
    assert c.status()["policy"] == "lru-count"
    assert use_one.remote() == 8 and use_two.remote() == 8
    assert use_one.remote() == 8  # m_two is now the least recently used
    assert _resident(c) == {"m_one", "m_two"}
    assert use_three.remote() == 8  # a third model: the LRU one leaves, memory is plentiful
    wait_for(lambda: _resident(c) == {"m_one", "m_three"}, 10,
             f"m_two evicted (resident: {_resident(c)})")
    counters = {m["name"]: m for m in c.status()["models"]}
    assert counters["m_two"]["evictions"] == 1 and counters["m_two"]["offloads"] == 0


_EXITING = """
import json, os, sys
import gpufn
from gpufn.client import default as client

@gpufn.gpu
def pid():
    return os.getpid()

worker = pid.remote()
c = client._default
pids = [c.cluster.scheduler.pid, c.cluster.supervisor.pid, worker]
print(json.dumps(pids), flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_embedded_cluster_leaves_no_process_behind(tmp_path: Path, how: str) -> None:
    """At interpreter exit, and when the interpreter is killed (the children watch it)."""
    r = subprocess.run([sys.executable, "-c", _EXITING, how], env=_env(tmp_path),
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == (0 if how == "exit" else -9), r.stderr
    pids = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(set(pids)) == 3
    assert_all_gone(pids, timeout=20)


def test_worker_logs_go_to_gpufn_log_dir(fresh_cluster: Callable[..., gpufn.Client],
                                         tmp_path: Path) -> None:
    c = fresh_cluster(GPUFN_CPU_DEVICES=1, GPUFN_LOG_DIR=str(tmp_path))

    @gpufn.gpu
    def to_fd2(text: str) -> None:
        os.write(2, text.encode() + b"\n")  # the process's own stderr, not the caller's

    to_fd2.remote("raw stderr line 7d1f")
    key = c.status()["devices"][0]["key"]
    node, index = key.rsplit(":", 1)
    log = tmp_path / f"worker-{node}-{index}.log"
    wait_for(lambda: log.exists() and "raw stderr line 7d1f" in log.read_text(), 10,
             f"the line in {log} (dir: {sorted(p.name for p in tmp_path.iterdir())})")


_PROGRESS = """
import sys
import gpufn

@gpufn.gpu
def double(x):
    return 2 * x

print(sum(double.map(range(12), progress=True)), flush=True)
print("--- default", flush=True)  # not a terminal: no bar unless asked for
print(sum(double.map(range(12))), flush=True)
"""


def test_map_progress_bar_can_be_forced_on(tmp_path: Path) -> None:
    env = _env(tmp_path)
    del env["GPUFN_PROGRESS"]
    r = subprocess.run([sys.executable, "-c", _PROGRESS], env=env, capture_output=True,
                       text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    forced, _, default = r.stdout.partition("--- default")
    assert "double.map" in forced and "12/12" in forced and "132" in forced, r.stdout
    assert "double.map" not in default + r.stderr and "132" in default


def test_tensor_parallel_generate_example(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "tensor_parallel_generate.py")],
                       env=_env(tmp_path, GPUFN_CPU_DEVICES="2"), capture_output=True, text=True,
                       timeout=110, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    sharded = json.loads(lines["tensor parallel (TP=2)"])
    single = json.loads(lines["single process"])
    assert len(sharded) == 5 + 20 and sharded[:5] == [1, 5, 9, 42, 7]
    assert sharded == single
    assert lines["identical"].strip() == "True"
