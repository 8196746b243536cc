"""Partitions as an operator meets them: a worker host cut off from the head shorter and
longer than the heartbeat timeout, and a client host cut off in the middle of a `.map`,
each healed. Every call is counted by a side file per call id (`jobs._count_run`): nothing
is lost, nothing runs twice as a first attempt, nothing hangs, and the logs say what was
decided."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.conftest import Mesh, report, running_mesh

pytestmark = pytest.mark.timeout(420)

HEARTBEAT = 14.0  # the head's GPUFN_HEARTBEAT_TIMEOUT: a 10 s cut stays under it
CLIENT_TIMEOUT = 20.0  # the head's GPUFN_CLIENT_TIMEOUT


@pytest.fixture(scope="module")
def pmesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("parts"), prefix="f2", n_clients=1,
                      heartbeat_timeout=HEARTBEAT,
                      head_extra={"GPUFN_CLIENT_TIMEOUT": str(CLIENT_TIMEOUT)}) as m:
        yield m


def _node(key: str) -> str:
    return key.rsplit(":", 1)[0]


def _runs(marks: Path) -> dict[str, list[tuple[int, int, str]]]:
    """Call id -> its runs (item, attempt, node), from the side files."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for f in marks.glob("*.runs"):
        rows = [line.split() for line in f.read_text().splitlines() if line.strip()]
        out[f.name.removesuffix(".runs")] = [(int(i), int(a), n) for i, a, n in rows]
    return out


def _first_attempts_once(marks: Path) -> dict[str, list[tuple[int, int, str]]]:
    runs = _runs(marks)
    for cid, rows in runs.items():
        firsts = [r for r in rows if r[1] == 1]
        assert len(firsts) <= 1, f"call {cid} ran {len(firsts)} times as its first attempt: {rows}"
        attempts = [r[1] for r in rows]
        assert len(attempts) == len(set(attempts)), f"call {cid} ran an attempt twice: {rows}"
    return runs


def _idle(mesh: Mesh, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(d["running"] for d in mesh.status()["devices"]):
        assert time.monotonic() < deadline, "devices never became idle"
        time.sleep(0.2)


def _wait_runs_on(marks: Path, node: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(r[2] == node for rows in _runs(marks).values() for r in rows):
        assert time.monotonic() < deadline, f"no call started on {node}"
        time.sleep(0.05)


def _ok_items(out: list[Any]) -> list[int]:
    return [r["i"] for r in out if "error" not in r]


def test_worker_host_cut_off_shorter_than_heartbeat(pmesh: Mesh, tmp_path: Path) -> None:
    """10 s without its link: the host's devices are kept, its calls finish there and their
    results arrive once the link is back; nothing runs again."""
    _idle(pmesh)
    lost0 = pmesh.status()["counters"]
    client = pmesh.clients[0]
    n = 16
    rid = client.submit("counted_map", n=n, seconds=2.0, marks=str(tmp_path))
    _wait_runs_on(tmp_path, "host1")
    pmesh.net.link("host1", up=False)
    t_down = time.monotonic()
    try:
        time.sleep(10.0)
        devs = pmesh.devices()
    finally:
        pmesh.net.link("host1", up=True)
    assert all(s == "ready" for s in devs.values()), f"devices lost within the timeout: {devs}"
    out = client.wait(rid, 120)
    assert out["ok"], out
    assert _ok_items(out["value"]) == list(range(n)), out["value"]
    assert all(r["attempt"] == 1 for r in out["value"])
    runs = _first_attempts_once(tmp_path)
    assert len(runs) == n and all(len(rows) == 1 for rows in runs.values()), runs
    on_host1 = sum(1 for rows in runs.values() if rows[0][2] == "host1")
    st = pmesh.status()["counters"]
    for k in ("lost", "retried", "restarts", "failed"):
        assert st[k] == lost0[k], (k, st)
    head_log = pmesh.log(pmesh.head, "head.log")
    assert "no heartbeat" not in head_log, head_log[-3000:]
    assert "heard from host1:0 again after" in head_log, head_log[-3000:]  # said, and kept
    report(f"worker host cut off 10s (< heartbeat timeout {HEARTBEAT:g}s): {n} calls, "
           f"{on_host1} on host1, all once, map done {out['elapsed']:.1f}s after it began "
           f"(cut at {t_down:.0f})")


def test_worker_host_cut_off_longer_than_heartbeat(pmesh: Mesh, tmp_path: Path) -> None:
    """A cut longer than the heartbeat timeout: the head declares the host's workers lost
    and says so; a `retries=0` call that was on them fails with WorkerLost (never runs
    again), a retried one runs again elsewhere as its next attempt; every other call
    returns once. Healed, the host joins again and serves."""
    _idle(pmesh)
    client = pmesh.clients[0]
    n = 8
    plain, retried = tmp_path / "plain", tmp_path / "retried"
    plain.mkdir()
    retried.mkdir()
    rid0 = client.submit("counted_map", n=n, seconds=4.0, marks=str(plain))
    rid2 = client.submit("counted_map", n=n, seconds=4.0, marks=str(retried), retries=True)
    _wait_runs_on(plain, "host1")
    _wait_runs_on(retried, "host1")
    pmesh.net.link("host1", up=False)
    t_down = time.monotonic()
    try:
        pmesh.wait_devices(
            lambda d: all(s != "ready" for k, s in d.items() if _node(k) == "host1"),
            HEARTBEAT + 15, "marked lost")
        lost_after = time.monotonic() - t_down
        time.sleep(max(0.0, HEARTBEAT + 8 - (time.monotonic() - t_down)))
    finally:
        pmesh.net.link("host1", up=True)
    out0, out2 = client.wait(rid0, 180), client.wait(rid2, 180)
    assert out0["ok"] and out2["ok"], (out0, out2)
    # retries=0: each item once, as a result or as WorkerLost for a run on host1.
    runs0 = _first_attempts_once(plain)
    assert len(out0["value"]) == n
    by_item0 = {rows[0][0]: rows for rows in runs0.values()}
    failed = [i for i, r in enumerate(out0["value"]) if "error" in r]
    for i, r in enumerate(out0["value"]):
        assert len(by_item0[i]) == 1, by_item0[i]
        if "error" in r:
            assert r["error"] == "WorkerLost" and by_item0[i][0][2] == "host1", (i, r, by_item0[i])
        else:
            assert r["i"] == i and r["attempt"] == 1
    assert failed, "no retries=0 call was on host1 when it was cut off"
    # retries=2: every item returns; a rerun is its next attempt, never a second first one.
    assert _ok_items(out2["value"]) == list(range(n)), out2["value"]
    runs2 = _first_attempts_once(retried)
    rerun = [rows for rows in runs2.values() if len(rows) > 1]
    assert rerun, "no retried call was rerun"
    for rows in rerun:
        assert rows[0][2] == "host1" and sorted(a for _, a, _ in rows) == [1, 2], rows
    head_log = pmesh.log(pmesh.head, "head.log")
    assert "no heartbeat for" in head_log and "host1" in head_log, head_log[-3000:]
    assert "failed with WorkerLost (no retries left)" in head_log, head_log[-3000:]
    t_up = time.monotonic()
    pmesh.wait_all_ready()
    rejoined = time.monotonic() - t_up
    out = client.call("counted_map", n=8, seconds=0.0, marks=str(tmp_path))
    assert _ok_items(out) == list(range(8))
    report(f"worker host cut off {HEARTBEAT + 8:g}s (> heartbeat timeout {HEARTBEAT:g}s): "
           f"declared lost after {lost_after:.1f}s, {len(failed)} retries=0 call(s) failed "
           f"WorkerLost, {len(rerun)} retried call(s) ran again; rejoined {rejoined:.1f}s "
           "after the link came back")


def _cut_client_mid_map(pmesh: Mesh, marks: Path, seconds: float, n: int,
                        each: float = 1.0, leased: bool = True) -> dict[str, Any]:
    _idle(pmesh)
    client = pmesh.clients[0]
    rid = client.submit("counted_map", n=n, seconds=each, marks=str(marks), leased=leased)
    deadline = time.monotonic() + 60
    while len(_runs(marks)) < 6:
        assert time.monotonic() < deadline, "the map never started"
        time.sleep(0.05)
    pmesh.net.link("client1", up=False)
    try:
        time.sleep(seconds)
    finally:
        pmesh.net.link("client1", up=True)
    out = client.wait(rid, 180)
    assert out["ok"], out
    return out


def test_client_cut_off_mid_map(pmesh: Mesh, tmp_path: Path) -> None:
    """A client host cut off for 10 s (under GPUFN_CLIENT_TIMEOUT) during a `.map` of
    retries=0 calls: every result arrives once the link is back, each call ran once."""
    n = 40
    out = _cut_client_mid_map(pmesh, tmp_path, 10.0, n)
    assert _ok_items(out["value"]) == list(range(n)), out["value"]
    runs = _first_attempts_once(tmp_path)
    assert len(runs) == n and all(len(rows) == 1 for rows in runs.values()), runs
    report(f"client cut off 10s mid-map: all {n} results, each call ran once; map took "
           f"{out['elapsed']:.1f}s")


@pytest.mark.parametrize("leased", [False, True], ids=["through the head", "under leases"])
def test_client_cut_off_longer_than_client_timeout(pmesh: Mesh, tmp_path: Path,
                                                   leased: bool) -> None:
    """Cut off past GPUFN_CLIENT_TIMEOUT: the head forgets the client (its queued calls
    dropped, its running ones stopped) and says so; when the link is back the client says
    Hello again and sends its calls again. Each item comes back once, and no call runs
    twice as its first attempt: one that was stopped (retries=0) fails with ConnectionLost
    saying why, rather than running again; a dropped queued one runs. Under leases the
    head stops no call (it ends the client's leases: their workers finish what runs and
    refuse what waits, which the client sends again), so every item answers."""
    n = 40
    # 40 calls of 3 s on 4 devices: calls still run and wait when the head forgets it.
    out = _cut_client_mid_map(pmesh, tmp_path, CLIENT_TIMEOUT + 8, n, each=3.0, leased=leased)
    items = out["value"]
    assert len(items) == n
    runs = _first_attempts_once(tmp_path)
    by_item: dict[int, list[tuple[int, int, str]]] = {}
    for rows in runs.values():
        for row in rows:
            by_item.setdefault(row[0], []).append(row)
    stopped = [i for i, r in enumerate(items) if "error" in r]
    for i, r in enumerate(items):
        assert len(by_item.get(i, [])) == 1, (i, r, by_item.get(i))  # ran once, never again
        if "error" in r:
            assert r["error"] == "ConnectionLost" and "GPUFN_CLIENT_TIMEOUT" in r["message"], r
        else:
            assert r["i"] == i and r["attempt"] == 1
    head_log = pmesh.log(pmesh.head, "head.log")
    assert "forgot client" in head_log, head_log[-3000:]
    if leased:
        assert not stopped, stopped
    else:
        assert stopped, "no call was running when the head forgot the client"
        assert "stopped while it ran" in head_log, head_log[-3000:]
    report(f"client cut off {CLIENT_TIMEOUT + 8:g}s (> client timeout {CLIENT_TIMEOUT:g}s) "
           f"mid-map: {len(_ok_items(items))} results, "
           f"{sum(1 for r in items if 'error' in r)} errors "
           f"({sorted({r['error'] for r in items if 'error' in r})}); map took "
           f"{out['elapsed']:.1f}s")
