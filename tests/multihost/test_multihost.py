"""Many hosts for real: calls, gangs and tensors across network namespaces, a host cut off
and plugged back, a head killed and restarted, and two client hosts mapping at once."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.conftest import HEARTBEAT_TIMEOUT, Mesh, report

pytestmark = pytest.mark.timeout(300)


def _node(key: str) -> str:
    return key.rsplit(":", 1)[0]


def test_calls_spread_over_both_hosts(mesh: Mesh) -> None:
    out = mesh.clients[0].call("spread", n=24)
    assert [r["i"] for r in out] == list(range(24))
    nodes = {r["node"] for r in out}
    assert nodes == {"host1", "host2"}, nodes
    # Really two network stacks, not two names for one.
    assert len({r["netns"] for r in out}) == 2


def test_gang_of_two_stays_on_one_host(mesh: Mesh) -> None:
    for _ in range(3):
        out = mesh.clients[0].call("gang2")
        assert sorted(r["rank"] for r in out["ranks"]) == [0, 1]
        assert len({_node(k) for k in out["devices"]}) == 1, out["devices"]
        assert len({r["node"] for r in out["ranks"]}) == 1


def test_gang_of_four_spans_hosts_and_all_reduces(mesh: Mesh) -> None:
    t0 = time.monotonic()
    out = mesh.clients[0].call("gang4", timeout=200)
    ranks = sorted(out["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["node"] for r in ranks} == {"host1", "host2"}
    assert {_node(k) for k in out["devices"]} == {"host1", "host2"}
    expected = [float(i * (1 + 2 + 3 + 4)) for i in range(4)]
    assert all(r["sum"] == expected for r in ranks), ranks
    report(f"cross-host gang count=4 (first, incl. rendezvous): {time.monotonic() - t0:.2f}s")


def test_64mib_tensors_cross_hosts(mesh: Mesh) -> None:
    out = mesh.clients[0].call("big", timeout=200, mib=64, rounds=3)
    report(f"64 MiB tensor argument+result between hosts: best {min(out['seconds']):.3f}s per "
           f"call, {out['mib_per_s']:.0f} MiB/s (both directions counted)")
    assert out["mib_per_s"] > 0


def test_map_of_1000_from_two_client_hosts(mesh: Mesh) -> None:
    t0 = time.monotonic()
    ids = [(d, d.submit("map", n=1000)) for d in mesh.clients]
    outs = [d.wait(rid, 240) for d, rid in ids]
    for o in outs:
        assert o["ok"], o
        assert o["value"]["ok"] and o["value"]["n"] == 1000
    report(f"2 client hosts x 1,000-call .map at once: {time.monotonic() - t0:.2f}s "
           f"({2000 / (time.monotonic() - t0):.0f} calls/s)")


def test_worker_with_wrong_token_keeps_retrying(mesh: Mesh) -> None:
    host = mesh.net.hosts["client2"]
    proc = mesh.net.spawn(host, [
        sys.executable, "-m", "gpufn.cli.main", "worker", "--address", mesh.address,
        "--cpu-devices", "1", "--node", "intruder"],
        {**mesh.env(host), "GPUFN_TOKEN": "wrong"}, "intruder.log")
    try:
        deadline = time.monotonic() + 60
        while "attempt 2): wrong token" not in mesh.log(host, "intruder.log"):
            assert proc.poll() is None, mesh.log(host, "intruder.log")
            assert time.monotonic() < deadline, mesh.log(host, "intruder.log")
            time.sleep(0.1)
        assert not any(_node(k) == "intruder" for k in mesh.devices())
    finally:
        mesh.net.kill(proc, signal.SIGTERM)
        proc.wait(15)


def test_host_loss_fails_a_cross_host_gang(mesh: Mesh, tmp_path: Path) -> None:
    client = mesh.clients[0]
    rid = client.submit("gang4", seconds=60.0, marks=str(tmp_path))
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("gang-*"))) < 4:
        assert time.monotonic() < deadline, "the gang never started"
        time.sleep(0.1)
    mesh.net.link("host1", up=False)
    t_down = time.monotonic()
    try:
        out = client.wait(rid, 60)
        failed_after = time.monotonic() - t_down
        assert not out["ok"] and out["error"] == "WorkerLost", out
        devs = mesh.wait_devices(
            lambda d: all(s != "ready" for k, s in d.items() if _node(k) == "host1"), 30,
            "marked lost")
        assert all(s == "ready" for k, s in devs.items() if _node(k) == "host2"), devs
        assert failed_after < HEARTBEAT_TIMEOUT + 15
    finally:
        mesh.net.link("host1", up=True)
    t_up = time.monotonic()
    mesh.wait_all_ready()
    report(f"host cut off mid-gang: WorkerLost after {failed_after:.1f}s "
           f"(heartbeat timeout {HEARTBEAT_TIMEOUT:g}s); host re-registered "
           f"{time.monotonic() - t_up:.1f}s after the link came back")


def test_host_loss_reruns_single_calls_and_fences_late_results(mesh: Mesh, tmp_path: Path) -> None:
    client = mesh.clients[0]
    # Start from idle devices (an earlier test's stopped ranks may still hold some), so
    # the four calls run at once, two on each host.
    deadline = time.monotonic() + 60
    while any(d["running"] for d in mesh.status()["devices"]):
        assert time.monotonic() < deadline, "devices never became idle"
        time.sleep(0.1)
    stale0 = mesh.status()["counters"]["stale_results"]
    rid = client.submit("slow", n=4, seconds=6.0, marks=str(tmp_path))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("start-*"))) < 4:
        assert time.monotonic() < deadline, "the calls never started"
        time.sleep(0.05)
    # The calls host1 is running when it is cut off (not any it already finished).
    on_host1 = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("start-*-host1-1")
                      if not (tmp_path / p.name.replace("start-", "done-")).exists())
    assert on_host1, "no call ran on host1"
    mesh.net.link("host1", up=False)
    t_down = time.monotonic()
    try:
        mesh.wait_devices(
            lambda d: all(s != "ready" for k, s in d.items() if _node(k) == "host1"),
            HEARTBEAT_TIMEOUT + 20, "marked lost")
        lost_after = time.monotonic() - t_down
        # host1 finishes its copies while cut off: its results wait in its socket.
        while len(list(tmp_path.glob("done-*-host1-1"))) < len(on_host1):
            assert time.monotonic() < deadline + 60, "host1's calls never finished"
            time.sleep(0.1)
        # Still cut off, so the reruns can only go to host2 (were host1 back, a rerun could
        # rightly land on its restarted workers).
        out = client.wait(rid, 120)
    finally:
        mesh.net.link("host1", up=True)
    assert out["ok"], out
    results = out["value"]
    assert [r["i"] for r in results] == [0, 1, 2, 3]  # each exactly once
    for r in results:
        if r["i"] in on_host1:  # the rerun's result, not host1's late one
            assert r["node"] == "host2" and r["attempt"] == 2, r
    report(f"host cut off mid-call: devices marked lost after {lost_after:.1f}s, "
           f"{len(on_host1)} call(s) rerun on host2, all 4 results after "
           f"{out['elapsed']:.1f}s (6s calls)")
    # The link is back: host1 re-registers, and what it sends for the reassigned calls
    # is fenced off, not delivered.
    t_up = time.monotonic()
    mesh.wait_all_ready()
    deadline = time.monotonic() + 60
    while mesh.status()["counters"]["stale_results"] < stale0 + len(on_host1):
        assert time.monotonic() < deadline, mesh.status()["counters"]
        time.sleep(0.2)
    report(f"host1 rejoined {time.monotonic() - t_up:.1f}s after its link came back")
    assert [r["i"] for r in client.call("spread", n=8)] == list(range(8))


def test_head_restart_workers_rejoin_by_themselves(mesh: Mesh) -> None:
    assert mesh.head_proc is not None
    mesh.net.kill(mesh.head_proc)  # SIGKILL: only `gpufn serve`, its scheduler child lives on
    mesh.head_proc.wait(10)
    left = mesh.net.wait_gone(mesh.head, 30)
    assert not left, f"the head's scheduler did not stop after its parent died: {left}"
    for name, sup in mesh.sup_procs.items():
        assert sup.poll() is None, f"{name}'s `gpufn worker` exited ({sup.returncode})"
    t0 = time.monotonic()
    mesh.start_head()
    mesh.wait_all_ready()
    rejoin = time.monotonic() - t0
    for name, sup in mesh.sup_procs.items():
        assert sup.poll() is None, f"{name}'s `gpufn worker` exited"
    out = mesh.clients[0].call("spread", n=8)  # the same client, no restart
    assert [r["i"] for r in out] == list(range(8))
    for w in mesh.workers:
        log = mesh.log(w, "supervisor.log")
        assert "registering again" in log or "joined the scheduler" in log, log[-2000:]
    report(f"head SIGKILLed and restarted: both worker hosts ready {rejoin:.1f}s after the "
           "new head started")
