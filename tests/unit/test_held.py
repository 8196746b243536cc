"""What a worker keeps for a restarted scheduler (worker/host/held.py): its latest Results
within a byte budget, the ids of calls that ran, and the journal of the calls it started.
Written for the mutants cosmic-ray picked there (scripts/mutants.py --room held)."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufn.wire import protocol as p
from gpufn.worker.host import held
from gpufn.worker.host.held import HeldResults, RunJournal
from tests.tmpfs import small_tmpfs

pytestmark = pytest.mark.timeout(60)


def _result(inv: str, payload: bytes | bytearray | memoryview = b"", token: int = 1,
            duration: float | None = 0.25) -> p.Result:
    return p.Result(inv, True, "", "", p.ResultMeta(dispatch_token=token, duration=duration),
                    (b"h", payload))


def test_the_constants_of_the_journal() -> None:
    assert (held.MAX_IDS, held.JOURNAL_SLOTS, held.SLOT, held.MAX_ID) == (10_000, 4096, 64, 63)


def test_payload_sizes_count_bytes_bytearrays_and_buffers() -> None:
    assert held._nbytes((b"ab", bytearray(3), memoryview(b"abcd"))) == 9
    assert held._nbytes((memoryview(b"abcdefgh").cast("i"),)) == 8  # bytes, not items
    h = HeldResults(max_bytes=10**6)
    h.add(_result("a", bytearray(10)), 1)
    h.add(_result("b", memoryview(b"x" * 20)), 1)
    assert h.nbytes == 1 + 10 + 1 + 20  # every frame, the header's too
    h.add(_result("a", b"y" * 5), 2)  # sent again: one entry, counted once
    assert h.nbytes == 1 + 20 + 1 + 5
    h.add(_result("c", b""), 1, [p.Output("c", "stdout", "printed")])
    assert h.nbytes == 1 + 20 + 1 + 5 + 1 + len("printed")


def test_payloads_are_let_go_oldest_first_to_fit_and_the_newest_is_kept() -> None:
    h = HeldResults(max_bytes=21)
    h.add(_result("a", b"x" * 9), 1)
    h.add(_result("b", b"x" * 9), 1)
    assert h.nbytes == 20 and h.get("a") is not None  # 20 fits 21: both kept
    h.add(_result("c", b"x" * 0), 1)
    assert h.nbytes == 21 and h.get("a") is not None  # exactly the budget: still kept
    h.add(_result("d", b"x" * 9), 1)
    assert h.get("a") is None and h.get("b") is not None and h.nbytes == 21  # a let go: fits
    held_, ran = h.report()
    assert ran == ["a"] and list(held_) == ["b", "c", "d"]
    big = HeldResults(max_bytes=5)
    big.add(_result("huge", b"x" * 100), 3)
    assert big.get("huge") is not None  # the newest whatever its size
    assert big.report() == ({"huge": [1, 3, 250]}, [])


def test_ids_past_max_ids_are_forgotten_with_their_bytes() -> None:
    h = HeldResults(max_bytes=10**6, max_ids=2)
    for inv in ("a", "b", "c"):
        h.add(_result(inv, b"x" * 10), 1)
    assert h.get("a") is None and h.report()[1] == [] and h.nbytes == 22
    h.ran(["d", "b"])  # b has its Result: not replaced
    assert h.get("b") is None and h.report() == ({"c": [1, 1, 250]}, ["d"])
    assert h.nbytes == 11


def test_the_report_names_the_run_time_in_ms_never_negative() -> None:
    h = HeldResults(max_bytes=10**6)
    h.add(_result("none", duration=None), 2)
    h.add(_result("neg", duration=-1.0), 1)
    h.add(_result("ok", token=7, duration=1.5), 4)
    assert h.report()[0] == {"none": [1, 2, 0], "neg": [1, 1, 0], "ok": [7, 4, 1500]}


def test_the_journal_file_keeps_ids_up_to_63_bytes_and_wraps(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    path.write_bytes(b"\x05hello")  # a file of another size is made the right size
    j = RunJournal(path)
    assert path.stat().st_size == held.JOURNAL_SLOTS * held.SLOT
    assert stat.S_IMODE(path.stat().st_mode) in (0o600, 0o644)  # made before: kept
    first, longest = "a", "b" * held.MAX_ID
    j.started(first)
    j.started(longest)
    j.started("c" * (held.MAX_ID + 1))  # not an id gpufn makes: not journaled
    assert sorted(RunJournal.read(path)) == sorted([first, longest])  # over the old slot 0
    for i in range(held.JOURNAL_SLOTS):
        j.started(f"id{i}")
    ids = RunJournal.read(path)
    assert len(ids) == held.JOURNAL_SLOTS and first not in ids and "id0" in ids
    j.close()
    RunJournal.clear(path)
    assert RunJournal.read(path) == [] and path.stat().st_size == held.JOURNAL_SLOTS * held.SLOT


def test_a_journal_is_read_whole_only_when_every_call_started_is_in_it(tmp_path: Path) -> None:
    """`read_whole` is what says a call never started (scheduler/desks/lost_leases.py):
    None for no journal, one of another size (a worker that could not make it), or one
    that may have wrapped (its last free slot may be a slot torn by the kill)."""
    path = tmp_path / "journal"
    assert RunJournal.read_whole(path) is None
    RunJournal.clear(path)  # what the supervisor does before each worker starts
    assert RunJournal.read_whole(path) == []
    j = RunJournal(path)
    for i in range(held.JOURNAL_SLOTS - 2):
        j.started(f"{i:04d}")
    assert len(RunJournal.read_whole(path) or []) == held.JOURNAL_SLOTS - 2
    j.started("last")  # one slot free: it may be a torn one, over an older id
    assert RunJournal.read_whole(path) is None and len(RunJournal.read(path)) == held.JOURNAL_SLOTS - 1
    j.close()
    path.write_bytes(b"\x01a")
    assert RunJournal.read_whole(path) is None and RunJournal.read(path) == []


def test_a_new_journal_is_owner_only_and_reads_its_last_slot(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    j = RunJournal(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for i in range(held.JOURNAL_SLOTS):
        j.started(f"{i:04d}")
    j.close()
    assert "4095" in RunJournal.read(path) and len(RunJournal.read(path)) == held.JOURNAL_SLOTS


def test_a_slot_that_is_not_utf8_is_skipped_and_the_rest_read(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    data = bytearray(held.JOURNAL_SLOTS * held.SLOT)
    data[0], data[1] = 1, 0xFF  # torn or foreign
    data[held.SLOT], data[held.SLOT + 1] = 1, ord("x")
    data[2 * held.SLOT] = held.SLOT  # a length no slot holds
    data[3 * held.SLOT] = 1
    path.write_bytes(bytes(data))
    assert RunJournal.read(path) == ["x", "\x00"]
    assert RunJournal.read(tmp_path / "none") == []


def test_bytes_stay_exact_when_a_let_go_call_is_sent_again_or_forgotten() -> None:
    h = HeldResults(max_bytes=15, max_ids=2)
    h.add(_result("a", b"x" * 9), 1)
    h.add(_result("b", b"x" * 9), 1)  # a's payload let go
    assert h.nbytes == 10
    h.add(_result("a", b"x" * 4), 2)  # a Resend of a call whose payload was let go
    assert h.nbytes == 15
    h.add(_result("c", b"x" * 9), 1)  # b forgotten past max_ids, after its payload went
    assert h.nbytes == 15 and h.report() == ({"a": [1, 2, 250], "c": [1, 1, 250]}, [])


def test_a_trailing_partial_slot_is_not_read_and_clear_makes_an_owner_only_file(
        tmp_path: Path) -> None:
    path = tmp_path / "journal"
    data = bytearray(2 * held.SLOT - 1)
    data[0], data[1] = 1, ord("a")
    data[held.SLOT], data[held.SLOT + 1] = 1, ord("b")  # in a slot one byte short
    path.write_bytes(bytes(data))
    assert RunJournal.read(path) == ["a"]
    fresh = tmp_path / "fresh"
    RunJournal.clear(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    assert fresh.stat().st_size == held.JOURNAL_SLOTS * held.SLOT
    RunJournal.clear(tmp_path / "no" / "such" / "folder")  # cannot: nothing to clear


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "1m") as where:
        yield where


JOURNAL_ON_A_FULL_DISK = """
import errno, sys
from gpufn.worker.host.held import JOURNAL_SLOTS, RunJournal
folder = sys.argv[1]
j = RunJournal(folder + "/worker.ran")
try:
    with open(folder + "/filler", "wb", buffering=0) as f:
        while True:
            f.write(bytes(4096))
except OSError as e:
    assert e.errno == errno.ENOSPC, e
for i in range(2 * JOURNAL_SLOTS):
    j.started(f"{i:016x}")
try:
    RunJournal(folder + "/another.ran")
except OSError as e:
    print("refused", errno.errorcode[e.errno])
RunJournal.clear(folder + "/new.ran")  # a supervisor's first spawn on the full disk
import os
print("cleared" if not os.path.exists(folder + "/new.ran") else "left")
print("ok")
"""


def test_a_journal_made_before_the_disk_filled_takes_every_slot(small_disk: Path) -> None:
    """Its pages are all allocated when it is made, so no slot can fault later; one made
    on a full disk is refused with OSError (the worker goes on without it). Before, a
    journal made with holes (a worker started on a full disk, after its supervisor's
    zeroing failed) was SIGBUS at the first slot written into a hole; and that zeroing's
    ENOSPC escaped `clear` into the supervisor. A journal it cannot zero is removed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", JOURNAL_ON_A_FULL_DISK, str(small_disk)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    assert out.stdout.split() == ["refused", "ENOSPC", "cleared", "ok"], out.stdout


def test_a_journal_that_cannot_be_zeroed_is_removed_quietly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's clear before a spawn: a failed zeroing (ENOSPC) removes the file
    (no ids of the predecessor left to be read again) and never raises, not even when
    the removal fails too."""
    import errno
    import os

    path = tmp_path / "w.ran"
    j = RunJournal(path)
    j.started("0123456789abcdef")
    j.close()

    def full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(held.os, "pwrite", full)
    RunJournal.clear(path)
    assert not path.exists()
    RunJournal(path).started("0123456789abcdef")
    monkeypatch.setattr(held.os, "unlink", lambda _p: full())
    RunJournal.clear(path)  # quiet: the worker then finds what it finds
    assert RunJournal.read(path) == ["0123456789abcdef"]
    monkeypatch.undo()
    os.unlink(path)
    assert len(RunJournal(path)._map) == held.JOURNAL_SLOTS * held.SLOT  # a new file grows
