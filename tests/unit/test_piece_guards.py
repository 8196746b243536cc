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
