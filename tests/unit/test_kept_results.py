"""Spawned calls of deployed functions outlive their spawner: the core keeps them running
when their client leaves and keeps their Results (on disk, bounded, retained), read back
by the same user only; calls of functions defined in the caller's process are cancelled
with it. The book itself: sqlite in the state directory, owner-only, chunked frames."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------- the book's edges


def _rec(inv: str, size: int, ended: float = 1000.0, owner: str = "alice") -> KeptResult:
    """A record whose payload is `size` bytes (one frame)."""
    return KeptResult(p.Result(inv, True, "", "", frames=(b"x" * size,)), owner, "f", ended)


def test_the_books_defaults_are_the_schedulers_documented_ones(tmp_path: Path) -> None:
    from gpufn.scheduler.nouns.settings import SchedulerConfig

    book = KeptResults.in_state_dir(str(tmp_path))
    cfg = SchedulerConfig()
    assert (book.retention, book.max_bytes) == (cfg.result_retention_seconds,
                                                cfg.result_store_bytes) == (24 * 3600.0, 4 * 2**30)
    assert book.max_results == 100_000 and KeptResults(None).max_results == 100_000


@pytest.mark.parametrize("path", [False, True])
def test_the_byte_bound_is_inclusive_and_counts_from_zero(tmp_path: Path, path: bool) -> None:
    book = KeptResults(tmp_path / "r.sqlite" if path else None, max_bytes=100)
    assert book.put(_rec("whole", 100)) is True  # exactly the book: kept
    assert "whole" in book and book.get("whole") is not None
    assert book.put(_rec("a", 50, 1001.0)) and "whole" not in book  # 150: the oldest leaves
    assert book.put(_rec("b", 50, 1002.0)) and "a" in book and "b" in book  # 100: both stay
    assert book.put(_rec("c", 1, 1003.0)) and "a" not in book  # 101: the oldest leaves
    assert [r in book for r in ("b", "c")] == [True, True]
    assert book.put(_rec("huge", 101)) is False and "huge" not in book and len(book) == 2
    book.close()


def test_a_book_reopened_with_a_lower_count_bound_keeps_exactly_that_many(tmp_path: Path) -> None:
    book = KeptResults(tmp_path / "r.sqlite", max_results=10)
    for i in range(5):
        book.put(_rec(f"i{i}", 10, 1000.0 + i))
    book.close()
    smaller = KeptResults(tmp_path / "r.sqlite", max_results=2)
    assert len(smaller) == 5  # read back as they were...
    smaller.put(_rec("new", 10, 1010.0))  # ...and bounded by the next put: the newest 2
    assert len(smaller) == 2 and "i4" in smaller and "new" in smaller
    smaller.close()


def test_a_record_is_kept_until_exactly_its_retention(tmp_path: Path) -> None:
    book = KeptResults(tmp_path / "r.sqlite", retention=100.0)
    book.put(_rec("a", 10, 1000.0))
    book.put(_rec("b", 10, 1050.0))
    assert book.expire(1100.0) == 0 and "a" in book  # ended exactly 100 s ago: still kept
    assert book.expire(1100.5) == 1 and "a" not in book and "b" in book
    book.close()


def test_owner_and_size_of_a_record(tmp_path: Path) -> None:
    import array

    book = KeptResults(tmp_path / "r.sqlite")
    book.put(_rec("a", 10, owner="alice"))
    assert book.owner("a") == "alice" and book.owner("nosuch") is None
    # A frame may be any buffer: its size is its bytes, not its length in items.
    ints = memoryview(array.array("i", [1, 2, 3]))
    rec = KeptResult(p.Result("m", True, "", "", frames=(ints,)), "alice", "f", 1.0)
    assert rec.nbytes == 3 * ints.itemsize == kr.nbytes((ints, b"ab")) - 2
    book.close()


def test_records_are_immutable() -> None:
    import dataclasses

    rec = _rec("a", 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.owner = "mallory"  # type: ignore[misc]
    call = kr.DetachedCall("c", "fid", "alice", 1.0, {}, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.owner = "mallory"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        kr._Entry("alice", 1.0, 3).nbytes = 0  # type: ignore[misc]


def test_a_book_without_a_file_starts_no_writer_and_notes_no_calls() -> None:
    book = KeptResults(None)
    book.save_calls([kr.DetachedCall("c", "fid", "alice", 1.0, {}, (b"args",))], ["d"])
    assert book._writer is None and book.detached() == []
    book.close()


@pytest.mark.timeout(60)
def test_a_write_that_fails_is_served_from_memory_and_the_writer_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills mid-write (OSError) and a record that cannot be written
    (TypeError): each rolls its transaction back, the first is served from memory, and the
    writer thread writes the next records."""
    real = kr._put_frames

    def failing(cur: Any, table: str, rid: str, frames: Any) -> None:
        real(cur, table, rid, frames)  # inside the transaction: it must be rolled back
        if rid == "full":
            raise OSError(28, "No space left on device")
        if rid in ("odd", "odd-call"):
            raise TypeError("not a buffer")

    monkeypatch.setattr(kr, "_put_frames", failing)
    book = KeptResults(tmp_path / "r.sqlite")
    book.put(_rec("full", 10))
    book.put(_rec("odd", 10))
    book.save_calls([kr.DetachedCall("odd-call", "fid", "alice", 1.0, {}, (b"x",))], [])
    book.put(_rec("good", 10, 1001.0))
    book.save_calls([kr.DetachedCall("call", "fid", "alice", 2.0, {"k": 1}, (b"args",))], [])
    book.close()
    rec = book.get("full")  # never written: from memory
    assert rec is not None and rec.result.frames == (b"x" * 10,)
    reopened = KeptResults(tmp_path / "r.sqlite")
    assert "good" in reopened and "full" not in reopened and "odd" not in reopened
    assert [(c.invocation_id, c.spec) for c in reopened.detached()] == [("call", {"k": 1})]
    reopened.close()


def test_a_scheduler_that_never_closes_its_book_still_exits(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = ("import sys; from gpufn.scheduler.stores.kept_results import KeptResults\n"
              "from gpufn.wire import protocol as p\n"
              "b = KeptResults(sys.argv[1])\n"
              "b.save_calls([], ['gone'])\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "r.sqlite")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr  # the writer thread is a daemon


@pytest.mark.timeout(60)
def test_a_delete_that_fails_is_rolled_back_and_the_writer_goes_on(tmp_path: Path) -> None:
    """sqlite refuses to delete a record's frames (a trigger raises, as an I/O error
    would): that delete is rolled back whole, and the next writes are made."""
    import sqlite3

    path = tmp_path / "r.sqlite"
    book = KeptResults(path, retention=100.0)
    book.put(_rec("stuck", 10, 1000.0))
    book.close()  # written
    with sqlite3.connect(path) as other:
        other.execute("CREATE TRIGGER refuse BEFORE DELETE ON frames WHEN old.id = 'stuck' "
                      "BEGIN SELECT RAISE(ABORT, 'disk I/O error'); END")
    book = KeptResults(path, retention=100.0)
    assert book.expire(2000.0) == 1  # gone from the index; its delete fails on disk
    book.put(_rec("after", 10, 1990.0))
    book.close()
    reopened = KeptResults(path, retention=100.0)
    assert "after" in reopened
    kept = reopened.get("stuck")  # not half deleted: its row and its frames are there
    assert kept is not None and kept.result.frames == (b"x" * 10,)
    reopened.close()
