"""Spawned calls of deployed functions outlive their spawner: the core keeps them running
when their client leaves and keeps their Results (on disk, bounded, retained), read back
by the same user only; calls of functions defined in the caller's process are cancelled
with it. The book itself: sqlite in the state directory, owner-only, chunked frames."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gpufn.scheduler.books.users import UserStore
from gpufn.scheduler.nouns.states import InvState
from gpufn.scheduler.stores import kept_results as kr
from gpufn.scheduler.stores.kept_results import KeptResult, KeptResults
from gpufn.wire import protocol as p

from .core_harness import Harness
from .test_deployments import deploy


def _result(inv: str, payload: bytes = b"value") -> p.Result:
    return p.Result(inv, True, "", "", p.ResultMeta(duration=1.5), (b"head", payload))


TOKENS: dict[str, str] = {}


def _harness(tmp_path: Path | None = None, **cfg: object) -> tuple[Harness, bytes, str]:
    """One worker, the app "evals" deployed, users alice and mallory besides the admin;
    returns (harness, worker, alias of f)."""
    store = UserStore()
    TOKENS.update({name: store.create(name, 0.0)[1] for name in ("alice", "mallory")})
    h = Harness(devices=1, state_dir=str(tmp_path) if tmp_path else "", users=store, **cfg)
    w = h.start_worker(0)
    assert deploy(h, "evals", "c1").ok
    return h, w, p.app_alias("evals", "f")


def _client(h: Harness, peer: bytes, user: str = "") -> None:
    """A client with `user`'s token (the admin's without one): the token says who it is."""
    welcome = h.hello(peer, p.Role.CLIENT, token=TOKENS[user] if user else h.core.config.token or "")
    assert isinstance(welcome, p.Welcome) and welcome.ok, welcome


def test_a_spawned_call_of_a_deployed_function_outlives_its_spawner() -> None:
    h, w, alias = _harness()
    running = h.submit(alias, keep=True)
    queued = h.submit(alias, keep=True)  # concurrency 1: it waits
    h.feed(b"cli", p.Goodbye("notebook closed"))
    inv = h.core.invocations[running]
    assert inv.state is InvState.RUNNING and h.core.invocations[queued].state is InvState.QUEUED
    assert not [s for s in h.of_type(p.Cancel) if s.msg.invocation_id == running]
    h.finish(w, running)
    assert h.core.invocations[queued].state is InvState.RUNNING  # it runs in its turn
    h.finish(w, queued)
    _client(h, b"later")
    h.feed(b"later", p.Attach(running))
    [res] = [s.msg for s in h.sent if s.peer == b"later" and isinstance(s.msg, p.Result)]
    assert res.ok and res.frames == (b"value",) and res.invocation_id == running


def test_a_call_of_a_function_of_the_callers_process_is_cancelled_with_it() -> None:
    h, _w, alias = _harness()
    adhoc = h.register("mine")
    spawned = h.submit(adhoc, keep=True)
    not_spawned = h.submit(alias)  # .remote()/.map() of a deployed function: keep=False
    h.feed(b"cli", p.Goodbye("exit"))
    assert spawned not in h.core.invocations and not_spawned not in h.core.invocations
    assert h.core.counters.cancelled == 2


def test_a_client_that_times_out_leaves_its_deployed_calls_running() -> None:
    h, w, alias = _harness(client_timeout=5.0)
    inv = h.submit(alias, keep=True)
    h.tick(10.0)  # silent: forgotten
    assert b"cli" not in h.core.peers and h.core.invocations[inv].state is InvState.RUNNING
    h.finish(w, inv)
    assert inv in h.core.streams.results


def test_only_the_same_user_reads_or_cancels_it() -> None:
    h, w, alias = _harness()
    _client(h, b"alice", "alice")
    inv = h.submit(alias, client=b"alice", keep=True)
    h.feed(b"alice", p.Goodbye("closed"))
    _client(h, b"mallory", "mallory")
    h.feed(b"mallory", p.Cancel(inv, "mine now"))
    assert h.core.invocations[inv].state is InvState.RUNNING  # not hers to cancel
    h.feed(b"mallory", p.Attach(inv))
    [refused] = [s.msg for s in h.sent if s.peer == b"mallory" and isinstance(s.msg, p.Result)]
    assert not refused.ok and "of yours" in refused.message
    h.finish(w, inv)
    h.feed(b"mallory", p.Attach(inv))
    assert [s.msg.ok for s in h.sent if s.peer == b"mallory" and isinstance(s.msg, p.Result)] \
        == [False, False]
    h.feed(b"mallory", p.Submit(inv, alias, {}, True, (b"args",)))  # her own "resubmit"
    assert len(h.runs()) == 1  # never run under another user's id
    _client(h, b"alice2", "alice")
    h.feed(b"alice2", p.Attach(inv))
    [mine] = [s.msg for s in h.sent if s.peer == b"alice2" and isinstance(s.msg, p.Result)]
    assert mine.ok and mine.frames == (b"value",)


def test_its_owner_may_cancel_it_from_another_connection() -> None:
    h, _w, alias = _harness()
    _client(h, b"alice", "alice")
    inv = h.submit(alias, client=b"alice", keep=True)
    h.feed(b"alice", p.Goodbye("closed"))
    _client(h, b"alice2", "alice")
    h.feed(b"alice2", p.Attach(inv))
    h.feed(b"alice2", p.Cancel(inv, "not needed any more", True))
    assert inv not in h.core.invocations
    [res] = [s.msg for s in h.sent if s.peer == b"alice2" and isinstance(s.msg, p.Result)]
    assert res.error_kind == "Cancelled"


def test_a_resubmitted_call_that_ended_is_answered_not_run_again() -> None:
    h, w, alias = _harness()
    inv = h.submit(alias, keep=True)
    h.finish(w, inv)
    before = len(h.runs())
    h.feed(b"cli", p.Submit(inv, alias, {}, True, (b"args",)))  # sent again after a re-hello
    assert len(h.runs()) == before
    assert [s.msg.ok for s in h.sent if isinstance(s.msg, p.Result) and s.peer == b"cli"
            and s.msg.invocation_id == inv] == [True, True]


def test_kept_results_survive_a_new_scheduler(tmp_path: Path) -> None:
    h, w, alias = _harness(tmp_path)
    inv = h.submit(alias, keep=True)
    h.finish(w, inv)
    h.core.streams.close()  # the shell's close: queued writes reach the disk
    again = Harness(devices=1, state_dir=str(tmp_path))  # the book as the shell makes it
    again.feed(b"cli", p.Attach(inv))
    [res] = [s.msg for s in again.sent if isinstance(s.msg, p.Result)]
    assert res.ok and res.frames == (b"value",) and res.meta.attempts == 1
    again.core.streams.close()


def test_after_a_restart_a_user_reads_their_own_kept_result_and_no_one_else_does(
        tmp_path: Path) -> None:
    h, w, alias = _harness(tmp_path)
    _client(h, b"alice", "alice")
    inv = h.submit(alias, client=b"alice", keep=True)
    h.finish(w, inv)
    h.core.streams.close()
    again = Harness(devices=1, state_dir=str(tmp_path), users=h.core.users.store)
    _client(again, b"mallory", "mallory")
    again.feed(b"mallory", p.Attach(inv))
    [theirs] = [s.msg for s in again.sent if s.peer == b"mallory" and isinstance(s.msg, p.Result)]
    assert not theirs.ok
    _client(again, b"alice2", "alice")
    again.feed(b"alice2", p.Attach(inv))
    [mine] = [s.msg for s in again.sent if s.peer == b"alice2" and isinstance(s.msg, p.Result)]
    assert mine.ok and mine.frames == (b"value",)
    again.core.streams.close()


def test_the_book_on_disk_is_owner_only_bounded_and_expires(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kr, "CHUNK", 7)  # frames larger than a piece are split and joined
    book = KeptResults(tmp_path / "state" / "results.sqlite", retention=100.0, max_results=3,
                       max_bytes=1000)
    for i in range(4):
        book.put(KeptResult(_result(f"i{i}", b"x" * (20 + i)), "alice", "f", 1000.0 + i))
    assert "i0" not in book and len(book) == 3  # the oldest left for the count bound
    assert not book.put(KeptResult(_result("big", b"y" * 2000), "alice", "f", 1010.0))
    book.close()
    state = tmp_path / "state"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in state.iterdir())
    reopened = KeptResults(state / "results.sqlite", retention=100.0, max_results=3,
                           max_bytes=1000)
    rec = reopened.get("i3")
    assert rec is not None and rec.owner == "alice" and rec.result.frames == (b"head", b"x" * 23)
    assert rec.result.meta.duration == 1.5
    assert reopened.expire(1101.5) == 1 and "i1" not in reopened and "i2" in reopened
    assert reopened.expire(2000.0) == 2 and len(reopened) == 0
    reopened.close()
    assert KeptResults(state / "results.sqlite").get("i3") is None  # the expiry was written


def test_a_scheduler_that_keeps_nothing_makes_no_file(tmp_path: Path) -> None:
    h, w, _alias = _harness(tmp_path)
    adhoc = h.register("mine")
    inv = h.submit(adhoc, keep=True)
    h.finish(w, inv)
    h.core.streams.close()
    assert not (tmp_path / "results.sqlite").exists()
