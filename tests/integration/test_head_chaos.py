"""Chaos at the head: a `.map` with `retries=3` and spawned calls with `retries=0` while
`gpufn serve` is SIGKILLed and started again, and workers are SIGKILLed in between (one
also while the head is down). Every map call returns its result; a spawned call returns
its result or, only if it was running on a killed worker, `WorkerLost`; the side-effect
logs show no call ran twice as its first attempt (and no retries=0 call twice); no
client hangs. The default run is reduced (GPUFN_HEAD_CHAOS_N, default 150, one
restart); the full size is `pytest -m slow tests/integration/test_head_chaos.py`
(1,000 inputs, three restarts).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn
from gpufn.client import default as client_mod

from ..conftest import _alive, shutdown_default, wait_ready
from ._head import Head, children
from ._waits import wait_for

pytestmark = pytest.mark.timeout(1200)


@gpufn.gpu(retries=3)
def chaos_step(log: str, i: int) -> int:
    with open(log, "a") as f:
        f.write(f"{i} {gpufn.context().attempt} {os.getpid()}\n")
    time.sleep(0.05)
    return i * i


@gpufn.gpu
def chaos_once(log: str, j: int) -> int:
    with open(log, "a") as f:
        f.write(f"{j} {gpufn.context().attempt} {os.getpid()}\n")
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        time.sleep(0.02)
    return -j


def _lines(path: Path) -> list[tuple[int, int, int]]:
    if not path.exists():
        return []
    return [tuple(map(int, ln.split())) for ln in path.read_text().splitlines()
            if len(ln.split()) == 3]  # type: ignore[misc]


class Chaos(threading.Thread):
    """Waits for the map to progress, then kills a worker (head up), SIGKILLs `gpufn
    serve`, kills a worker while the head is down (in the second round), and starts
    `gpufn serve` again; `restarts` times."""

    def __init__(self, head: Head, log: Path, n: int, restarts: int, seed: int) -> None:
        super().__init__(name="head-chaos", daemon=True)
        self.head, self.log, self.n, self.restarts = head, log, n, restarts
        self.rng = random.Random(seed)
        self.killed: list[int] = []  # worker pids killed
        self.error: BaseException | None = None

    def _kill_worker(self) -> None:
        pids = sorted(children(self.head.supervisor()))
        if pids:
            pid = self.rng.choice(pids)
            self.head.track()
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)

    def run(self) -> None:
        try:
            for k in range(self.restarts):
                target = self.n * (k + 1) // (self.restarts + 2)
                wait_for(lambda t=target: len(_lines(self.log)) >= t, 300, "the map to progress")  # type: ignore[misc]
                self._kill_worker()
                wait_for(lambda t=target: len(_lines(self.log)) >= t + 10, 300, "more progress")  # type: ignore[misc]
                self.head.kill(signal.SIGKILL)
                if k == 1 or self.restarts == 1:  # a worker dies while no scheduler watches
                    self._kill_worker()
                self.head.start()
        except BaseException as e:  # reported by the test
            self.error = e


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    shutdown_default()
    h = Head(tmp_path / "head")
    try:
        yield h
    finally:
        client_mod._shutdown_default()
        h.close()


def run_head_chaos(head: Head, tmp: Path, n: int, spawned: int, restarts: int) -> dict[str, object]:
    seed = int(os.environ.get("GPUFN_CHAOS_SEED", str(random.randrange(1 << 30))))
    head.start()
    c = gpufn.connect(head.address, token="restart-test-token")
    wait_ready(c)
    log, once_log = tmp / "map.log", tmp / "once.log"
    t0 = time.monotonic()
    chaos = Chaos(head, log, n, restarts, seed)
    chaos.start()
    once = [chaos_once.spawn(str(once_log), j) for j in range(spawned)]
    out = list(chaos_step.map([str(log)] * n, range(n)))
    outcomes: list[object] = []
    for f in once:
        try:
            outcomes.append(f.get(timeout=300))
        except gpufn.WorkerLost as e:
            outcomes.append(e)
    chaos.join(300)
    elapsed = time.monotonic() - t0
    assert chaos.error is None, f"seed {seed}: {chaos.error!r}"
    assert not chaos.is_alive()
    assert out == [i * i for i in range(n)], f"seed {seed}"
    runs = _lines(log)
    firsts = Counter(i for i, attempt, _ in runs if attempt == 1)
    assert not [i for i, k in firsts.items() if k > 1], f"seed {seed}: ran twice as attempt 1"
    assert set(firsts) == set(range(n)), f"seed {seed}"
    once_runs = _lines(once_log)
    assert not [j for j, k in Counter(j for j, _, _ in once_runs).items() if k > 1], (
        f"seed {seed}: a retries=0 call ran twice: {once_runs}")
    where = {j: pid for j, _, pid in once_runs}
    lost = [j for j, o in enumerate(outcomes) if isinstance(o, gpufn.WorkerLost)]
    for j, o in enumerate(outcomes):
        if j in lost:  # only a call that was running on a killed worker
            assert where.get(j) in chaos.killed, f"seed {seed}: {j} {o!r} {where} {chaos.killed}"
        else:
            assert o == -j, f"seed {seed}: {j} {o!r}"
    head.shutdown()
    assert not [p for p in head.seen if _alive(p)]
    return {"n": n, "spawned": spawned, "restarts": restarts, "worker_kills": len(chaos.killed),
            "seconds": round(elapsed, 1), "retries_run": sum(1 for _, a, _ in runs if a > 1),
            "worker_lost": len(lost), "seed": seed}


def test_calls_survive_head_restarts_and_worker_kills(head: Head, tmp_path: Path) -> None:
    stats = run_head_chaos(head, tmp_path, int(os.environ.get("GPUFN_HEAD_CHAOS_N", "150")),
                           spawned=6, restarts=1)
    print("head chaos:", stats)


@pytest.mark.slow
def test_calls_survive_head_restarts_and_worker_kills_full_size(
        head: Head, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full-size head chaos run: pytest -m slow tests/integration/test_head_chaos.py")
    stats = run_head_chaos(head, tmp_path, int(os.environ.get("GPUFN_HEAD_CHAOS_N", "1000")),
                           spawned=20, restarts=3)
    print("head chaos:", stats)
