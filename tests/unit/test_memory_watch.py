"""The host-memory watch: limits from the host's budget, a call's declaration and the
models held in host memory; the host-wide ceiling; the worker's reports over a pipe; and
sampling real processes (a session leader and its child) through /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpufn.worker.host import proc_table
from gpufn.worker.host.memory_watch import (
    HOST_CEILING,
    SCAN_S,
    Budget,
    MemoryWatch,
    Reports,
    Stop,
    default_budget,
    over_budget,
)

MiB = 2**20
GiB = 2**30

pytestmark = pytest.mark.skipif(not proc_table.HAS_PROC, reason="needs Linux /proc")


def test_a_limit_is_the_budget_or_the_declaration_plus_models_under_the_ceiling() -> None:
    assert Budget(8 * GiB).limit(100 * GiB) == 8 * GiB
    assert Budget(8 * GiB, declared=2 * GiB).limit(100 * GiB) == 2 * GiB  # lower: stricter
    assert Budget(8 * GiB, declared=20 * GiB).limit(100 * GiB) == 20 * GiB  # higher: allowed
    assert Budget(8 * GiB, models=3 * GiB).limit(100 * GiB) == 11 * GiB  # offloaded models
    assert Budget(8 * GiB, declared=200 * GiB).limit(100 * GiB) == 100 * GiB  # the ceiling
    assert Budget(0).limit(100 * GiB) == 0  # unwatched
    assert default_budget(64 * GiB, 4) == int(64 * GiB * 0.8 / 4)


def test_over_budget_names_the_limit_and_the_fix() -> None:
    budgets = {"n:0": Budget(GiB), "n:1": Budget(GiB, declared=4 * GiB)}
    [stop] = over_budget({"n:0": 2 * GiB, "n:1": 3 * GiB}, budgets, 100 * GiB, "hostA")
    assert stop.key == "n:0" and stop.limit == GiB
    assert "host hostA used 2.00 GiB" in stop.reason and "limit of 1.00 GiB" in stop.reason
    assert "--worker-host-memory" in stop.reason and "host_memory=" in stop.reason
    [declared] = over_budget({"n:1": 5 * GiB}, budgets, 100 * GiB, "h")
    assert "4.00 GiB its call declared" in declared.reason


def test_the_workers_together_over_the_ceiling_stop_the_one_using_most_beside_models() -> None:
    ceiling = int(10 * GiB * HOST_CEILING)
    budgets = {"a": Budget(8 * GiB, models=5 * GiB), "b": Budget(8 * GiB)}
    used = {"a": 6 * GiB, "b": 4 * GiB}  # each under its own limit, 10 GiB together
    [stop] = over_budget(used, budgets, ceiling, "h")
    assert stop.key == "b"  # a holds 5 GiB of models the scheduler placed there
    assert "together used 10.00 GiB" in stop.reason and "over 95% of its 10.00 GiB" in stop.reason
    # the fix it names is the declaration (the scheduler then knows), not a bigger budget
    assert "declare more with @gpu(host_memory=...)" in stop.reason
    assert "--worker-host-memory" not in stop.reason
    assert over_budget({"a": 6 * GiB, "b": 3 * GiB}, budgets, ceiling, "h") == []


def test_the_worker_reports_its_declarations_over_a_pipe() -> None:
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    reports = Reports(w)
    me = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                          start_new_session=True)
    try:
        watch.watch("n:0", me.pid, r)
        reports.call_started("inv1", 3 * GiB)
        reports.call_started("inv2", 2 * GiB)
        reports.models(512 * MiB)
        watch.tick(time.monotonic())
        assert watch.limits() == {"n:0": 3 * GiB + 512 * MiB}
        reports.call_ended("inv1")
        reports.call_ended("inv2")
        watch.tick(time.monotonic() + 1)
        assert watch.limits() == {"n:0": GiB + 512 * MiB}
    finally:
        me.kill()
        me.wait()
        watch.close()
        os.close(w)


def test_a_session_over_its_budget_is_found_through_its_child() -> None:
    """The leader stays small; its child allocates. Both count, by session."""
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', "
              "'import time; b = bytearray(400 * 2**20); time.sleep(60)']); time.sleep(60)")
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    watch = MemoryWatch(200 * MiB, 64 * GiB, "h")
    try:
        watch.watch("n:0", leader.pid)
        deadline = time.monotonic() + 30
        stops = []
        t = time.monotonic()
        while not stops and time.monotonic() < deadline:
            t += SCAN_S + 0.1  # past every sampling and scanning interval
            stops = watch.tick(t)
            time.sleep(0.05)
        assert [s.key for s in stops] == ["n:0"]
        assert stops[0].used > 200 * MiB
        assert proc_table.Resident(leader.pid).bytes() < 100 * MiB  # the child's bytes counted
        members = proc_table.in_session(leader.pid)
        assert len(members) == 2  # the leader and the child that allocated
    finally:
        proc_table.signal_all(proc_table.in_session(leader.pid))
        leader.wait()
        watch.close()


def test_an_unwatched_host_reads_nothing() -> None:
    watch = MemoryWatch(0, 64 * GiB, "h")
    assert not watch.enabled
    watch.watch("n:0", os.getpid())
    assert watch.tick(time.monotonic()) == [] and watch.limits() == {}


def _watch_until_stop(watch: MemoryWatch, for_s: float) -> list[Stop]:
    """Tick the watch (past every sampling and scanning interval) for `for_s` seconds or
    until it says to stop a worker."""
    deadline = time.monotonic() + for_s
    t, stops = time.monotonic(), []
    while not stops and time.monotonic() < deadline:
        t += SCAN_S + 0.1
        stops = watch.tick(t)
        time.sleep(0.05)
    return stops


@pytest.mark.timeout(60)
def test_a_child_in_its_own_process_group_is_counted() -> None:
    """A call's child that made its own process group (setpgid, as shells' jobs do) is
    still in the worker's session: its bytes count, and it is in what is stopped."""
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', "
              "'import time; b = bytearray(400 * 2**20); time.sleep(60)'], process_group=0); "
              "time.sleep(60)")
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    watch = MemoryWatch(200 * MiB, 64 * GiB, "h")
    try:
        watch.watch("n:0", leader.pid)
        stops = _watch_until_stop(watch, 30)
        assert [s.key for s in stops] == ["n:0"] and stops[0].used > 200 * MiB
        assert proc_table.read(leader.pid).rss < 100 * MiB  # type: ignore[union-attr]  # the child counted
        members = proc_table.in_session(leader.pid)
        [child] = [m for m in members if m != leader.pid]
        assert proc_table.read(child).pgrp == child != leader.pid  # type: ignore[union-attr]
    finally:
        proc_table.signal_all(proc_table.in_session(leader.pid))
        leader.wait()
        watch.close()


@pytest.mark.timeout(60)
def test_forked_children_sharing_the_workers_pages_do_not_get_it_stopped() -> None:
    """The worker touches 300 MiB and forks three children that only sleep: resident
    bytes summed say 1.2 GiB, over a 600 MiB limit, but the pages are one copy (PSS), so
    nothing is stopped."""
    script = ("import os, sys, time\n"
              "b = b'x' * (300 * 2**20)\n"
              "for _ in range(3):\n"
              "    if os.fork() == 0:\n"
              "        time.sleep(60)\n"
              "        os._exit(0)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    watch = MemoryWatch(600 * MiB, 64 * GiB, "h")
    try:
        assert leader.stdout is not None and leader.stdout.readline() == "ready\n"
        watch.watch("n:0", leader.pid)
        members = []
        deadline = time.monotonic() + 20
        while len(members) < 4:
            assert time.monotonic() < deadline, members
            members = proc_table.in_session(leader.pid)
            time.sleep(0.05)
        rss = sum(proc_table.read(m).rss for m in members)  # type: ignore[union-attr]
        assert rss > 1100 * MiB, rss  # over the limit by resident bytes summed
        assert _watch_until_stop(watch, 3) == []
    finally:
        proc_table.signal_all(proc_table.in_session(leader.pid))
        leader.wait()
        watch.close()


# --- pieces cosmic-ray's mutants showed unpinned (scripts/mutants.py --room memory_watch) ---


def test_sessions_are_scanned_every_scan_interval_not_every_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scans = []
    monkeypatch.setattr(proc_table, "snapshot", lambda: scans.append(1) or [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)  # steady
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    try:
        watch.watch("n:0", os.getpid())
        watch.tick(100.0)
        assert len(scans) == 1
        for k in range(1, 9):  # samples every 0.2 s: no new scan within SCAN_S
            watch.tick(100.0 + 0.21 * k)
        assert len(scans) == 1
        watch.tick(100.0 + SCAN_S + 0.01)
        assert len(scans) == 2
    finally:
        watch.close()


def test_a_worker_forgotten_leaves_no_descriptor_open() -> None:
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    before = len(os.listdir("/proc/self/fd"))
    watch.watch("n:0", os.getpid(), r)
    watch.forget("n:0")
    os.close(w)
    assert len(os.listdir("/proc/self/fd")) == before - 2  # both ends: the read end with it
    with pytest.raises(OSError):
        os.fstat(r)


def test_a_process_that_left_the_session_is_no_longer_read(monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    session = [proc_table.Proc(os.getpid(), 1, 1, os.getpid(), 0),
               proc_table.Proc(child.pid, 1, 1, os.getpid(), 0)]
    monkeypatch.setattr(proc_table, "snapshot", lambda: list(session))
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(64 * GiB, 128 * GiB, "h")
    try:
        watch.watch("n:0", os.getpid())
        watch.tick(100.0)
        fds = len(os.listdir("/proc/self/fd"))
        session.pop()  # the child left (or ended)
        watch.tick(100.0 + SCAN_S + 0.01)
        assert len(os.listdir("/proc/self/fd")) == fds - 1  # its reader closed
    finally:
        watch.close()
        child.kill()
        child.wait()


def test_a_quick_fall_in_available_memory_rescans_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    scans = []
    available = [32 * GiB]
    monkeypatch.setattr(proc_table, "snapshot", lambda: scans.append(1) or [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: available[0])
    watch = MemoryWatch(GiB, 64 * GiB, "h")  # a fall of GiB / 4 is quick
    try:
        watch.watch("n:0", os.getpid())
        watch.tick(100.0)
        available[0] -= GiB // 4  # exactly the bound: not yet
        watch.tick(100.3)
        assert len(scans) == 1
        available[0] -= 1
        watch.tick(100.6)
        assert len(scans) == 2
    finally:
        watch.close()


def test_a_host_with_no_worker_counted_yet_budgets_for_one() -> None:
    assert default_budget(10 * GiB, 0) == default_budget(10 * GiB, 1) == 8 * GiB


def test_odd_or_broken_report_pipes_are_survived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    try:
        watch.watch("n:0", os.getpid(), r)
        os.write(w, b"-5 -7\n")  # nonsense: nothing declared, no models
        watch.tick(100.0)
        assert watch.limits() == {"n:0": GiB}
        os.close(r)  # the read end gone under it: the watch goes on
        watch.tick(101.0)
        assert watch.limits() == {"n:0": GiB}
    finally:
        os.close(w)
        watch._workers["n:0"].reports = -1  # closed above
        watch.close()
    pr, pw = os.pipe()
    os.close(pr)  # the supervisor is gone
    reports = Reports(pw)
    reports.call_started("inv1", GiB)  # EPIPE: not raised, and nothing written again
    assert reports.fd == -1
    os.close(pw)


def test_without_a_reading_of_available_memory_sessions_are_scanned_on_time_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scans = []
    monkeypatch.setattr(proc_table, "snapshot", lambda: scans.append(1) or [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: None)  # unreadable
    for host_limit in (64 * GiB, 0):  # nor on a host whose size is unknown
        scans.clear()
        watch = MemoryWatch(GiB, host_limit, "h")
        try:
            watch.watch("n:0", os.getpid())
            for k in range(5):
                watch.tick(100.0 + 0.21 * k)
            assert len(scans) == 1, host_limit
        finally:
            watch.close()


def test_sizes_read_in_mib_below_a_gib_and_limits_add_models_without_a_ceiling() -> None:
    from gpufn.worker.host.memory_watch import format_bytes

    assert format_bytes(512 * MiB) == "512 MiB" and format_bytes(GiB) == "1.00 GiB"
    assert Budget(GiB, models=512 * MiB).limit(0) == GiB + 512 * MiB
    assert over_budget({"n:0": GiB}, {"n:0": Budget(GiB)}, 0, "h") == []  # at it, not over
    assert len(over_budget({"n:0": GiB + 1}, {"n:0": Budget(GiB)}, 0, "h")) == 1


def test_only_the_latest_report_line_counts(monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    try:
        watch.watch("n:0", os.getpid(), r)
        os.write(w, b"garbage\n" + f"{2 * GiB} 0\n".encode())  # an old, odd line: passed over
        with caplog.at_level("WARNING", logger="gpufn.supervisor"):
            watch.tick(100.0)
        assert watch.limits() == {"n:0": 2 * GiB} and not caplog.records
    finally:
        watch.close()
        os.close(w)


def test_a_fall_in_available_memory_on_a_small_host_is_weighed_against_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scans = []
    available = [GiB]
    monkeypatch.setattr(proc_table, "snapshot", lambda: scans.append(1) or [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: available[0])
    for host, bound in ((2 * GiB, 2 * GiB // 20), (0, None)):  # a twentieth of the host
        scans.clear()
        available[0] = GiB
        watch = MemoryWatch(GiB, host, "h")
        try:
            watch.watch("n:0", os.getpid())
            watch.tick(100.0)
            available[0] -= bound if bound is not None else GiB // 2  # not more than that
            watch.tick(100.3)
            assert len(scans) == 1, host  # (a host of unknown size: never at once)
            if bound is not None:
                available[0] -= 1
                watch.tick(100.6)
                assert len(scans) == 2
        finally:
            watch.close()


def test_a_worker_stopped_is_reported_once_and_no_longer_watched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    monkeypatch.setattr(proc_table, "snapshot", lambda: [proc_table.Proc(me, 1, 1, me, 0)])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(MiB, 64 * GiB, "h")  # this test process is far over a MiB
    try:
        watch.watch("n:0", me)
        assert [s.key for s in watch.tick(100.0)] == ["n:0"]
        assert watch.tick(101.0) == [] and watch.limits() == {}
    finally:
        watch.close()


def test_reports_are_read_every_sample_interval_and_said_only_when_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufn.worker.host.memory_watch import SAMPLE_S

    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    reports = Reports(w)
    try:
        watch.watch("n:0", os.getpid(), r)
        reports.call_started("quiet", 0)  # declares nothing: nothing new to say
        with pytest.raises(BlockingIOError):
            os.read(r, 100)
        watch.tick(100.0)
        reports.call_started("big", 3 * GiB)
        watch.tick(100.0 + SAMPLE_S / 2)  # not a sample yet
        assert watch.limits() == {"n:0": GiB}
        watch.tick(100.0 + SAMPLE_S)  # the next sample, to the tick
        assert watch.limits() == {"n:0": 3 * GiB}
    finally:
        watch.close()
        os.close(w)


def test_sessions_are_scanned_again_at_the_scan_interval_to_the_tick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[float] = []

    def snapshot() -> list[proc_table.Proc]:
        scans.append(time.monotonic())
        return []

    monkeypatch.setattr(proc_table, "snapshot", snapshot)
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)  # steady
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    try:
        watch.watch("n:0", os.getpid())
        watch.tick(100.0)
        assert len(scans) == 1
        watch.tick(100.0 + SCAN_S)  # SCAN_S after the last scan, exactly (and a sample)
        assert len(scans) == 2
    finally:
        watch.close()


def test_a_stop_names_the_models_the_worker_holds_in_host_memory_only_if_any() -> None:
    [held] = over_budget({"n:0": 2 * GiB}, {"n:0": Budget(GiB, models=512 * MiB)}, 0, "h")
    assert "limit of 1.50 GiB" in held.reason
    assert "(with 512 MiB of models in host memory)" in held.reason
    [bare] = over_budget({"n:0": 2 * GiB}, {"n:0": Budget(GiB)}, 0, "h")
    assert "of models in host memory" not in bare.reason


def test_a_worker_gone_before_it_is_watched_is_watched_without_a_reading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # reaped: its /proc entry is gone
    watch = MemoryWatch(MiB, 64 * GiB, "h")
    try:
        watch.watch("n:0", gone.pid)  # no error: it is found gone at the next scan
        assert watch.limits() == {"n:0": MiB}
        assert watch.tick(100.0) == []  # nothing read, nothing over
    finally:
        watch.close()


def test_a_supervisor_behind_on_reports_gets_the_latest_state_with_the_next_change() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    reports = Reports(w)
    try:
        with pytest.raises(BlockingIOError):
            while True:  # the pipe full: the supervisor has not read for a while
                os.write(w, b"x" * 65536)
        reports.call_started("big", 3 * GiB)  # cannot be written now: not an error
        assert reports.fd == w
        with pytest.raises(BlockingIOError):
            while os.read(r, 65536):  # the supervisor catches up
                pass
        reports.call_started("small", GiB)  # the state to say is still the big call's
        assert os.read(r, 4096) == f"{3 * GiB} 0\n".encode()
    finally:
        os.close(r)
        os.close(w)


def test_reports_say_nothing_declared_as_zero_and_nothing_new_not_at_all() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    reports = Reports(w)
    try:
        reports.models(0)  # no call, no model: what the supervisor assumes already
        with pytest.raises(BlockingIOError):
            os.read(r, 4096)
        reports.models(5 * MiB)
        assert os.read(r, 4096) == f"0 {5 * MiB}\n".encode()
    finally:
        os.close(r)
        os.close(w)


def test_a_worker_over_its_limit_by_pss_to_the_byte_is_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over by resident bytes (this test process is far over a MiB), the proportional
    bytes decide: at the limit it stays, a byte over it is stopped."""
    me = os.getpid()
    monkeypatch.setattr(proc_table, "snapshot", lambda: [proc_table.Proc(me, 1, 1, me, 0)])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    for pss, stopped in ((MiB, []), (MiB + 1, ["n:0"])):
        monkeypatch.setattr(proc_table, "pss", lambda pid, n=pss: n)
        watch = MemoryWatch(MiB, 64 * GiB, "h")
        try:
            watch.watch("n:0", me)
            stops = watch.tick(100.0)
            assert [s.key for s in stops] == stopped and [s.used for s in stops] == (
                [pss] if stopped else [])
        finally:
            watch.close()


def test_a_report_pipe_closed_by_its_worker_never_makes_the_watch_close_another_descriptor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    null = os.open(os.devnull, os.O_RDWR)
    saved: dict[int, int | None] = {}
    for fd in (0, 1):  # stdin and stdout are ours for the test (and put back after)
        try:
            saved[fd] = os.dup(fd)
        except OSError:
            saved[fd] = None
        os.dup2(null, fd)
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    try:
        watch.watch("n:0", os.getpid(), r)
        os.close(w)  # the worker exited: its end of the pipe closed
        watch.tick(100.0)
        with pytest.raises(OSError):
            os.fstat(r)  # the watch closed its read end
        watch.forget("n:0")
        for fd in (0, 1):  # and nothing else
            assert os.path.samestat(os.fstat(fd), os.fstat(null)), fd
    finally:
        watch.close()
        for fd, was in saved.items():
            if was is None:
                os.close(fd)
            else:
                os.dup2(was, fd)
                os.close(was)
        os.close(null)


def test_the_workers_together_at_the_ceiling_are_not_over_it() -> None:
    budgets = {"a": Budget(8 * GiB), "b": Budget(8 * GiB)}
    ceiling = 10 * GiB
    assert over_budget({"a": 6 * GiB, "b": 4 * GiB}, budgets, ceiling, "h") == []
    [stop] = over_budget({"a": 6 * GiB, "b": 4 * GiB + 1}, budgets, ceiling, "h")
    assert stop.key == "a" and stop.limit == ceiling


def test_a_workers_limit_is_capped_at_the_hosts_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(GiB, 10 * GiB, "h")
    r, w = watch.pipe()
    try:
        watch.watch("n:0", os.getpid(), r)
        os.write(w, f"{20 * GiB} 0\n".encode())  # declares more than the host has
        watch.tick(100.0)
        assert watch.limits() == {"n:0": int(10 * GiB * HOST_CEILING)}
    finally:
        watch.close()
        os.close(w)


def test_a_budget_of_any_bytes_is_watched_and_only_zero_is_not() -> None:
    assert MemoryWatch(1, 64 * GiB, "h").enabled
    assert not MemoryWatch(0, 64 * GiB, "h").enabled


def test_a_workers_last_report_before_it_closed_its_pipe_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    try:
        watch.watch("n:0", os.getpid(), r)
        os.write(w, f"{2 * GiB} 0\n".encode())
        os.close(w)  # and exited
        watch.tick(100.0)
        assert watch.limits() == {"n:0": 2 * GiB}
    finally:
        watch.close()


def test_a_worker_without_a_report_pipe_says_nothing_and_does_not_fail() -> None:
    reports = Reports(-1)
    reports.call_started("inv1", GiB)
    reports.models(MiB)
    reports.call_ended("inv1")
    assert reports.fd == -1


def test_closing_the_watch_closes_every_workers_descriptors() -> None:
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    before = len(os.listdir("/proc/self/fd"))
    pipes = [watch.pipe() for _ in range(2)]
    for k, (r, _) in enumerate(pipes):
        watch.watch(f"n:{k}", os.getpid(), r)  # a report pipe and a reader each
    watch.close()
    for r, w in pipes:
        with pytest.raises(OSError):
            os.fstat(r)
        os.close(w)
    assert len(os.listdir("/proc/self/fd")) == before and watch.limits() == {}


def test_forgetting_a_worker_whose_report_pipe_is_already_gone_does_not_fail(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    try:
        watch.watch("n:0", os.getpid(), r)
        os.close(r)  # gone under the watch (EBADF on every read)
        watch.tick(100.0)
        watch.forget("n:0")
        assert watch.limits() == {}
    finally:
        watch.close()
        os.close(w)


def test_an_unreadable_latest_report_is_warned_about_and_changes_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(proc_table, "snapshot", lambda: [])
    monkeypatch.setattr(proc_table, "available_memory", lambda: 32 * GiB)
    watch = MemoryWatch(GiB, 64 * GiB, "h")
    r, w = watch.pipe()
    try:
        watch.watch("n:0", os.getpid(), r)
        os.write(w, b"lots\n")
        with caplog.at_level("WARNING", logger="gpufn.supervisor"):
            assert watch.tick(100.0) == []
        assert watch.limits() == {"n:0": GiB}
        assert [rec.getMessage() for rec in caplog.records] == [
            f"unreadable memory report from worker {os.getpid()}: b'lots'"]
    finally:
        watch.close()
        os.close(w)
