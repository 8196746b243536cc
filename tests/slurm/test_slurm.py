"""The shipped sbatch script on a real SLURM: its steps start under SLURM's GRES and
`--overlap` rules, clients outside the job call through the address file it writes (a
`.map` over both nodes, a gang across them, a deployed app), a node's `gpufn worker`
killed mid-job has its calls rerun on the other node, and `scancel` stops everything.

The tests run in order on one job; the last one cancels it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import GPUS_PER_NODE
from tests.slurm.conftest import BIN, HEARTBEAT_TIMEOUT, REPO, Job, report

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


def _node(key: str) -> str:
    return key.rsplit(":", 1)[0]


def _find(job: Job, node_index: int, needle: str) -> list[int]:
    procs = job.cluster.processes(job.cluster.nodes[node_index])
    return [pid for pid, line in procs.items() if needle in line]


def _supervisor(job: Job, node_index: int) -> int:
    """The node's `gpufn worker` (the Python process, not the srun or bash around it)."""
    found = _find(job, node_index, f"{BIN}/gpufn worker --address-file")
    assert len(found) == 1, (found, job.cluster.processes(job.cluster.nodes[node_index]))
    return found[0]


def test_steps_run_under_slurm_with_the_nodes_gpus(job: Job) -> None:
    c = job.cluster
    assert c.job_state(job.job_id) == "RUNNING"
    steps = c.steps(job.job_id)
    assert f"{job.job_id}.batch" in steps and len(steps) == 3, steps  # batch, head, workers
    # The head: on the first node only, the scheduler alone, bound to its NodeAddr.
    heads = [_find(job, i, f"{BIN}/gpufn serve --no-workers") for i in range(2)]
    assert len(heads[0]) == 1 and heads[1] == [], heads
    assert job.address().startswith(f"tcp://{c.nodes[0].host.address}:")
    # One supervisor per node, each in the job's worker step, holding that node's GPUs
    # as SLURM handed them out (the head's step asked for none).
    for i, node in enumerate(c.nodes):
        env = c.environ(_supervisor(job, i))
        assert env["SLURM_JOB_ID"] == job.job_id and env["SLURMD_NODENAME"] == node.name
        assert env.get("CUDA_VISIBLE_DEVICES") == ",".join(map(str, range(GPUS_PER_NODE))), env
    head_env = c.environ(heads[0][0])
    assert head_env["SLURM_STEP_ID"] != c.environ(_supervisor(job, 0))["SLURM_STEP_ID"]
    assert head_env.get("SLURM_STEP_GPUS", "") == "", head_env.get("SLURM_STEP_GPUS")


def test_map_spreads_over_both_nodes(job: Job) -> None:
    out = job.clients[0].call("spread", n=24)
    assert [r["i"] for r in out] == list(range(24))
    assert {r["node"] for r in out} == {"node1", "node2"}
    assert len({r["netns"] for r in out}) == 2  # really two nodes' network stacks


def test_gang_of_four_spans_both_nodes_and_all_reduces(job: Job) -> None:
    t0 = time.monotonic()
    out = job.clients[0].call("gang4", timeout=200)
    ranks = sorted(out["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["node"] for r in ranks} == {"node1", "node2"}
    assert {_node(k) for k in out["devices"]} == {"node1", "node2"}
    expected = [float(i * (1 + 2 + 3 + 4)) for i in range(4)]
    assert all(r["sum"] == expected for r in ranks), ranks
    report(f"count=4 gang across the 2 SLURM nodes (first, incl. rendezvous): "
           f"{time.monotonic() - t0:.1f}s")


def _login_run(job: Job, argv: list[str], cwd: str, timeout: float = 120) -> str:
    r = subprocess.run(["ip", "netns", "exec", job.cluster.login.ns, *argv],
                       env=job.client_env(), cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{argv}: {r.stdout}\n{r.stderr}"
    return r.stdout


def test_deployed_app_answers_by_name(job: Job, tmp_path: Path) -> None:
    app = REPO / "examples" / "deploy" / "app.py"
    out = json.loads(_login_run(job, [sys.executable, "-m", "gpufn.cli.main", "deploy",
                                      str(app), "--name", "demo", "--json"], str(REPO)))
    assert out["app"] == "demo", out
    # Another process, in a folder without the app's source: it calls by name.
    code = ("import gpufn, json; s = gpufn.lookup('demo', 'similarity').remote('gpu', 'gpus');"
            "e = gpufn.lookup('demo', 'embed').remote('gpu'); print(json.dumps([s, e]))")
    env_free = {"PYTHONPATH": ""}
    r = subprocess.run(["ip", "netns", "exec", job.cluster.login.ns, sys.executable, "-c", code],
                       env={**job.client_env(), **env_free}, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    score, emb = json.loads(r.stdout.strip().splitlines()[-1])
    assert isinstance(score, float) and -1.0 <= score <= 1.0
    assert len(emb) == 16


def test_node_daemon_killed_mid_job_calls_rerun_on_the_other_node(job: Job,
                                                                    tmp_path: Path) -> None:
    c = job.cluster
    client = job.clients[0]
    deadline = time.monotonic() + 60
    while any(d["running"] for d in job.status()["devices"]):
        assert time.monotonic() < deadline, "devices never became idle"
        time.sleep(0.1)
    rid = client.submit("slow", n=4, seconds=6.0, marks=str(tmp_path))
    while len(list(tmp_path.glob("start-*"))) < 4:
        assert time.monotonic() < deadline, "the calls never started"
        time.sleep(0.05)
    on_node2 = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("start-*-node2-1"))
    assert on_node2, "no call ran on node2"
    sup = _supervisor(job, 1)
    workers = _find(job, 1, "gpufn.worker")
    assert len(workers) == GPUS_PER_NODE, c.processes(c.nodes[1])
    os.kill(sup, signal.SIGKILL)
    t_kill = time.monotonic()
    # Its workers see their parent gone and exit: nothing of gpufn stays on node2.
    deadline = time.monotonic() + 30
    while _find(job, 1, "gpufn"):
        assert time.monotonic() < deadline, c.processes(c.nodes[1])
        time.sleep(0.1)
    job.wait_devices(lambda d: all(s != "ready" for k, s in d.items() if _node(k) == "node2"),
                     HEARTBEAT_TIMEOUT + 20, "on node2 marked lost")
    lost_after = time.monotonic() - t_kill
    out = client.wait(rid, 120)
    assert out["ok"], out
    results = out["value"]
    assert [r["i"] for r in results] == [0, 1, 2, 3]
    for r in results:
        if r["i"] in on_node2:
            assert r["node"] == "node1" and r["attempt"] == 2, r
    # node1's devices kept serving, and the job runs on: only one task of a step died.
    devs = job.devices()
    assert all(s == "ready" for k, s in devs.items() if _node(k) == "node1"), devs
    assert c.job_state(job.job_id) == "RUNNING"
    assert [r["node"] for r in client.call("spread", n=4)] == ["node1"] * 4
    report(f"node2's `gpufn worker` SIGKILLed: its devices marked lost after {lost_after:.1f}s "
           f"(heartbeat timeout {HEARTBEAT_TIMEOUT:g}s), {len(on_node2)} call(s) rerun on "
           f"node1, all 4 results after {out['elapsed']:.1f}s (6s calls)")


def test_scancel_stops_head_and_nodes_and_the_client_hears_it(job: Job, tmp_path: Path) -> None:
    c = job.cluster
    client = job.clients[0]
    rid = client.submit("slow", n=1, seconds=120.0, marks=str(tmp_path))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("start-*")):
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.05)
    assert _find(job, 0, "gpufn")  # running until now
    t0 = time.monotonic()
    c.cmd("scancel", job.job_id)
    out = client.wait(rid, 60)
    heard = time.monotonic() - t0
    assert not out["ok"] and out["error"] == "ConnectionLost", out
    assert "scheduler stopped" in out["message"], out
    # The job and its steps are gone, and nothing but slurmd runs on either node.
    deadline = time.monotonic() + 60
    while c.job_state(job.job_id) not in ("CANCELLED", "COMPLETED") or c.steps(job.job_id) \
            or any(c.processes(n) for n in c.nodes):
        assert time.monotonic() < deadline, (
            c.job_state(job.job_id), c.steps(job.job_id), [c.processes(n) for n in c.nodes])
        time.sleep(0.2)
    clean = time.monotonic() - t0
    assert c.job_state(job.job_id) == "CANCELLED"
    report(f"scancel: the client's running call failed with ConnectionLost after {heard:.1f}s; "
           f"job, steps and every process on both nodes gone after {clean:.1f}s")
