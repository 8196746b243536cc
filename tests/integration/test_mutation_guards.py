"""Behaviour the rest of the suite checked only through bookkeeping: a cancelled call really
stops, Ctrl-C stops remote work, a model is waited for rather than loaded twice, aging
bounds a low-priority call's wait, and `map(cost=...)` starts the longest inputs first.
Each test fails under a one-line mutation listed in scripts/mutate.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

import gpufn

from ..conftest import wait_ready
from ._waits import running_ids, wait_file, wait_for, wait_idle

pytestmark = pytest.mark.timeout(90)

WORK_SECONDS = 1.5  # how long a cancelled function would run before writing its marker


@gpufn.gpu
def write_later(started: str, marker: str, seconds: float) -> str:
    """Announce the start, run Python code (interruptible) for `seconds`, then leave a marker."""
    Path(started).touch()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
    Path(marker).touch()
    return "finished"


def test_a_cancelled_running_call_stops_executing(cluster: gpufn.Client, tmp_path: Path) -> None:
    started, marker = str(tmp_path / "started"), str(tmp_path / "marker")
    call = write_later.spawn(started, marker, WORK_SECONDS)
    wait_file(started)
    assert call.cancel()
    with pytest.raises(gpufn.Cancelled):
        call.get(timeout=10)
    # The device frees when the worker reports the call ended; a call that was not
    # interrupted ends only after writing its marker.
    wait_for(lambda: call.id not in running_ids(cluster), 20, "the cancelled call to end")
    assert not os.path.exists(marker), "the cancelled function kept running to the end"


# --------------------------------------------------------------------------- Ctrl-C

_CHILD = """
import sys, time
from pathlib import Path
import gpufn

@gpufn.gpu
def work(started, marker, seconds):
    Path(started).touch()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
    Path(marker).touch()
    return 1

tmp, mode = sys.argv[1], sys.argv[2]
try:
    if mode == "remote":
        work.remote(tmp + "/started0", tmp + "/marker0", {seconds})
    else:
        n = 6
        list(work.map([f"{{tmp}}/started{{i}}" for i in range(n)],
                      [f"{{tmp}}/marker{{i}}" for i in range(n)], [{seconds}] * n))
    print("completed", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.read()  # stay connected: only the Cancel, not a disconnect, may stop the work
"""


@pytest.mark.parametrize("mode", ["remote", "map"])
def test_ctrl_c_stops_the_remote_work(cluster: gpufn.Client, tmp_path: Path, mode: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD.format(seconds=WORK_SECONDS)))
    env = dict(os.environ, GPUFN_ADDRESS=cluster.address, GPUFN_TOKEN=cluster.token)
    # SIGINT at its default, as a terminal's Ctrl-C finds it: a test run started in the
    # background gives its children SIGINT ignored, and Python then installs no handler.
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_file(str(tmp_path / "started0"), 30)
        child.send_signal(signal.SIGINT)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "interrupted"
        # The remote work ends at once when cancelled, or only after writing its marker.
        wait_idle(cluster, "work", 20)
        assert not list(tmp_path.glob("marker*")), "remote work kept running after Ctrl-C"
        assert cluster.status()["queued"] == 0
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# --------------------------------------------------------------------------- map(cost=)


@gpufn.gpu
def started_at(x: int) -> tuple[int, float]:
    t = time.time()
    time.sleep(0.05)
    return x, t


def test_map_cost_starts_the_longest_inputs_first(cluster: gpufn.Client) -> None:
    items = [3, 9, 1, 7, 5, 2, 8, 4, 6, 0]
    out = list(started_at.map(items, cost=lambda x: x))
    assert [x for x, _ in out] == items  # results still in input order
    by_start = [x for x, _ in sorted(out, key=lambda r: r[1])]
    # two devices start pairs at a time: the two costliest go first, the two cheapest last
    assert set(by_start[:2]) == {9, 8}, by_start
    assert set(by_start[-2:]) == {1, 0}, by_start


# --------------------------------------------------------------------------- model placement

LOAD_SECONDS = 1.5


@gpufn.model(memory="1MiB")
def slow_loading() -> dict[str, int]:
    time.sleep(LOAD_SECONDS)  # a loader much slower than the calls that use it
    return {"weights": 1}


@gpufn.gpu(models=[slow_loading])
def uses_slow(seconds: float) -> int:
    time.sleep(seconds)
    return slow_loading.get()["weights"]


def _loads(c: gpufn.Client, name: str) -> int:
    return sum(m["loads"] for m in c.status()["models"] if m["name"] == name)


def test_a_call_waits_for_the_device_holding_its_model(cluster: gpufn.Client) -> None:
    """Two devices; the model is resident on one, busy with a short call. A second call
    waits for it (0.3 s) rather than loading a second copy elsewhere (1.5 s)."""
    assert len(cluster.status()["devices"]) == 2
    for _ in range(3):  # load once, and measure the call's run time
        assert uses_slow.remote(0.3) == 1
    assert _loads(cluster, "slow_loading") == 1
    calls = [uses_slow.spawn(0.3) for _ in range(2)]
    assert [c.get(timeout=30) for c in calls] == [1, 1]
    colds = [c.result_meta().get("cold_start") for c in calls]
    assert "loaded" not in colds, colds
    assert _loads(cluster, "slow_loading") == 1, "a second copy of the model was loaded"


# --------------------------------------------------------------------------- aging

AGING = 0.25
GAP = 2
SERVICE = 0.05


@gpufn.gpu
def service(tag: str) -> tuple[str, float]:
    t = time.time()
    time.sleep(SERVICE)
    return tag, t


def test_aging_bounds_a_low_priority_wait_under_a_stream(
        fresh_cluster: Callable[..., gpufn.Client]) -> None:
    """One device, a steady stream of priority-2 calls that never lets the queue empty:
    a priority-0 call still starts within gap x GPUFN_AGING_SECONDS plus the backlog."""
    fresh_cluster(GPUFN_CPU_DEVICES=1, GPUFN_AGING_SECONDS=AGING)
    high = service.with_options(priority=GAP)
    service.remote("warm")
    backlog = 3
    pending = deque(high.spawn("high") for _ in range(backlog))
    low = None
    submitted = 0.0
    stream_end = time.monotonic() + 8.0  # without aging, low starts only after the stream
    high_after = 0
    while time.monotonic() < stream_end:
        pending.popleft().get(timeout=30)
        pending.append(high.spawn("high"))
        if low is None:
            submitted = time.time()
            low = service.spawn("low")
        else:
            high_after += 1
            if low.done():
                break
    assert low is not None
    _, low_start = low.get(timeout=30)
    for c in pending:
        c.get(timeout=30)
    waited = low_start - submitted
    bound = GAP * AGING + (backlog + 2) * SERVICE + 1.0  # aging + backlog ahead + slack
    assert high_after > backlog, "the stream did not outlast the low-priority call's wait"
    assert waited < bound, f"the low-priority call waited {waited:.2f}s (bound {bound:.2f}s)"


# --------------------------------------------------------------------------- retries


@gpufn.gpu(retries=1)
def always_dies(folder: str) -> None:
    Path(folder, f"attempt-{os.getpid()}").touch()
    os.kill(os.getpid(), signal.SIGKILL)


def test_retries_stop_after_the_last_attempt(cluster: gpufn.Client, tmp_path: Path) -> None:
    with pytest.raises(gpufn.WorkerLost, match=r"after 2 attempt\(s\)"):
        always_dies.remote(str(tmp_path))
    assert len(list(tmp_path.glob("attempt-*"))) == 2  # the call and its one retry
    wait_ready(cluster)
