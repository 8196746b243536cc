"""Rules of the last release held by their pure pieces, without a cluster: result-cache
claims between hosts, a streamed value over the payload limit, and an allow-list on
loopback. Each test fails under a one-line mutation listed in scripts/mutate.py."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from gpufn.api import cache as cachemod
from gpufn.api.cache import ResultCache, Store
from gpufn.exceptions import PayloadTooLarge
from gpufn.net import curve
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- the result cache


class _Submits:
    """A fake submit: each call is a future the test completes."""

    def __init__(self) -> None:
        self.futures: list[Future[p.Result]] = []

    def __call__(self) -> tuple[str, Future[p.Result]]:
        fut: Future[p.Result] = Future()
        self.futures.append(fut)
        return f"inv-{len(self.futures)}", fut


def _ok(value: object) -> p.Result:
    return p.Result("inv", True, "", "", p.ResultMeta(), tuple(ser.dumps(value)))


def _on_host(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """What follows runs as a process on `host` (claims name it; others' are judged by lease)."""
    monkeypatch.setattr(cachemod, "_HOST", host)


def _cache(root: Path) -> ResultCache:
    c = ResultCache(root, "code")
    c.store = Store(root)  # its own claim book, as in another process
    return c


def test_an_owner_whose_claim_was_taken_over_leaves_the_new_owners_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cachemod, "LEASE_S", 2.0)
    frames = ser.dumps(((5,), {}))
    key = _cache(tmp_path).key(frames)
    _on_host(monkeypatch, "host-a")
    a = Store(tmp_path)
    assert a.claim(key)
    old = time.time() - 10  # host a stalled: its claim was not touched for 5 leases
    os.utime(a._path(key, ".claim"), (old, old))
    _on_host(monkeypatch, "host-b")
    b = Store(tmp_path)
    assert b.claim(key), "a claim untouched for longer than the lease was not broken"
    a.release(key)  # host a's call finally ends (failed: nothing stored)
    _on_host(monkeypatch, "host-c")
    third = _cache(tmp_path)
    submits = _Submits()
    _, fut = third.call(frames, submits)
    time.sleep(0.3)  # its watcher polls meanwhile
    assert not submits.futures, "a third caller computed a key the new owner holds"
    b.write(key, ser.dumps(25))
    b.release(key)
    assert ser.loads(fut.result(timeout=10).frames) == 25
    assert not submits.futures and third.stats.waited == 1


def test_an_owner_computing_past_the_lease_keeps_its_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lease = 0.4
    monkeypatch.setattr(cachemod, "LEASE_S", lease)
    monkeypatch.setattr(cachemod, "TOUCH_S", lease / 4)
    frames = ser.dumps(((6,), {}))
    _on_host(monkeypatch, "host-a")
    owner, owner_submits = _cache(tmp_path), _Submits()
    _, owned = owner.call(frames, owner_submits)
    assert len(owner_submits.futures) == 1  # it computes
    _on_host(monkeypatch, "host-b")
    other, other_submits = _cache(tmp_path), _Submits()
    _, waiting = other.call(frames, other_submits)
    time.sleep(4 * lease)  # the call runs four leases long
    assert not other_submits.futures, "a caller on another host broke a live owner's claim"
    owner_submits.futures[0].set_result(_ok(36))
    assert ser.loads(owned.result(timeout=10).frames) == 36
    assert ser.loads(waiting.result(timeout=10).frames) == 36
    assert not other_submits.futures and other.stats.waited == 1


# --------------------------------------------------------------------------- streaming


def test_a_yielded_value_over_the_limit_ends_the_stream_naming_the_function(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufn.runtime.context import CallContext
    from gpufn.worker.executor import Call
    from gpufn.worker.streaming import Driver

    monkeypatch.setenv("GPUFN_MAX_PAYLOAD", "64KiB")
    sent: list[p.Message] = []
    after: list[str] = []

    def gen() -> Any:
        yield b"a" * 100
        yield b"b" * 100
        yield b"c" * 2**20  # over the limit
        after.append("ran on")
        yield b"d"

    call = Call("inv1", "tokens", lambda: None, (), CallContext("inv1", "tokens"),
                dispatch_token=3)
    with pytest.raises(PayloadTooLarge, match="a value yielded by tokens"):
        Driver(sent.append).drive(call, gen())
    assert [m.seq for m in sent] == [0, 1]  # type: ignore[attr-defined]
    assert all(isinstance(m, p.Item) and ser.payload_bytes(m.frames) < 2**16 for m in sent)
    assert not after and call.meta["items"] == 2


# --------------------------------------------------------------------------- the allow-list


def test_an_allow_list_on_loopback_encrypts_or_refuses(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFN_CURVE", raising=False)
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    curve.server_keys(keys, create=True)
    assert curve.ServerSecurity.for_bind("127.0.0.1", False, keys, None) is None  # token only
    sec = curve.ServerSecurity.for_bind("127.0.0.1", False, keys, allowed)
    assert sec is not None and sec.allow_keys == allowed, "the allow-list was dropped"
    with pytest.raises(curve.SecurityError, match="--allow-keys needs CURVE"):
        curve.ServerSecurity.for_bind("127.0.0.1", False, None, allowed)
    with pytest.raises(curve.SecurityError):
        curve.ServerSecurity.for_bind("127.0.0.1", True, keys, allowed)  # a Unix socket


def test_the_allow_list_admits_only_its_keys_and_this_hosts_own(tmp_path: Path) -> None:
    import zmq

    mine = tmp_path / "mine"
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    friend, _ = curve.ensure_keypair(mine, "friend")
    stranger, _ = curve.ensure_keypair(mine, "stranger")
    (allowed / "friend.key").write_bytes(friend.read_bytes())
    own = b"x" * 40
    folder = curve._KeyFolder(allowed, {own})
    ok = zmq.auth.load_certificate(str(friend))[0]
    bad = zmq.auth.load_certificate(str(stranger))[0]
    assert folder.callback("*", ok) and folder.callback("*", own)
    assert not folder.callback("*", bad)
    (allowed / "stranger.key").write_bytes(stranger.read_bytes())  # re-read on change
    os.utime(allowed, (time.time() + 5, time.time() + 5))
    assert folder.callback("*", bad)


# --------------------------------------------------------------------------- beyond the list:
# the result cache


def test_a_result_stored_between_the_lookup_and_the_claim_is_a_hit(tmp_path: Path) -> None:
    frames = ser.dumps(((7,), {}))
    other = Store(tmp_path)  # another host, finishing the same call just then

    class Racing(Store):
        raced = False

        def read(self, key: str) -> list[bytes] | None:
            got = super().read(key)
            if got is None and not self.raced:  # the lookup missed; the other one stores now
                self.raced = True
                other.write(key, ser.dumps(49))
            return got

    c = ResultCache(tmp_path, "code")
    c.store = Racing(tmp_path)
    submits = _Submits()
    _, fut = c.call(frames, submits)
    assert ser.loads(fut.result(timeout=5).frames) == 49
    assert not submits.futures and c.stats.hits == 1


def test_a_submit_that_raises_releases_its_claim(tmp_path: Path) -> None:
    frames = ser.dumps(((8,), {}))

    def refused() -> tuple[str, Future[p.Result]]:
        raise PayloadTooLarge("too big")

    a = _cache(tmp_path)
    with pytest.raises(PayloadTooLarge):
        a.call(frames, refused)
    b, submits = _cache(tmp_path), _Submits()
    b.call(frames, submits)
    assert len(submits.futures) == 1, "the failed submit's claim kept another caller waiting"


def test_a_call_that_ends_in_an_exception_releases_its_claim(tmp_path: Path) -> None:
    from gpufn.exceptions import ConnectionLost

    frames = ser.dumps(((9,), {}))
    a, a_submits = _cache(tmp_path), _Submits()
    _, fa = a.call(frames, a_submits)
    b, b_submits = _cache(tmp_path), _Submits()
    b.call(frames, b_submits)
    assert not b_submits.futures  # waits for a
    a_submits.futures[0].set_exception(ConnectionLost("the scheduler went away"))
    assert isinstance(fa.exception(timeout=5), ConnectionLost)
    deadline = time.monotonic() + 10
    while not b_submits.futures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(b_submits.futures) == 1, "a waiter never computed after the owner's call failed"


def _digest_of(src: str, name: str = "f") -> str:
    from gpufn.api.cache import code_digest

    ns: dict[str, Any] = {}
    exec(compile(src, "m.py", "exec"), ns)
    return code_digest(ns[name])


def test_the_code_key_follows_operators_defaults_and_closure_values() -> None:
    assert _digest_of("def f(x):\n    return x + 1\n") != _digest_of("def f(x):\n    return x - 1\n")
    assert _digest_of("def f(x, k=1):\n    return x + k\n") != \
        _digest_of("def f(x, k=2):\n    return x + k\n")
    closure = "def make(k):\n    def f(x):\n        return x + k\n    return f\nf = make({})\n"
    assert _digest_of(closure.format(1)) != _digest_of(closure.format(2))
    assert _digest_of(closure.format(1)) == _digest_of(closure.format(1))


def test_a_result_file_that_is_not_ours_is_a_miss(tmp_path: Path) -> None:
    s = Store(tmp_path)
    key = "ab" * 16
    s.write(key, [b"x"])
    s._path(key, ".result").write_bytes(b"\x05\x00\x00\x00 not a gpufn result")
    assert s.read(key) is None


# --------------------------------------------------------------------------- streams


def _driven(gen: Any, token: int = 7) -> tuple[Any, list[p.Message], Any, Any]:
    from gpufn.runtime.context import CallContext
    from gpufn.worker.executor import Call
    from gpufn.worker.streaming import Driver

    sent: list[p.Message] = []
    driver = Driver(sent.append)
    call = Call("inv1", "gen", lambda: None, (), CallContext("inv1", "gen"), dispatch_token=token)
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(driver.drive(call, gen))
        except BaseException as e:
            out.append(e)

    import threading

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return driver, sent, t, out


def _count() -> Any:
    yield from range(1000)


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_late_smaller_credit_never_shrinks_the_window() -> None:
    driver, sent, t, _ = _driven(_count())
    _until(lambda: len(sent) == p.STREAM_WINDOW)
    more = p.STREAM_WINDOW + 24
    driver.grant("inv1", 7, more)
    driver.grant("inv1", 7, p.STREAM_WINDOW + 4)  # an older Credit arriving late
    _until(lambda: len(sent) >= more)
    time.sleep(0.2)
    assert len(sent) == more
    assert driver.interrupt("inv1", 7)
    t.join(10)


def test_a_cancel_for_another_dispatch_does_not_stop_a_stream() -> None:
    driver, sent, t, out = _driven(_count())
    _until(lambda: len(sent) == p.STREAM_WINDOW)
    assert not driver.interrupt("inv1", 99)  # a cancel meant for an earlier run
    driver.grant("inv1", 7, p.STREAM_WINDOW + 3)
    _until(lambda: len(sent) == p.STREAM_WINDOW + 3)
    assert len(sent) == p.STREAM_WINDOW + 3 and not out
    assert driver.interrupt("inv1", 7)
    t.join(10)


def test_a_consumer_credits_what_it_read_plus_the_window() -> None:
    from gpufn.api.calls import CallStream
    from gpufn.client.items import ItemQueue

    credits: list[int] = []

    class Client:
        def credit(self, invocation_id: str, allowed: int) -> None:
            credits.append(allowed)

    class Call:
        id, _name, _client = "inv1", "gen", Client()

    items = ItemQueue()
    n = 3 * p.STREAM_WINDOW
    for i in range(n):
        items.put(p.Item("inv1", 1, i, frames=tuple(ser.dumps(i))))
    stream: CallStream[int] = CallStream(Call(), items)  # type: ignore[arg-type]
    assert [next(stream) for _ in range(n)] == list(range(n))
    assert credits and credits[-1] == n + p.STREAM_WINDOW
    assert credits == sorted(credits)


# --------------------------------------------------------------------------- keys


def test_an_allow_list_admits_this_hosts_own_peers_by_their_local_key(tmp_path: Path) -> None:
    import zmq

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    curve.server_keys(keys, create=True)
    public, _ = curve.ensure_keypair(keys, curve.LOCAL_KEY_NAME)
    sec = curve.ServerSecurity.for_bind("127.0.0.1", False, keys, allowed)
    assert sec is not None
    assert zmq.auth.load_certificate(str(public))[0] in sec.extra_allowed


def test_a_secret_key_left_readable_is_made_private_when_the_pair_is_remade(
        tmp_path: Path) -> None:
    import stat

    d = tmp_path / "keys"
    d.mkdir()
    secret = d / "server.key_secret"
    secret.write_text("left over\n")
    os.chmod(secret, 0o644)  # its public half is missing: the pair is made again
    curve.ensure_keypair(d, "server")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


# --------------------------------------------------------------------------- usage


def test_the_usage_meter_forgets_what_is_older_than_its_retention() -> None:
    from gpufn.scheduler.books.usage import BUCKET_S, Key, UsageMeter

    m = UsageMeter(retention=2 * BUCKET_S)
    k = Key("", "f", 0, "")
    m.record_devices(k, 0.0, 10.0, 1)
    m.record_devices(k, 10 * BUCKET_S, 10 * BUCKET_S + 5.0, 1)
    [row] = m.report(10 * BUCKET_S + 5.0)
    assert row["device_seconds"] == pytest.approx(5.0)


# --------------------------------------------------------------------------- the supervisor


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self.killed = pid, None, False

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.killed = True


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    from gpufn.memory_pool.probe import simulated_devices
    from gpufn.worker.supervisor.daemon import Supervisor

    monkeypatch.setenv("GPUFN_LOG_DIR", str(tmp_path))
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    s = Supervisor("tcp://127.0.0.1:9", "", simulated_devices("n", 1, 2**30), "n")
    s.sent = []
    s._send = s.sent.append
    pids = iter(range(100, 200))

    def spawn(slot: Any) -> None:
        slot.incarnation += 1
        slot.proc = _Proc(next(pids))

    s._spawn = spawn
    s.slot = next(iter(s.slots.values()))
    spawn(s.slot)
    yield s
    s.conn.close()
    s.ctx.term()


def test_workers_get_the_interface_that_reaches_the_scheduler(supervisor: Any) -> None:
    env = supervisor._env(supervisor.slot.device)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == supervisor.net_env[
        "GLOO_SOCKET_IFNAME"]


def test_failures_to_start_back_off_more_each_time(supervisor: Any) -> None:
    now, waits = 10.0, []
    for _ in range(3):
        supervisor.slot.proc.returncode = 1
        supervisor._reap(now)
        waits.append(supervisor.slot.restart_at - now)
        now = supervisor.slot.restart_at
        supervisor._reap(now)  # restarted
    assert waits[0] > 0 and waits == sorted(waits) and waits[2] > waits[0], waits


def test_a_kill_order_for_an_older_process_spares_its_successor(supervisor: Any) -> None:
    slot = supervisor.slot
    old = slot.proc.pid
    slot.proc.returncode = -9
    supervisor._reap(10.0)
    supervisor._reap(slot.restart_at)  # restarted
    supervisor._kill(p.KillWorker(slot.device.key, old, "unreachable"))
    assert not slot.proc.killed
    supervisor._kill(p.KillWorker(slot.device.key, slot.proc.pid, "timeout"))
    assert slot.proc.killed


def test_a_serving_notice_for_an_older_process_is_not_applied(supervisor: Any) -> None:
    slot = supervisor.slot
    old = slot.proc.pid
    slot.proc.returncode = -9
    supervisor._reap(10.0)
    supervisor._reap(slot.restart_at)  # restarted
    supervisor._serving(p.WorkerServing(slot.device.key, old, 1))  # late, about the old one
    assert not slot.served
