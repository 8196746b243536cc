"""`gpufn serve`'s head (gpufn/cluster/head.py) in seconds: its record, how it stops the
processes it finds there, its start (refuse, adopt or replace) and its run loop's
restart policy.

The record is a real file in tmp_path and the pids it names are real processes (`sleep`,
one that ignores SIGTERM) signalled for real. The cluster is a stand-in (`Cluster`)
whose scheduler and supervisor are real short-lived processes, the scheduler exiting
with the code a test chooses: tests/integration/test_restart.py runs the real
LocalCluster and `gpufn serve` against real signals (a minute and more); this file pins
the policy (how many deaths in which window, which exit codes stop, what is adopted
and what is replaced, what each mismatch is logged as), which the integration file
cannot reach in seconds. The run loop's clock (`time.monotonic` as head.py sees it) is
the test's, so a minute of deaths takes no time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpufn.cluster import head as head_mod
from gpufn.cluster.head import RECORD, Head, read_record, stop_recorded
from gpufn.exceptions import GpufnError
from gpufn.wire import pids

pytestmark = pytest.mark.timeout(30)

_PROCS: list[subprocess.Popen[bytes]] = []


def _default_signals() -> None:
    # A suite started in the background (CI's `.ci/run &`) hands its children SIGINT
    # ignored; the processes these tests signal must die of it as a serve would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(*cmd: str, **kw: Any) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, preexec_fn=_default_signals, **kw)
    _PROCS.append(p)
    return p


def _sleeper() -> subprocess.Popen[bytes]:
    """A live process (dies on SIGINT and SIGTERM with their default action)."""
    return _spawn("sleep", "30")


def _stubborn() -> subprocess.Popen[bytes]:
    """A live process that ignores SIGTERM (and SIGINT): only SIGKILL ends it."""
    p = _spawn("sh", "-c", "trap '' TERM INT; echo ready; exec sleep 30",
               stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def _exits(code: int) -> subprocess.Popen[bytes]:
    return _spawn("sh", "-c", f"exit {code}")


def _started(p: subprocess.Popen[bytes]) -> int:
    st = pids.start_time(p.pid)
    assert st is not None
    return st


@pytest.fixture(autouse=True)
def _no_process_left() -> Iterator[None]:
    yield
    while _PROCS:
        p = _PROCS.pop()
        if p.poll() is None:
            p.kill()
        p.wait(5)
        if p.stdout is not None:
            p.stdout.close()


@pytest.fixture(autouse=True)
def _host_memory_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFN_WORKER_HOST_MEMORY", raising=False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Cluster:
    """LocalCluster's part the head uses. `plan`: one (exit code, when it dies) per
    scheduler start, in order; None: a scheduler that runs until signalled."""

    def __init__(self, workers: int = 1, cpu_devices: int = 2, device_memory: int = 0,
                 islands: int = 0, address: str = "tcp://127.0.0.1:5555", token: str = "tok",
                 plan: list[tuple[int | None, float]] | None = None,
                 clock: Clock | None = None) -> None:
        self.workers, self.cpu_devices = workers, cpu_devices
        self.device_memory, self.islands = device_memory, islands
        self.address, self.token = address, token
        self.plan = list(plan or [(None, 0.0)])
        self.clock = clock
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.supervisor: subprocess.Popen[bytes] | None = None
        self.starts: list[bool] = []  # supervise= of each start
        self.restarts = 0
        self.fail_restarts = 0  # restart_scheduler raises this many times first
        self.supervisors_started = 0
        self.stops: list[dict[str, Any]] = []

    def _next_scheduler(self) -> None:
        code, when = self.plan.pop(0) if self.plan else (None, 0.0)
        self.scheduler = _sleeper() if code is None else _exits(code)
        if self.clock is not None:
            self.clock.now = when

    def start(self, supervise: bool = True) -> tuple[str, str]:
        self.starts.append(supervise)
        self._next_scheduler()
        return self.address, self.token

    def restart_scheduler(self) -> str:
        self.restarts += 1
        if self.fail_restarts:
            self.fail_restarts -= 1
            if self.clock is not None and self.plan:
                self.clock.now = self.plan.pop(0)[1]
            raise GpufnError("no port")
        self._next_scheduler()
        return self.address

    def start_supervisor(self) -> None:
        self.supervisors_started += 1
        self.supervisor = _sleeper()

    def stop(self) -> None:
        """As LocalCluster.stop, noting in what state it found its processes: the
        scheduler's own end (the head SIGINTs it first) and whether its supervisor
        still ran."""
        seen: dict[str, Any] = {"supervisor_alive": None, "scheduler_code": None}
        if self.supervisor is not None:
            seen["supervisor_alive"] = self.supervisor.poll() is None
            self.supervisor.terminate()
            self.supervisor.wait(5)
        if self.scheduler is not None:
            try:
                seen["scheduler_code"] = self.scheduler.wait(2)
            except subprocess.TimeoutExpired:
                self.scheduler.kill()
                seen["scheduler_code"] = self.scheduler.wait()
        self.stops.append(seen)
        self.supervisor = self.scheduler = None


def _options(**kw: Any) -> dict[str, Any]:
    opts = {"cpu_devices": 2, "device_memory": 0, "islands": 0, "host_memory": None,
            "workers": 1}
    opts.update(kw)
    return opts


def _record(state: Path, **fields: Any) -> None:
    state.mkdir(parents=True, exist_ok=True)
    (state / RECORD).write_text(json.dumps(fields))


def _stop_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The real `_stop_pid`, its arguments noted."""
    calls: list[tuple[Any, ...]] = []
    real = head_mod._stop_pid

    def spy(*args: Any) -> None:
        calls.append(args)
        real(*args)

    monkeypatch.setattr(head_mod, "_stop_pid", spy)
    return calls


# ---------------------------------------------------------------- the record


def test_token_hash_is_the_sha256_prefix() -> None:
    assert head_mod._token_hash("tok") == hashlib.sha256(b"tok").hexdigest()[:16]
    assert len(head_mod._token_hash("other")) == 16


def test_read_record_none_when_missing_invalid_unreadable_or_not_a_dict(tmp_path: Path) -> None:
    assert read_record(tmp_path) is None  # missing
    (tmp_path / RECORD).write_text("{not json")
    assert read_record(tmp_path) is None
    (tmp_path / RECORD).write_bytes(b"\xff\xfe")  # not UTF-8 (a ValueError too)
    assert read_record(tmp_path) is None
    (tmp_path / RECORD).write_text("[1, 2]")
    assert read_record(tmp_path) is None
    (tmp_path / RECORD).unlink()
    (tmp_path / RECORD).mkdir()  # unreadable (root reads a 0000 file, not a directory)
    assert read_record(tmp_path) is None
    (tmp_path / RECORD).rmdir()
    (tmp_path / RECORD).write_text('{"address": "a"}')
    assert read_record(tmp_path) == {"address": "a"}


def test_start_writes_the_record_0600_atomically(tmp_path: Path) -> None:
    state = tmp_path / "a" / "state"  # parents made
    c = Cluster(token="sekrit")
    h = Head(c, state)  # type: ignore[arg-type]
    assert h.start() == ("tcp://127.0.0.1:5555", "sekrit")
    assert c.starts == [False]  # the supervisor is the head's, not the cluster's
    path = state / RECORD
    assert path.stat().st_mode & 0o777 == 0o600
    assert not (state / "head.tmp").exists()
    rec = read_record(state)
    assert c.scheduler is not None and c.supervisor is not None
    assert rec == {"address": "tcp://127.0.0.1:5555", "token": head_mod._token_hash("sekrit"),
                   "serve": os.getpid(), "serve_started": pids.start_time(os.getpid()),
                   "scheduler": [c.scheduler.pid, _started(c.scheduler)],
                   "supervisor": [c.supervisor.pid, _started(c.supervisor)],
                   "workers": _options()}
    assert "sekrit" not in path.read_text()
    assert h.supervisor == (c.supervisor.pid, _started(c.supervisor)) and not h.adopted
    inode = path.stat().st_ino
    h._write("tcp://127.0.0.1:6666", "sekrit")  # replaced, not rewritten in place
    assert path.stat().st_ino != inode and path.stat().st_mode & 0o777 == 0o600
    assert read_record(state)["address"] == "tcp://127.0.0.1:6666"  # type: ignore[index]
    assert not (state / "head.tmp").exists()
    h.stop()


def test_worker_options_and_no_workers_record(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_WORKER_HOST_MEMORY", "1GiB")
    c = Cluster(workers=0, cpu_devices=3, device_memory=7, islands=2)
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    assert h._worker_options() == {"cpu_devices": 3, "device_memory": 7, "islands": 2,
                                   "host_memory": 1 << 30, "workers": 0}
    h.start()
    rec = read_record(tmp_path)
    assert rec is not None and rec["supervisor"] is None and h.supervisor is None
    assert c.supervisors_started == 0
    h.stop()
    assert c.stops and read_record(tmp_path) is None


def test_a_full_disk_at_start_stops_everything(tmp_path: Path) -> None:
    (tmp_path / "head.tmp").symlink_to("/dev/full")  # writes fail with ENOSPC
    c = Cluster()
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(GpufnError, match=r"cannot write .*head\.json.*free space"):
        h.start()
    assert len(c.stops) == 1 and c.scheduler is None and c.supervisor is None
    assert not (tmp_path / "head.tmp").exists() and read_record(tmp_path) is None


# ---------------------------------------------------------------- _stop_pid, stop_recorded


def test_stop_pid_signals_and_waits_until_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _sleeper()
    t0 = time.monotonic()
    head_mod._stop_pid(p.pid, _started(p), signal.SIGINT, 5.0)
    assert time.monotonic() - t0 < 0.8
    assert p.wait(5) == -signal.SIGINT


def test_stop_pid_sigkills_after_the_grace() -> None:
    p = _stubborn()
    t0 = time.monotonic()
    head_mod._stop_pid(p.pid, _started(p), signal.SIGTERM, 0.3)
    took = time.monotonic() - t0
    assert 0.3 <= took < 3
    assert p.wait(5) == -signal.SIGKILL


def test_stop_pid_returns_at_once_for_another_process() -> None:
    p = _sleeper()
    st = _started(p)
    t0 = time.monotonic()
    head_mod._stop_pid(p.pid, st + 1, signal.SIGTERM, 5.0)  # the pid was reused
    head_mod._stop_pid(p.pid, None, signal.SIGTERM, 5.0)
    head_mod._stop_pid(0, st, signal.SIGTERM, 5.0)
    assert time.monotonic() - t0 < 0.2
    assert p.poll() is None


def test_stop_pid_signal_zero_waits_for_the_process_to_go() -> None:
    p = _spawn("sleep", "0.4")
    t0 = time.monotonic()
    head_mod._stop_pid(p.pid, _started(p), 0, 5.0)
    assert 0.3 < time.monotonic() - t0 < 3
    assert p.wait(5) == 0  # it ended by itself


def test_stop_recorded_without_a_record(tmp_path: Path) -> None:
    assert stop_recorded(tmp_path) is False
    (tmp_path / RECORD).write_text("garbage")
    assert stop_recorded(tmp_path) is False


def test_stop_recorded_stops_a_live_serve_and_supervisor(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stop_calls(monkeypatch)
    serve, sup = _sleeper(), _sleeper()
    serve_st, sup_st = _started(serve), _started(sup)
    _record(tmp_path, serve=serve.pid, serve_started=serve_st, supervisor=[sup.pid, sup_st])
    assert stop_recorded(tmp_path) is True
    assert serve.wait(5) == -signal.SIGINT  # it stops the rest
    assert sup.wait(5) == -signal.SIGTERM
    assert calls == [(serve.pid, serve_st, signal.SIGINT, 30.0),
                     (sup.pid, sup_st, signal.SIGTERM, 10.0)]
    assert not (tmp_path / RECORD).exists()


def test_stop_recorded_serve_only(tmp_path: Path) -> None:
    serve = _sleeper()
    _record(tmp_path, serve=serve.pid, serve_started=_started(serve), supervisor=None)
    assert stop_recorded(tmp_path) is True
    assert serve.wait(5) == -signal.SIGINT
    assert not (tmp_path / RECORD).exists()


def test_stop_recorded_left_supervisor_only(tmp_path: Path) -> None:
    sup = _sleeper()
    _record(tmp_path, serve=None, supervisor=[sup.pid, _started(sup)])
    assert stop_recorded(tmp_path) is True
    assert sup.wait(5) == -signal.SIGTERM
    assert not (tmp_path / RECORD).exists()


def test_stop_recorded_stale_record_is_removed(tmp_path: Path) -> None:
    live = _sleeper()
    st = _started(live)
    _record(tmp_path, serve=live.pid, serve_started=st + 1, supervisor=[live.pid, st + 2])
    assert stop_recorded(tmp_path) is False
    assert live.poll() is None  # a reused pid is not signalled
    assert not (tmp_path / RECORD).exists()


# ---------------------------------------------------------------- start: refuse, adopt, replace


def test_another_live_serve_is_refused(tmp_path: Path) -> None:
    other = _sleeper()
    _record(tmp_path, serve=other.pid, serve_started=_started(other))
    c = Cluster()
    with pytest.raises(GpufnError, match=f"another gpufn serve \\(pid {other.pid}\\) uses "
                       f"the state directory {tmp_path}"):
        Head(c, tmp_path).start()  # type: ignore[arg-type]
    assert c.starts == [] and other.poll() is None
    assert read_record(tmp_path) is not None  # theirs, untouched


def test_our_own_or_a_dead_serve_in_the_record_is_not_refused(tmp_path: Path) -> None:
    _record(tmp_path, serve=os.getpid(), serve_started=pids.start_time(os.getpid()))
    c = Cluster()
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    h.stop()
    gone = _exits(0)
    gone.wait()
    _record(tmp_path, serve=gone.pid, serve_started=12345)
    h = Head(Cluster(), tmp_path)  # type: ignore[arg-type]
    h.start()
    h.stop()
    live = _sleeper()  # a live process that is not the recorded one (pid reused)
    _record(tmp_path, serve=live.pid, serve_started=_started(live) + 1)
    h = Head(Cluster(), tmp_path)  # type: ignore[arg-type]
    h.start()
    h.stop()
    assert live.poll() is None


def test_a_record_without_serve_is_not_a_live_serve(tmp_path: Path) -> None:
    # pid 1 runs: a record that names no serve must not be read as pid 1 or any other.
    _record(tmp_path, serve_started=pids.start_time(1))
    h = Head(Cluster(), tmp_path)  # type: ignore[arg-type]
    h.start()
    h.stop()


def test_the_dead_serves_scheduler_is_waited_for(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stop_calls(monkeypatch)
    old = _spawn("sleep", "0.3")  # it notices its parent died and goes
    st = _started(old)
    _record(tmp_path, scheduler=[old.pid, st])
    c = Cluster(workers=0)
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    assert calls[0] == (old.pid, st, 0, head_mod.OLD_SCHEDULER_WAIT_S)
    assert head_mod.OLD_SCHEDULER_WAIT_S == 10.0
    assert old.wait(5) == 0  # waited for, not signalled
    h.stop()


def test_the_dead_serves_scheduler_is_killed_if_it_stays(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_mod, "OLD_SCHEDULER_WAIT_S", 0.2)
    old = _stubborn()
    _record(tmp_path, scheduler=[old.pid, _started(old)])
    h = Head(Cluster(workers=0), tmp_path)  # type: ignore[arg-type]
    h.start()
    assert old.wait(5) == -signal.SIGKILL
    h.stop()


def _left(tmp_path: Path, sup: subprocess.Popen[bytes], **over: Any) -> None:
    fields: dict[str, Any] = {"address": "tcp://127.0.0.1:5555",
                              "token": head_mod._token_hash("tok"), "serve": 0,
                              "serve_started": None, "scheduler": None,
                              "supervisor": [sup.pid, _started(sup)], "workers": _options()}
    fields.update(over)
    _record(tmp_path, **fields)


def test_adopts_the_left_supervisor_when_everything_matches(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    sup = _sleeper()
    _left(tmp_path, sup)
    c = Cluster()
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, "gpufn.head"):
        h.start()
    assert h.adopted and h.supervisor == (sup.pid, _started(sup))
    assert c.supervisors_started == 0 and sup.poll() is None
    assert f"adopted the workers of the previous gpufn serve (supervisor pid {sup.pid})" \
        in caplog.text
    rec = read_record(tmp_path)
    assert rec is not None and rec["supervisor"] == [sup.pid, _started(sup)]
    assert rec["serve"] == os.getpid()
    h.stop()  # not ours: SIGTERMed, then the cluster stopped
    assert sup.wait(5) == -signal.SIGTERM
    assert c.stops and h.supervisor is None and read_record(tmp_path) is None


@pytest.mark.parametrize(("cluster", "over", "changed"), [
    ({"workers": 0}, {}, "--no-workers"),
    ({}, {"address": "tcp://127.0.0.1:7777"},
     "the address (tcp://127.0.0.1:7777 -> tcp://127.0.0.1:5555)"),
    ({}, {"token": head_mod._token_hash("old")}, "the token"),
    ({"cpu_devices": 3}, {}, "cpu_devices (2 -> 3)"),
    ({"cpu_devices": 3, "islands": 2}, {}, "cpu_devices (2 -> 3), islands (0 -> 2)"),
    ({}, {"workers": None}, "cpu_devices (None -> 2), device_memory (None -> 0), "
     "islands (None -> 0), workers (None -> 1)"),
    ({}, {"workers": _options(newer=1)}, "the device options"),
])
def test_replaces_the_left_supervisor_when_something_changed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        cluster: dict[str, Any], over: dict[str, Any], changed: str) -> None:
    calls = _stop_calls(monkeypatch)
    sup = _sleeper()
    st = _started(sup)
    _left(tmp_path, sup, **over)
    c = Cluster(**cluster)
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, "gpufn.head"):
        h.start()
    assert sup.wait(5) == -signal.SIGTERM
    assert (sup.pid, st, signal.SIGTERM, 10.0) in calls
    assert not h.adopted
    assert (f"the previous gpufn serve's workers (supervisor pid {sup.pid}) are replaced: "
            f"{changed} changed") in caplog.text
    if c.workers:
        assert c.supervisor is not None and c.supervisors_started == 1
        assert h.supervisor == (c.supervisor.pid, _started(c.supervisor))
    else:
        assert c.supervisors_started == 0 and h.supervisor is None
    h.stop()


def test_host_memory_change_replaces(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_WORKER_HOST_MEMORY", "2GiB")
    sup = _sleeper()
    _left(tmp_path, sup)
    h = Head(Cluster(), tmp_path)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, "gpufn.head"):
        h.start()
    assert f"host_memory (None -> {2 << 30}) changed" in caplog.text and not h.adopted
    h.stop()


def test_a_dead_left_supervisor_is_neither_adopted_nor_signalled(tmp_path: Path) -> None:
    sup = _sleeper()
    st = _started(sup)
    _left(tmp_path, sup)
    _record(tmp_path, **{**json.loads((tmp_path / RECORD).read_text()),
                         "supervisor": [sup.pid, st + 1]})
    c = Cluster()
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    assert not h.adopted and c.supervisors_started == 1 and sup.poll() is None
    h.stop()


# ---------------------------------------------------------------- stop, leave, wait_left


def test_stop_sigints_the_scheduler_and_stops_our_supervisor_through_the_cluster(
        tmp_path: Path) -> None:
    c = Cluster()
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    assert (tmp_path / RECORD).exists()
    h.stop()
    assert c.stops == [{"supervisor_alive": True, "scheduler_code": -signal.SIGINT}]
    assert h.supervisor is None and not (tmp_path / RECORD).exists()


def test_stop_without_a_supervisor_or_a_live_scheduler(tmp_path: Path) -> None:
    c = Cluster(workers=0, plan=[(3, 0.0)])
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    assert c.scheduler is not None
    c.scheduler.wait()
    h.stop()
    assert c.stops == [{"supervisor_alive": None, "scheduler_code": 3}]
    assert not (tmp_path / RECORD).exists()
    h.stop()  # twice: nothing left, no error
    assert len(c.stops) == 2


def test_leave_terminates_the_scheduler_only(tmp_path: Path) -> None:
    c = Cluster()
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    assert not h.leaving
    h.leave()
    assert h.leaving
    assert c.scheduler is not None and c.scheduler.wait(5) == -signal.SIGTERM
    assert c.supervisor is not None and c.supervisor.poll() is None
    assert h.run() == 0  # leaving: not stopped, the record stays for the next serve
    assert c.stops == [] and (tmp_path / RECORD).exists()
    h.wait_left()
    h.leave()  # a dead scheduler: nothing to signal


def test_wait_left_kills_a_scheduler_that_stays(tmp_path: Path) -> None:
    c = Cluster(workers=0)
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    c.scheduler = _stubborn()
    h.leave()
    t0 = time.monotonic()
    h.wait_left(grace=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert c.scheduler.returncode == -signal.SIGKILL
    c.scheduler = _spawn("sleep", "0.1")
    h.wait_left()
    assert c.scheduler.returncode == 0
    c.scheduler = None
    h.wait_left()


# ---------------------------------------------------------------- run: the restart policy


def _running(tmp_path: Path, plan: list[tuple[int | None, float]],
             monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[Head, Cluster]:
    clock = Clock()
    monkeypatch.setattr(head_mod, "time", SimpleNamespace(monotonic=clock.monotonic,
                                                          sleep=time.sleep))
    c = Cluster(plan=plan, clock=clock, **kw)
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    return h, c


def test_six_deaths_within_a_minute_stop_with_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    plan: list[tuple[int | None, float]] = [(3, 1000.0 + 11.9 * i) for i in range(6)]
    h, c = _running(tmp_path, [*plan, (None, 2000.0)], monkeypatch)
    with caplog.at_level(logging.WARNING, "gpufn.head"):
        assert h.run() == 1
    assert c.restarts == head_mod.RESTARTS == 5
    assert "the scheduler died 5 times within 60s; stopping" in caplog.text
    assert len(c.stops) == 1 and not (tmp_path / RECORD).exists()


def test_the_sixth_death_just_inside_the_window_stops(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    plan: list[tuple[int | None, float]] = [(3, 1000.0), *((3, 1001.0),) * 4, (3, 1059.5)]
    h, c = _running(tmp_path, [*plan, (None, 2000.0)], monkeypatch)
    assert h.run() == 1
    assert c.restarts == 5


def test_deaths_spread_beyond_the_window_keep_restarting(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Every 12 s: the death 60 s before is out of the window, so at most 4 are in it.
    plan: list[tuple[int | None, float]] = [(3, 1000.0 + 12.0 * i) for i in range(12)]
    h, c = _running(tmp_path, [*plan, (0, 1200.0)], monkeypatch)
    assert h.run() == 0
    assert c.restarts == 12 and len(c.stops) == 1
    assert h._restarts == [1000.0 + 12.0 * i for i in range(7, 12)]


def test_a_sixth_death_exactly_a_minute_later_restarts(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    plan: list[tuple[int | None, float]] = [(3, 1000.0), *((3, 1001.0),) * 4, (3, 1060.0)]
    h, c = _running(tmp_path, [*plan, (0, 1061.0)], monkeypatch)
    assert h.run() == 0
    assert c.restarts == 6


def test_exit_zero_stops_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h, c = _running(tmp_path, [(0, 1000.0)], monkeypatch)
    assert h.run() == 0
    assert c.restarts == 0 and len(c.stops) == 1
    assert c.stops[0]["supervisor_alive"] is True
    assert not (tmp_path / RECORD).exists() and h.supervisor is None


def test_restart_and_death_are_logged_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    h, c = _running(tmp_path, [(head_mod.EXIT_RESTART, 1000.0), (3, 1001.0), (0, 1002.0)],
                    monkeypatch, address="tcp://127.0.0.1:5556")
    with caplog.at_level(logging.WARNING, "gpufn.head"):
        assert h.run() == 0
    assert head_mod.EXIT_RESTART == 75
    msgs = [r.getMessage() for r in caplog.records if r.name == "gpufn.head"]
    assert msgs == [
        "the scheduler was restarted; starting it again on tcp://127.0.0.1:5556",
        "the scheduler died (exit status 3); starting it again on tcp://127.0.0.1:5556"]
    assert c.restarts == 2


def test_the_record_names_the_new_scheduler(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    h, c = _running(tmp_path, [(3, 1000.0), (None, 1001.0)], monkeypatch)
    first = read_record(tmp_path)
    c.address = "tcp://127.0.0.1:9999"  # restart_scheduler's address is the one written
    stopper = _ThreadedStop(h, c)
    assert h.run() == 0
    stopper.join()
    assert stopper.record is not None and first is not None
    assert stopper.record["scheduler"][0] == stopper.pid != first["scheduler"][0]
    assert stopper.record["address"] == "tcp://127.0.0.1:9999"


class _ThreadedStop:
    """Once the restarted scheduler runs: read the record, then leave."""

    def __init__(self, h: Head, c: Cluster) -> None:
        import threading

        self.record: dict[str, Any] | None = None
        self.pid = 0

        def go() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s = c.scheduler
                rec = read_record(h.state_dir)
                if s is not None and rec is not None and rec["scheduler"][0] == s.pid \
                        and s.returncode is None and c.restarts:
                    self.record, self.pid = rec, s.pid
                    break
                time.sleep(0.02)
            h.leave()

        self.t = threading.Thread(target=go, daemon=True)
        self.t.start()

    def join(self) -> None:
        self.t.join(10)


def test_a_failed_restart_counts_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    h, c = _running(tmp_path, [(3, 1000.0), (None, 1001.0), (0, 1002.0)], monkeypatch)
    c.fail_restarts = 1
    with caplog.at_level(logging.WARNING, "gpufn.head"):
        assert h.run() == 0
    assert "the scheduler did not start again: no port" in caplog.text
    assert c.restarts == 2 and h._restarts == [1000.0, 1001.0]


def test_failed_restarts_give_up_after_the_limit(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    h, c = _running(tmp_path, [(3, 1000.0), *((None, 1001.0),) * 5], monkeypatch)
    c.fail_restarts = 10
    assert h.run() == 1
    assert c.restarts == 5 and len(c.stops) == 1


def test_a_full_disk_in_run_is_logged_and_does_not_stop(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    h, c = _running(tmp_path, [(3, 1000.0), (0, 1001.0)], monkeypatch)
    (tmp_path / "head.tmp").symlink_to("/dev/full")
    with caplog.at_level(logging.WARNING, "gpufn.head"):
        assert h.run() == 0
    assert c.restarts == 1
    assert f"could not write {tmp_path / RECORD}" in caplog.text
    assert "cannot adopt this host's workers" in caplog.text


# ---------------------------------------------------------------- for the tool's survivors


def test_a_record_naming_no_serve_signals_nothing(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A record whose serve is null (pid 1's start time beside it): not read as pid 1. The
    # stop is noted only, so a mistaken reading signals nobody.
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(head_mod, "_stop_pid", lambda *a: calls.append(a))
    _record(tmp_path, serve=None, serve_started=pids.start_time(1), supervisor=None)
    assert stop_recorded(tmp_path) is False
    assert calls == [] and not (tmp_path / RECORD).exists()


def test_stop_gives_a_supervisor_not_ours_ten_seconds(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sup = _sleeper()
    st = _started(sup)
    _left(tmp_path, sup)
    h = Head(Cluster(), tmp_path)  # type: ignore[arg-type]
    h.start()
    assert h.adopted
    calls = _stop_calls(monkeypatch)
    h.stop()
    assert calls == [(sup.pid, st, signal.SIGTERM, 10.0)]
    assert sup.wait(5) == -signal.SIGTERM


class _Waited:
    """A scheduler that stays (Popen's wait/kill/poll), noting how long it is waited for."""

    def __init__(self) -> None:
        self.waits: list[float | None] = []
        self.killed = False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def terminate(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        if not self.killed:
            raise subprocess.TimeoutExpired("scheduler", timeout or 0)
        return -9

    def kill(self) -> None:
        self.killed = True


def _head_whose_scheduler_died(tmp_path: Path) -> tuple[Cluster, Head]:
    c = Cluster(workers=0)
    h = Head(c, tmp_path)  # type: ignore[arg-type]
    h.start()
    assert c.scheduler is not None
    c.scheduler.kill()
    c.scheduler.wait()
    return c, h


def test_wait_left_waits_ten_seconds_by_default(tmp_path: Path) -> None:
    c, h = _head_whose_scheduler_died(tmp_path)
    w = _Waited()
    c.scheduler = w  # type: ignore[assignment]
    h.wait_left()
    assert w.waits == [10.0, None] and w.killed


def test_leave_and_wait_left_without_a_scheduler(tmp_path: Path) -> None:
    c, h = _head_whose_scheduler_died(tmp_path)
    c.scheduler = None
    h.leave()
    h.wait_left()
    assert h.leaving


def test_stop_recorded_when_the_serve_removes_its_record_itself(tmp_path: Path) -> None:
    # A real `gpufn serve` stopped by SIGINT removes head.json on its way out.
    serve = _spawn("sh", "-c", f"trap 'rm -f {tmp_path / RECORD}; exit 0' INT; echo ready; "
                   "while :; do sleep 0.05; done", stdout=subprocess.PIPE)
    assert serve.stdout is not None and serve.stdout.readline() == b"ready\n"
    _record(tmp_path, serve=serve.pid, serve_started=_started(serve), supervisor=None)
    assert stop_recorded(tmp_path) is True
    assert serve.wait(5) == 0 and not (tmp_path / RECORD).exists()


def test_stop_pid_a_process_gone_between_the_check_and_the_signal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The race (it exits right after `same` said it runs) made certain: `same` answers
    # from just before, for a process already ended (a zombie, then reaped).
    p = _sleeper()
    st = _started(p)
    p.kill()
    deadline = time.monotonic() + 5
    while pids.alive(p.pid) and time.monotonic() < deadline:  # a zombie: kill() still finds it
        time.sleep(0.01)
    answers = [True, True]

    def same(pid: int, started: int | None) -> bool:
        if len(answers) == 1:
            p.wait()  # reaped now: the SIGKILL finds no process
        return answers.pop(0) if answers else False

    monkeypatch.setattr(head_mod, "processes", SimpleNamespace(same=same))
    head_mod._stop_pid(p.pid, st, 0, 0.0)
    assert answers == [] and p.returncode == -signal.SIGKILL
    answers[:] = [True]
    head_mod._stop_pid(p.pid, st, signal.SIGTERM, 5.0)  # its signal finds no process
    assert answers == []


@pytest.mark.timeout(10)
def test_a_sigterm_during_a_restart_still_leaves(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM (leave) while the dead scheduler is being replaced, before the new one runs:
    # the new one is terminated too, not waited for until it dies of something else.
    h, c = _running(tmp_path, [(3, 1000.0), (None, 1001.0)], monkeypatch)
    real = c.restart_scheduler

    def restart() -> str:
        h.leave()
        return real()

    monkeypatch.setattr(c, "restart_scheduler", restart)
    t0 = time.monotonic()
    assert h.run() == 0
    assert time.monotonic() - t0 < 5
    assert c.scheduler is not None and c.scheduler.wait(5) == -signal.SIGTERM
    assert c.stops == [] and (tmp_path / RECORD).exists()
