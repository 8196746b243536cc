"""Chaos: a `.map` with retries (and gang calls) while a thread SIGKILLs random workers.

Every result must arrive exactly once, correct and in order, and the scheduler must log
no ERROR. The default run is reduced (GPUFN_CHAOS_N, default 200); the full size is
`pytest -m slow tests/integration/test_chaos.py` (1,000 inputs, or GPUFN_CHAOS_N).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

import gpufn

from ..conftest import cluster_with
from ._waits import wait_for

pytestmark = pytest.mark.timeout(900)


@gpufn.gpu(retries=5)
def chaos_square(x: int) -> int:
    time.sleep(0.02)
    return x * x


@gpufn.gpu(count=2, retries=5, timeout=60)
def chaos_gang(x: int) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(gpufn.context().rank + 1)])
    dist.all_reduce(t)
    return x, t.item()


class Killer(threading.Thread):
    """SIGKILLs the worker of a random ready device every 0.5-2 s until stopped."""

    def __init__(self, client: gpufn.Client, seed: int) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        self.client, self.rng = client, random.Random(seed)
        self.stop_event = threading.Event()
        self.kills = 0

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.uniform(0.5, 2.0)):
            try:
                devices = self.client.status(10)["devices"]
            except gpufn.GpufnError:
                continue
            pids = [d["pid"] for d in devices if d["state"] == "ready" and d.get("pid")]
            if pids:
                try:
                    os.kill(self.rng.choice(pids), signal.SIGKILL)
                    self.kills += 1
                except ProcessLookupError:
                    pass


def run_chaos(n: int, log: Path) -> dict[str, object]:
    gangs = max(2, n // 50)
    seed = int(os.environ.get("GPUFN_CHAOS_SEED", str(random.randrange(1 << 30))))
    # Its own log dir: worker logs are per node and device, shared by clusters on a host.
    with cluster_with(GPUFN_CPU_DEVICES=2, GPUFN_SCHEDULER_LOG=log, GPUFN_LOG_LEVEL="INFO",
                      GPUFN_HEARTBEAT_TIMEOUT=10, GPUFN_LOG_DIR=log.parent) as c:
        assert chaos_square.remote(3) == 9  # registered and warm before the chaos starts
        t0 = time.monotonic()
        killer = Killer(c, seed)
        killer.start()
        try:
            gang_calls = [chaos_gang.spawn(i) for i in range(gangs)]
            out = list(chaos_square.map(range(n)))
            gang_out = [g.get(timeout=600) for g in gang_calls]
        finally:
            killer.stop_event.set()
            killer.join(30)
        elapsed = time.monotonic() - t0
        # Calls under a lease are counted from its worker's reports (every 0.2 s) or its
        # end: the counters settle shortly after the results are in.
        expected = n + gangs + 1
        wait_for(lambda: c.status()["counters"]["succeeded"] >= expected, timeout=30,
                 what="the counters to settle")
        time.sleep(0.5)
        counters = c.status()["counters"]
    assert out == [x * x for x in range(n)], f"seed {seed}"
    assert gang_out == [(i, 3.0) for i in range(gangs)], f"seed {seed}"
    assert counters["succeeded"] == n + gangs + 1 and counters["failed"] == 0, counters
    text = log.read_text()
    errors = [line for line in text.splitlines()
              if "gpufn-scheduler ERROR" in line or "gpufn-scheduler CRITICAL" in line]
    assert not errors, f"seed {seed}: scheduler logged errors:\n" + "\n".join(errors[:20])
    assert killer.kills >= 1
    return {"n": n, "kills": killer.kills, "seconds": elapsed, "retried": counters["retried"],
            "restarts": counters["restarts"]}


def test_map_survives_random_worker_kills(tmp_path: Path) -> None:
    stats = run_chaos(int(os.environ.get("GPUFN_CHAOS_N", "200")), tmp_path / "scheduler.log")
    print("chaos:", stats)


@pytest.mark.slow
def test_map_survives_random_worker_kills_full_size(tmp_path: Path,
                                                    request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full-size chaos run: pytest -m slow tests/integration/test_chaos.py")
    stats = run_chaos(int(os.environ.get("GPUFN_CHAOS_N", "1000")), tmp_path / "scheduler.log")
    print("chaos:", stats)
