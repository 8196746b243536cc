"""Leases through real processes: repeat calls go straight to the worker and back,
and every guarantee of the scheduled path holds (metering, waiting calls, lost workers,
clients that cannot reach the workers)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import gpufn
from gpufn.api.function import Function
from gpufn.client import default as client_mod
from gpufn.exceptions import WorkerLost
from gpufn.wire import protocol as p
from gpufn.wire import shm

from ..conftest import cluster_with, shutdown_default, wait_ready
from ._head import TOKEN, Head
from ._waits import wait_for

pytestmark = pytest.mark.timeout(120)


@gpufn.gpu(memory="1MiB")
def ident(x: int) -> int:
    return x


@gpufn.gpu(memory="1MiB")
def snooze(x: int) -> int:  # 10 ms of "device time": not short, so never pipelined
    time.sleep(0.01)
    return x


@gpufn.gpu(memory="1MiB")
def nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@gpufn.gpu(memory="1MiB", retries=1)
def nap_retried(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _channel(c: gpufn.Client) -> object:
    """This thread's blocking-call channel (None before its first call)."""
    return getattr(c._sync, "channel", None)


@pytest.fixture(scope="module")
def leasing() -> Iterator[gpufn.Client]:
    """One device, leases of 30 s: only revocation ends one early; arguments of 1 MiB
    and more through shared memory."""
    with cluster_with(GPUFN_CPU_DEVICES=1, GPUFN_LEASE_SECONDS=30,
                      GPUFN_SHM_THRESHOLD="1MiB") as c:
        yield c


def _usage_calls(c: gpufn.Client, fn: str) -> int:
    rows = c.query("usage", {"since": 3600.0, "by": "function"})["rows"]
    return sum(int(r["calls"]) for r in rows if r["function"] == fn)


def _completed(c: gpufn.Client) -> int:
    return sum(int(d["completed"]) for d in c.status()["devices"])


def test_repeat_calls_go_straight_to_the_worker_and_are_metered(leasing: gpufn.Client) -> None:
    before = _usage_calls(leasing, "ident")
    done_before = _completed(leasing)
    assert [ident.remote(i) for i in range(60)] == list(range(60))
    ch = _channel(leasing)
    assert ch.leases.direct_calls >= 55  # type: ignore[attr-defined]
    assert list(ident.map(range(2000))) == list(range(2000))  # under leases too
    # Another client's call revokes the leases; their Results meter every call they ran.
    other = threading.Thread(target=lambda: nap.remote(0.0))
    other.start()
    other.join(30)
    wait_for(lambda: _usage_calls(leasing, "ident") - before == 2060, timeout=30,
             what="every leased call metered once")
    time.sleep(0.5)
    assert _usage_calls(leasing, "ident") - before == 2060
    # `gpufn status`'s completed column counts them too (and the other client's call)
    assert _completed(leasing) - done_before == 2061


@gpufn.gpu(memory="1MiB")
def introspect(x: int) -> tuple[str, str, int, int, int, str]:
    ctx = gpufn.context()
    print(f"inside {ctx.invocation_id}")
    if x < 0:
        raise ValueError(f"negative {x}")
    return ctx.invocation_id, ctx.function, ctx.attempt, ctx.world_size, x, str(ctx.device)


def test_a_leased_call_runs_as_a_scheduled_one_does(
        leasing: gpufn.Client, capfd: pytest.CaptureFixture[str]) -> None:
    """Short calls under a lease run on the worker's own path (`_run_leased`): they see
    their own context, their output reaches the caller under their id, and what they
    raise comes back as raised."""
    introspect.remote(0)  # its run time is known: short, so inline
    leases = _channel(leasing).leases  # type: ignore[attr-defined]
    direct = leases.direct_calls
    got = [introspect.remote(i) for i in range(1, 21)]
    assert leases.direct_calls - direct >= 18
    assert [g[1:5] for g in got] == [(introspect.name, 1, 1, i) for i in range(1, 21)]
    assert all(g[5] == "cpu" for g in got), got
    ids = [g[0] for g in got]
    assert len(set(ids)) == 20
    with pytest.raises(ValueError, match="negative -3"):
        introspect.remote(-3)
    out = ""

    def printed() -> bool:  # each line under the prefix of the call that printed it
        nonlocal out
        out += capfd.readouterr().out
        return all(f"[{introspect.name} {i}] inside {i}" in out for i in ids)
    wait_for(printed, 10, "every leased call's output under its own id")


@gpufn.gpu(memory="1MiB")
def thread_short() -> str:
    return threading.current_thread().name


@gpufn.gpu(memory="1MiB")
def thread_long() -> str:  # measured over 5 ms (`short_call_seconds`): never inline
    time.sleep(0.02)
    return threading.current_thread().name


def _under_a_lease(leases: object, fn: Function[..., object] | Callable[[], object]) -> bool:
    before = leases.direct_calls  # type: ignore[attr-defined]
    if isinstance(fn, Function):
        fn.remote()
    else:
        fn()
    return leases.direct_calls > before  # type: ignore[attr-defined]


def test_only_short_plain_leased_calls_run_on_the_workers_main_thread(
        leasing: gpufn.Client) -> None:
    """A short call under a lease runs on the worker's main thread; one measured long in
    the executor's threads, as a scheduled one does (on the main thread it would hold up
    the loop: other DirectRuns, cancels, the scheduler's messages)."""
    thread_short.remote()
    leases = _channel(leasing).leases  # type: ignore[attr-defined]
    for fn, main in ((thread_short, True), (thread_long, False)):
        fn.remote()  # its run time is measured
        wait_for(lambda fn=fn: _under_a_lease(leases, fn), timeout=20,  # type: ignore[misc]
                 what=f"a lease for {fn.name}")  # (another function's ends once idle)
        direct = leases.direct_calls
        names = {fn.remote() for _ in range(6)}
        assert leases.direct_calls - direct >= 4, fn.name
        assert all(n.startswith("MainThread") == main for n in names), (fn.name, names)


@gpufn.gpu(memory="1MiB")
def numel(t: torch.Tensor) -> int:
    return t.numel()


@pytest.mark.skipif(not shm.host_id(), reason="no writable /dev/shm here")
def test_a_leased_calls_argument_file_is_taken_back_for_the_next_call(
        leasing: gpufn.Client) -> None:
    """As after a scheduled call, the client's pool takes a leased call's argument file
    back (its Result says one device, one attempt: nothing else may still map it), so
    repeat calls write their arguments into the same file."""
    x = torch.ones(2**19)  # 2 MiB: through a shared-memory file
    numel.remote(x)
    leases = _channel(leasing).leases  # type: ignore[attr-defined]
    pool = shm.pool()
    assert pool is not None
    wait_for(lambda: _under_a_lease(leases, lambda: numel.remote(x)), timeout=20,
             what="a lease for numel")
    direct, seen = leases.direct_calls, set(pool.free_names())
    for _ in range(8):
        assert numel.remote(x) == 2**19
        seen |= set(pool.free_names())
    assert leases.direct_calls - direct >= 6
    assert len(seen) == 1, seen  # one file, taken back after every call
    pool.clear()


@gpufn.gpu(memory="1MiB", retries=gpufn.Retries(max_retries=2, initial_delay=0.0,
                                                on=(ValueError,)))
def fails_first(path: str) -> int:
    n = int(Path(path).read_text()) if os.path.exists(path) else 0
    Path(path).write_text(str(n + 1))
    if n == 0:
        raise ValueError("the first attempt fails")
    return n + 1


@gpufn.gpu(memory="1MiB", retries=gpufn.Retries(max_retries=1, initial_delay=0.0,
                                                on=(ValueError,)))
def always_fails(path: str) -> int:
    with open(path, "a") as f:
        f.write(f"{gpufn.context().attempt}\n")
    raise ValueError("every attempt fails")


def test_repeat_calls_that_retry_on_an_exception_are_retried(
        leasing: gpufn.Client, tmp_path: Path) -> None:
    """`Retries(on=...)` holds for repeat calls, which go under leases: each one's first
    attempt raises and the second answers, blocking and in a .map; the calls are metered
    once each; with its retries used, the call fails with its own exception."""
    before = _usage_calls(leasing, "fails_first")
    paths = iter(str(tmp_path / f"c{i}") for i in range(10_000))
    answers: list[int] = []

    def leased() -> bool:  # (earlier tests' idle leases hold the device a while)
        ch = _channel(leasing)
        direct = ch.leases.direct_calls if ch is not None else 0  # type: ignore[attr-defined]
        answers.append(fails_first.remote(next(paths)))
        return _channel(leasing).leases.direct_calls > direct  # type: ignore[attr-defined]

    wait_for(leased, timeout=30, what="a call of fails_first under a lease")
    ch = _channel(leasing)
    direct = ch.leases.direct_calls  # type: ignore[attr-defined]
    answers += [fails_first.remote(next(paths)) for _ in range(15)]
    assert ch.leases.direct_calls - direct >= 5  # type: ignore[attr-defined]

    def mapped_leased() -> bool:
        mapped = leasing.leases.direct_calls
        answers.extend(fails_first.map([next(paths) for _ in range(30)]))
        return leasing.leases.direct_calls > mapped

    # Each first attempt raises, and its retry, queued at the scheduler, ends the lease on
    # the device: how many of a map's calls a lease takes before that depends on timing
    # (5 of 30 or more on a quiet machine, 1 under the full suite's load, and once in a CI
    # run none: a map again until one did).
    wait_for(mapped_leased, timeout=60, what="a .map call of fails_first under a lease")
    assert answers == [2] * len(answers)
    wait_for(lambda: _usage_calls(leasing, "fails_first") - before == len(answers),
             timeout=30, what="each call metered once")
    for i in range(4):  # attempt 1 (leased or not), then its one retry: 2 runs, no more
        path = tmp_path / f"a{i}"
        with pytest.raises(ValueError, match="every attempt fails"):
            always_fails.remote(str(path))
        assert path.read_text().split() == ["1", "2"]
    time.sleep(0.5)
    assert _usage_calls(leasing, "fails_first") - before == len(answers)


@gpufn.gpu(memory="1MiB")
def ended_at(x: int) -> float:  # 3 ms: a lease takes about 6 in flight (DEPTH_SECONDS)
    time.sleep(0.003)
    return time.monotonic()  # (one clock for every process of a host)


def test_a_leased_calls_answer_leaves_as_it_ends_not_with_the_rest_of_its_batch(
        leasing: gpufn.Client) -> None:
    """The worker sends a batch's answers as they end (`DIRECT_FLUSH_SECONDS`), not once
    the whole batch ran: its client refills the lease meanwhile. Held to the batch's end,
    half the answers of a batch of 6 such calls arrive 6 ms or more after their call."""
    list(ended_at.map(range(20)))  # its run time is known, a lease held
    direct = leasing.leases.direct_calls
    lags = sorted(time.monotonic() - end for end in ended_at.map(range(120), order_outputs=False))
    assert leasing.leases.direct_calls - direct >= 100
    late = [lag for lag in lags if lag > 0.005]
    assert len(late) <= len(lags) // 5, f"answers late by {[round(x * 1e3, 1) for x in late]} ms"


def test_many_calls_at_once_share_a_lease_by_its_depth(leasing: gpufn.Client) -> None:
    """Many calls submitted at once through the client's I/O thread (the HTTP gateway's
    path): beyond a lease's depth they wait in the client or go to the scheduler, which
    hands them to the lease when no device takes them; all end, none waits for the
    lease's end (30 s here)."""
    from gpufn.client.leases import LEASE_DEPTH

    n = 4 * LEASE_DEPTH
    snooze.remote(0)  # its run time measured: 10 ms
    subs = [snooze._submit_message(leasing, (i,), {}) for i in range(n)]
    t0 = time.monotonic()
    futs = [leasing.submit(sub, "snooze") for sub in subs]
    results = [f.result(60) for f in futs]
    assert all(r.ok for r in results)
    assert time.monotonic() - t0 < 25  # ~3 s of calls, not held until the 30 s lease's end
    assert leasing.leases.direct_calls >= LEASE_DEPTH


def test_a_call_of_another_client_waits_only_for_the_leased_call_running(
        leasing: gpufn.Client) -> None:
    nap.remote(0.0)  # this thread holds a 30 s lease on the device's slot for nap
    stop = threading.Event()
    ran: list[int] = []

    def holder() -> None:
        while not stop.is_set():
            nap.remote(0.02)
            ran.append(1)

    t = threading.Thread(target=holder)
    t.start()
    try:
        wait_for(lambda: len(ran) >= 10, timeout=30, what="the holder calls")
        t0 = time.monotonic()
        waiter: list[float] = []
        w = threading.Thread(target=lambda: waiter.append((nap.remote(0.0), time.monotonic())[1]))
        w.start()
        w.join(25)
        assert waiter, "the other client's call did not run while a lease was held"
        assert waiter[0] - t0 < 5.0  # far below the 30 s lease: revoked at once
    finally:
        stop.set()
        t.join(30)


def _leased_pid(c: gpufn.Client, fn: Function[..., int], *args: Any) -> int:
    """Call `fn` until a call went under a lease (the earlier tests' idle leases of other
    threads, other clients, hold the device until a call of ours revokes them)."""
    pids: list[int] = []

    def leased() -> bool:
        ch = _channel(c)
        before = ch.leases.direct_calls if ch is not None else 0  # type: ignore[attr-defined]
        pids.append(fn.remote(*(args or (0.0,))))
        return _channel(c).leases.direct_calls > before  # type: ignore[attr-defined]

    wait_for(leased, timeout=30, what=f"a call of {fn.name} under a lease")
    return pids[-1]


@gpufn.gpu(memory="1MiB")
def linger(path: str, seconds: float) -> str:
    """Runs `seconds` in 10 ms steps (an interrupt lands between them) and writes how it
    ended into `path`."""
    Path(path).write_text("started")
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.01)
    except BaseException as e:
        Path(path).write_text(type(e).__name__)
        raise
    Path(path).write_text("finished")
    return path


def test_ctrl_c_stops_a_leased_call_on_its_worker_even_with_the_head_paused(
        leasing: gpufn.Client, tmp_path: Path) -> None:
    """Ctrl-C in the caller of a leased call sends its cancel to the worker directly as
    well as to the scheduler: the running call (in the executor's threads, being measured
    long) is interrupted at once, with no scheduler to relay the cancel (SIGSTOP)."""
    warm = str(tmp_path / "warm")
    linger.remote(warm, 0.02)  # measured long: never inline
    leases = _channel(leasing).leases  # type: ignore[attr-defined]
    wait_for(lambda: _under_a_lease(leases, lambda: linger.remote(warm, 0.02)), timeout=20,
             what="a lease for linger")
    direct = leases.direct_calls
    marker = tmp_path / "long"
    assert leasing.cluster is not None and leasing.cluster.scheduler is not None
    sched = leasing.cluster.scheduler.pid
    failed: list[BaseException] = []

    def ctrl_c() -> None:
        try:
            wait_for(marker.exists, timeout=20, what="the long call to start")
            os.kill(sched, signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException as e:
            failed.append(e)
            os.kill(os.getpid(), signal.SIGINT)  # the caller must not wait a minute

    # Ctrl-C raises KeyboardInterrupt whatever this process inherited (a background job
    # of a non-interactive shell, as CI may run it, starts with SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=ctrl_c)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            linger.remote(str(marker), 60)
        t.join(30)
        assert not failed, failed
        assert leases.direct_calls > direct  # it ran under the lease
        wait_for(lambda: marker.read_text() == "Cancelled", timeout=10,
                 what="the call interrupted on its worker while the head is stopped")
    finally:
        os.kill(sched, signal.SIGCONT)
        signal.signal(signal.SIGINT, previous)


@gpufn.gpu(memory="1MiB")
def tally(path: str) -> int:
    with open(path, "a") as f:
        f.write("x\n")
    return os.getpid()


def test_each_leased_call_runs_once(leasing: gpufn.Client, tmp_path: Path) -> None:
    """A short leased call runs once on its worker's own path: never again through the
    general one, never twice (its side effects counted)."""
    path = str(tmp_path / "tally")
    tally.remote(path)
    leases = _channel(leasing).leases  # type: ignore[attr-defined]
    wait_for(lambda: _under_a_lease(leases, lambda: tally.remote(path)), timeout=20,
             what="a lease for tally")
    direct = leases.direct_calls
    sent = len(Path(path).read_text().splitlines())
    for _ in range(30):
        tally.remote(path)
    assert leases.direct_calls - direct >= 25
    time.sleep(0.3)  # a second run would have written by now
    assert len(Path(path).read_text().splitlines()) - sent == 30


def test_the_scheduler_hears_nothing_per_leased_call(leasing: gpufn.Client) -> None:
    """A leased call's Result goes to its client only (the scheduler meters it from the
    lease's reports): none reaches the scheduler as a stray Result."""
    ident.remote(0)
    leases = _channel(leasing).leases  # type: ignore[attr-defined]
    wait_for(lambda: _under_a_lease(leases, lambda: ident.remote(0)), timeout=20,
             what="a lease for ident")
    stale = leasing.status()["counters"]["stale_results"]
    direct = leases.direct_calls
    assert [ident.remote(i) for i in range(50)] == list(range(50))
    assert leases.direct_calls - direct >= 45
    time.sleep(0.3)
    assert leasing.status()["counters"]["stale_results"] == stale


def test_junk_on_a_workers_direct_socket_is_skipped_and_the_worker_serves_on(
        leasing: gpufn.Client) -> None:
    import zmq

    from gpufn.client.direct import DirectSockets
    from gpufn.wire import config
    from gpufn.wire import serialization as ser

    pid = nap.remote(0.0)
    leases = _channel(leasing).leases  # type: ignore[attr-defined]
    wait_for(lambda: _under_a_lease(leases, lambda: nap.remote(0.0)), timeout=20,
             what="a lease for nap")
    endpoint = next(iter(leases._by_id.values())).grant.endpoint
    assert leasing.cluster is not None and leasing.cluster.state_dir is not None
    logs = leasing.cluster.state_dir / "logs"

    def said() -> int:  # the workers' warnings about undecodable direct messages
        return sum(f.read_text(errors="replace").count("undecodable message from a leasing")
                   for f in logs.glob("worker-*.log"))

    before = said()
    ctx: zmq.Context[Any] = zmq.Context()
    d = DirectSockets(ctx, leases)
    try:
        for junk in ([b"\xfe", b"not a message"], [b"one frame"], [b"\xff", b"\x01\x02"]):
            d.send(endpoint, junk)
        d.send(endpoint, p.encode(p.Ping(1)))
        assert d.probe_now(endpoint)  # it answers on, the same socket
    finally:
        d.close()
        ctx.destroy(linger=0)
    wait_for(lambda: said() - before == 3, timeout=10, what="each junk message said once")
    # A client gone before its call's answer: the answer is dropped, the worker serves on.
    grant = next(iter(leases._by_id.values())).grant
    ctx = zmq.Context()
    gone = ctx.socket(zmq.DEALER)
    gone.connect(config.split_address(grant.endpoint)[0])
    gone.send_multipart(p.encode(p.DirectRun(grant.lease_id, grant.secret, "gone-1",
                                             tuple(ser.dumps(((0.5,), {}))))))
    time.sleep(0.2)  # delivered and running
    gone.close(0)
    ctx.destroy(linger=0)
    time.sleep(0.5)  # its answer went nowhere
    direct = leases.direct_calls
    assert {nap.remote(0.0) for _ in range(5)} == {pid}  # the same worker process
    assert leases.direct_calls - direct >= 3


@gpufn.gpu(memory="1MiB", retries=1)
def logged_nap(path: str, seconds: float) -> int:
    """Notes each run (its worker's pid, its attempt) in `path`, then naps."""
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {gpufn.context().attempt}\n")
    time.sleep(seconds)
    return os.getpid()


def _kill_runs(path: Path, n: int) -> None:
    """Kill the worker of each of the first `n` runs `logged_nap` notes in `path`."""
    deadline, killed = time.monotonic() + 30, 0
    while killed < n and time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) > killed:
            os.kill(int(lines[killed].split()[0]), signal.SIGKILL)
            killed += 1
        time.sleep(0.01)


def test_a_worker_lost_during_a_leased_call(leasing: gpufn.Client, tmp_path: Path) -> None:
    pid = _leased_pid(leasing, nap)  # the lease
    ch = _channel(leasing)
    sent = ch.leases.direct_calls  # type: ignore[attr-defined]
    threading.Timer(0.8, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(WorkerLost, match="lost during a lease"):
        nap.remote(5.0)
    assert ch.leases.direct_calls == sent + 1  # type: ignore[attr-defined]
    # With retries, the call runs again (through the scheduler) on the next worker, as
    # its second attempt: the leased one counts against its retries.
    pid = _leased_pid(leasing, nap_retried)
    sent = ch.leases.direct_calls  # type: ignore[attr-defined]
    threading.Timer(0.8, os.kill, (pid, signal.SIGKILL)).start()
    again = nap_retried.remote(2.0)
    assert again != pid and ch.leases.direct_calls == sent + 1  # type: ignore[attr-defined]
    for kills in (1, 2):  # lost under the lease, then (2) its scheduled retry too
        pid = _leased_pid(leasing, logged_nap, "", 0.0)
        runs = tmp_path / f"runs{kills}"
        killer = threading.Thread(target=_kill_runs, args=(runs, kills))
        killer.start()
        if kills == 1:
            assert logged_nap.remote(str(runs), 1.0) != pid
        else:  # its one retry used: no third run
            with pytest.raises(WorkerLost, match=r"after 2 attempt\(s\)"):
                logged_nap.remote(str(runs), 5.0)
        killer.join(30)
        lines = [line.split() for line in runs.read_text().splitlines()]
        assert lines[0][0] == str(pid)  # the first run was the leased one
        assert [attempt for _, attempt in lines] == ["1", "2"]


def test_a_client_that_cannot_reach_the_worker_falls_back_and_says_so_once(
        leasing: gpufn.Client, caplog: pytest.LogCaptureFixture) -> None:
    ident.remote(0)
    ch = _channel(leasing)
    unreachable = p.LeaseGrant("lease:nowhere", "f", "tcp://10.255.255.1:9", "s", 30.0, 10, 0)
    with caplog.at_level(logging.WARNING, logger="gpufn.client"):
        ch._granted(unreachable)  # type: ignore[attr-defined]
        ch._granted(unreachable)  # type: ignore[attr-defined]
        assert [ident.remote(i) for i in range(20)] == list(range(20))
    assert len([r for r in caplog.records if "cannot reach the worker" in r.message]) == 1
    assert not ch.leases.on  # type: ignore[attr-defined]


@gpufn.gpu(memory="1MiB")
def noted(log: str, i: int) -> int:
    with open(log, "a") as f:
        f.write(f"{i} {gpufn.context().attempt}\n")
    time.sleep(0.01)
    return i


@contextmanager
def _own_head(tmp_path: Path, **env: str) -> Iterator[tuple[Head, gpufn.Client]]:
    """A `gpufn serve` of one device and 30 s leases, its client; stopped after."""
    shutdown_default()
    head = Head(tmp_path / "head", devices=1, GPUFN_LEASE_SECONDS="30", **env)
    try:
        head.start()
        c = gpufn.connect(head.address, token=TOKEN)
        wait_ready(c)
        yield head, c
        head.shutdown()
    finally:
        client_mod._shutdown_default()
        head.close()


@gpufn.gpu(memory="1MiB", timeout=1.5)
def bounded(path: str, seconds: float, native: bool = False) -> int:
    """Runs `seconds` in 10 ms steps (an interrupt lands between them), or `native`ly in one
    sleep (no interrupt lands in it); writes how it ended into `path`."""
    if native:
        time.sleep(seconds)
        return os.getpid()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.01)
    except BaseException as e:
        Path(path).write_text(type(e).__name__)
        raise
    return os.getpid()


def test_a_leased_call_past_its_timeout_fails_with_timeout(tmp_path: Path) -> None:
    """A function with a timeout goes under leases. A leased call past it is interrupted
    on its worker (which serves on); one that does not stop within the grace (here 1 s)
    fails with Timeout too, and its worker is restarted. Both are counted as timeouts."""
    with _own_head(tmp_path, GPUFN_STOP_GRACE_SECONDS="1") as (_, c):
        pid = _leased_pid(c, bounded, "", 0.0)
        leases = _channel(c).leases  # type: ignore[attr-defined]
        direct = leases.direct_calls
        ended = tmp_path / "ended"
        t0 = time.monotonic()
        with pytest.raises(gpufn.Timeout, match=r"longer than its timeout of 1.5s on .*"
                                                "it was interrupted"):
            bounded.remote(str(ended), 8.0)
        assert 1.4 < time.monotonic() - t0 < 5.0  # stopped at its timeout, not its end
        assert leases.direct_calls > direct  # it ran under the lease
        assert ended.read_text() == "Timeout"
        assert bounded.remote("", 0.0) == pid  # the same worker serves on

        t0 = time.monotonic()
        with pytest.raises(gpufn.Timeout, match=r"did not stop within 1s of being "
                                                "interrupted; its worker was restarted"):
            bounded.remote("", 30.0, True)
        assert time.monotonic() - t0 < 10.0
        wait_for(lambda: bounded.remote("", 0.0) != pid, timeout=60,
                 what="a new worker, the stuck one killed")
        wait_for(lambda: c.status()["counters"]["timeouts"] == 2, timeout=30,
                 what="both timeouts counted")


def test_a_head_restart_during_a_lease_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """`.remote()` in a loop under a 30 s lease while the scheduler is SIGKILLed (serve
    starts another): every call returns its value, none runs twice, and the calls the
    lease ran are metered by the next scheduler."""
    log = tmp_path / "runs.log"
    with _own_head(tmp_path) as (head, c):
        out: list[int] = []
        errors: list[BaseException] = []
        channels: list[object] = []

        def loop() -> None:
            try:
                for i in range(300):
                    out.append(noted.remote(str(log), i))
                channels.append(_channel(c))
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=loop)
        t.start()
        wait_for(lambda: len(out) >= 100, timeout=60, what="calls under the lease")
        head.kill_scheduler(signal.SIGKILL)
        t.join(120)
        assert not t.is_alive() and not errors, errors
        assert out == list(range(300))
        runs = [ln.split() for ln in log.read_text().splitlines()]
        assert sorted(int(i) for i, _ in runs) == list(range(300))  # each ran exactly once
        assert channels[0].leases.direct_calls > 200  # type: ignore[attr-defined]
        # The next scheduler meters what the lease ran once it ends (revoked here).
        threading.Thread(target=lambda: nap.remote(0.0)).start()
        wait_for(lambda: _usage_calls(c, "noted") >= 100, timeout=60,
                 what="the leased calls metered after the restart")


def test_a_lease_whose_worker_died_while_the_head_was_down_is_given_up(
        tmp_path: Path) -> None:
    """The scheduler is paused, the leased worker killed, then the scheduler killed (serve
    starts another, which never knew the lease): the next call under that lease went to
    the dead worker and waited forever. Now a probe of the worker, sent once the next
    scheduler forgot us, goes unanswered: the lease is over and the call runs again (its
    attempt under the dead lease counted), then the calls after it go on."""
    runs = tmp_path / "runs"
    with _own_head(tmp_path) as (head, c):
        pid = _leased_pid(c, logged_nap, "", 0.0)
        sched = head.scheduler()
        os.kill(sched, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        head.kill_scheduler(signal.SIGKILL)
        started = time.monotonic()
        assert logged_nap.remote(str(runs), 0.0) != pid
        assert time.monotonic() - started < 60
        assert [line.split()[1] for line in runs.read_text().splitlines()] == ["2"]
        assert logged_nap.remote("", 0.0) != pid
