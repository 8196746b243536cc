"""The result cache's store, keys and single flight, without a cluster (fake submits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from gpufn.api import cache as cachemod
from gpufn.api.cache import ResultCache, Store, code_digest
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser


def _result(value: object) -> p.Result:
    return p.Result("inv", True, "", "", p.ResultMeta(), tuple(ser.dumps(value)))


def test_code_digest_follows_the_code_not_its_position() -> None:
    src = "def f(x):\n    return x + {c}\n"
    a, b, c = {}, {}, {}
    exec(compile(src.format(c=1), "one.py", "exec"), a)
    exec(compile("\n\n\n" + src.format(c=1), "two.py", "exec"), b)
    exec(compile(src.format(c=2), "one.py", "exec"), c)
    assert code_digest(a["f"]) == code_digest(b["f"])
    assert code_digest(a["f"]) != code_digest(c["f"])
    assert code_digest(a["f"], ["autocast=bf16"]) != code_digest(a["f"])


def test_store_round_trip_and_claims(tmp_path: Path) -> None:
    s = Store(tmp_path)
    assert s.read("ab" * 16) is None
    assert s.claim("ab" * 16)
    assert not Store(tmp_path).claim("ab" * 16)  # held by a live owner (this process)
    s.write("ab" * 16, [b"head", memoryview(b"x" * 100_000)])
    assert s.read("ab" * 16) == [b"head", b"x" * 100_000]
    s.release("ab" * 16)
    assert not (tmp_path / "ab" / ("ab" * 16 + ".claim")).exists()
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_dead_owners_claim_is_broken(tmp_path: Path) -> None:
    key = "cd" * 16
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / "cd").mkdir()
    claim = tmp_path / "cd" / f"{key}.claim"
    claim.write_text(json.dumps({"host": cachemod._HOST, "pid": int(dead.stdout), "token": "t"}))
    assert Store(tmp_path).claim(key)  # the owner's pid is gone: taken over at once


def test_another_hosts_claim_is_broken_after_its_lease(tmp_path: Path) -> None:
    key = "ef" * 16
    (tmp_path / "ef").mkdir()
    claim = tmp_path / "ef" / f"{key}.claim"
    claim.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "t"}))
    assert not Store(tmp_path).claim(key)  # touched just now: alive
    old = time.time() - cachemod.LEASE_S - 1
    os.utime(claim, (old, old))
    assert Store(tmp_path).claim(key)


def test_identical_calls_compute_once(tmp_path: Path) -> None:
    """Two caches on one directory (as two processes would be): the second waits for the
    first's result instead of submitting; a third caller later reads it from the store."""
    submits: list[Future[p.Result]] = []

    def submit() -> tuple[str, Future[p.Result]]:
        fut: Future[p.Result] = Future()
        submits.append(fut)
        return "inv-1", fut

    a, b = ResultCache(tmp_path, "code"), ResultCache(tmp_path, "code")
    b.store = Store(tmp_path)  # its own claim book, like another process
    frames = ser.dumps(((3,), {}))
    _, fa = a.call(frames, submit)
    _, fb = b.call(frames, submit)
    _, fa2 = a.call(frames, submit)  # in-process duplicate: follows the first
    assert len(submits) == 1 and not fb.done()
    submits[0].set_result(_result(9))
    for f in (fa, fb, fa2):
        assert ser.loads(f.result(timeout=10).frames) == 9
    assert (a.stats.computed, b.stats.computed, b.stats.waited) == (1, 0, 1)
    c = ResultCache(tmp_path, "code")
    _, fc = c.call(frames, submit)
    assert fc.done() and c.stats.hits == 1 and len(submits) == 1


def test_a_failed_call_is_not_cached_and_a_waiter_computes(tmp_path: Path) -> None:
    submits: list[Future[p.Result]] = []

    def submit() -> tuple[str, Future[p.Result]]:
        fut: Future[p.Result] = Future()
        submits.append(fut)
        return f"inv-{len(submits)}", fut

    a, b = ResultCache(tmp_path, "code"), ResultCache(tmp_path, "code")
    b.store = Store(tmp_path)
    frames = ser.dumps(((4,), {}))
    _, fa = a.call(frames, submit)
    _, fb = b.call(frames, submit)
    submits[0].set_result(p.Result("inv-1", False, "WorkerLost", "lost"))
    assert not fa.result(timeout=10).ok
    deadline = time.monotonic() + 10
    while len(submits) < 2 and time.monotonic() < deadline:
        threading.Event().wait(0.01)  # b's watcher claims the released key and submits
    assert len(submits) == 2
    submits[1].set_result(_result(16))
    assert ser.loads(fb.result(timeout=10).frames) == 16


@pytest.mark.parametrize("value", [True, "/tmp/x", False])
def test_spec_cache_option(value: object) -> None:
    from gpufn.wire.spec import make_spec

    spec = make_spec(cache=value)
    assert bool(spec.cache) == bool(value)


def test_a_claim_of_a_live_unrelated_pid_on_this_host_is_broken_after_its_lease(
        tmp_path: Path) -> None:
    """Pid reuse (or two containers with one host name): the claim names a pid that runs
    here but is not its owner, so nobody touches it; its lease still expires."""
    key = "fa" * 16
    (tmp_path / "fa").mkdir()
    claim = tmp_path / "fa" / f"{key}.claim"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim.write_text(json.dumps({"host": cachemod._HOST, "pid": stranger.pid, "token": "t"}))
        assert not Store(tmp_path).claim(key)  # touched just now: its owner may be alive
        assert Store(tmp_path).claimed(key)
        old = time.time() - cachemod.LEASE_S - 1
        os.utime(claim, (old, old))
        assert not Store(tmp_path).claimed(key)  # expired although the pid runs: broken
        assert Store(tmp_path).claim(key)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_waiter_behind_an_expired_same_host_claim_computes(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The waiter's own loop breaks the expired claim: it does not wait forever."""
    monkeypatch.setattr(cachemod, "LEASE_S", 0.5)
    key_cache = ResultCache(tmp_path, "code-lease")
    key_cache.store = Store(tmp_path)
    frames = ser.dumps(((5,), {}))
    key = key_cache.key(frames)
    (tmp_path / key[:2]).mkdir(exist_ok=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    submits: list[Future[p.Result]] = []

    def submit() -> tuple[str, Future[p.Result]]:
        fut: Future[p.Result] = Future()
        submits.append(fut)
        return "inv-1", fut

    try:
        (tmp_path / key[:2] / f"{key}.claim").write_text(
            json.dumps({"host": cachemod._HOST, "pid": stranger.pid, "token": "t"}))
        _, fut = key_cache.call(frames, submit)
        deadline = time.monotonic() + 10
        while not submits and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        assert len(submits) == 1, "the waiter never took over the expired claim"
        submits[0].set_result(_result(25))
        assert ser.loads(fut.result(timeout=10).frames) == 25
    finally:
        stranger.kill()
        stranger.wait()


def test_a_waiter_that_wins_the_claim_after_the_result_was_stored_reads_it() -> None:
    """The waiter looked for the result just before its owner stored it and let its claim
    go; then it found the claim free and took it: it reads the result again before it
    computes (it computed a second time, and in a test whose submit never answers, hung)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        owner, waiter = Store(Path(tmp)), ResultCache(tmp, "code")
        waiter.store = Store(Path(tmp))
        frames = ser.dumps(((3,), {}))
        key = waiter.key(frames)
        assert owner.claim(key)
        submits: list[int] = []

        def submit() -> tuple[str, Future[p.Result]]:
            submits.append(1)
            return "inv-2", Future()

        real, reads = waiter.store.read, []

        def read(k: str) -> list[bytes] | None:
            reads.append(k)
            if len(reads) == 2:  # the watch's first look: the owner finishes right after it
                owner.write(k, _result(9).frames)
                owner.release(k)
                return None
            return real(k)

        waiter.store.read = read  # type: ignore[method-assign]
        _, fut = waiter.call(frames, submit)
        assert ser.loads(fut.result(timeout=10).frames) == 9
        assert submits == [] and waiter.stats.computed == 0
