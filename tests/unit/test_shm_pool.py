"""The shared-memory pool of a caller's argument files (gpufn/wire/shm.py): a file is
written again only once nothing uses it, results read from it keep it, and free files
go when idle, over the cap, or when cleared; real files in /dev/shm."""

from __future__ import annotations

import errno
import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpufn.exceptions import SerializationError
from gpufn.wire import serialization as ser
from gpufn.wire import shm

# (not `shm.host_id()`, which a test here checks: a broken one would skip them all)
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not (os.path.isdir(shm.SHM_DIR)
                                      and os.access(shm.SHM_DIR, os.W_OK)),
                                 reason="no writable /dev/shm here")]
MiB = 2**20


def another() -> int:
    """Another process's pid, alive while the test runs (the pytest parent): files named
    after a dead pid would be removed under the test by any supervisor's sweep running
    meanwhile (an integration file on another xdist worker, every 10 s)."""
    return os.getppid()


def mine() -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{os.getpid()}-"))


@pytest.fixture
def pool() -> Iterator[shm.Pool]:
    old = shm._pool
    p = shm._pool = shm.Pool(64 * MiB, idle_s=30.0)
    try:
        yield p
    finally:
        p.clear()
        shm._pool = old
        gc.collect()
        for n in mine():  # whatever a failed test left
            os.unlink(os.path.join(shm.SHM_DIR, n))


def data(n: int, seed: int) -> memoryview:
    return memoryview(torch.full((n // 4,), float(seed)).view(torch.uint8).numpy())


def test_a_file_let_go_of_is_written_again_and_one_still_mapped_is_not(pool: shm.Pool) -> None:
    a = pool.write(data(2 * MiB, 1))
    assert shm._is_pooled(a) and mine() == [a]
    shm.release([a], reuse=[a])  # its worker let go of it
    assert pool.free_names() == [a]
    b = pool.write(data(2 * MiB, 2))
    assert b == a and pool.free_names() == []  # the same file, no new one
    shm.release([b])  # the worker did not say it let go: removed, never written again
    assert mine() == [] and pool.free_names() == []
    c = pool.write(data(2 * MiB, 3))
    assert c != a


def test_a_result_in_a_pooled_file_keeps_it_until_the_tensor_is_gone(pool: shm.Pool) -> None:
    x = torch.arange(MiB, dtype=torch.float32)
    name = pool.write(memoryview(x.view(torch.uint8).numpy()))
    shm.hold([name])  # a Result names it (the worker sent the argument back)
    shm.release([name], reuse=[name])  # the call ended
    assert pool.free_names() == []  # held: its result was not read yet
    got = ser._rebuild_shm_tensor(name, x.nbytes, "float32", (MiB,), False)
    assert torch.equal(got, x)
    view = got[10:20]
    del got
    gc.collect()
    assert pool.free_names() == []  # a view of it lives: not written over
    other = pool.write(data(4 * MiB, 9))
    assert other != name and torch.equal(view, x[10:20])
    del view
    gc.collect()
    assert pool.free_names() == [name]  # free once nothing views it
    with pytest.raises(FileNotFoundError, match="already read"):
        ser._rebuild_shm_tensor(name, x.nbytes, "float32", (MiB,), False)


def test_a_result_read_before_its_call_ends_keeps_the_file(pool: shm.Pool) -> None:
    """The blocking `.remote()`: its result is read, then the call's files are released."""
    x = torch.arange(MiB, dtype=torch.float32)
    name = pool.write(memoryview(x.view(torch.uint8).numpy()))
    got = ser._rebuild_shm_tensor(name, x.nbytes, "float32", (MiB,), False)
    shm.release([name], reuse=[name])
    assert pool.free_names() == [] and pool.write(data(4 * MiB, 9)) != name
    assert torch.equal(got, x)
    del got
    gc.collect()
    assert pool.free_names() == [name]


def test_free_files_go_when_idle_over_the_cap_or_cleared(pool: shm.Pool) -> None:
    pool.idle_s = 0.3
    a = pool.write(data(2 * MiB, 1))
    shm.release([a], reuse=[a])
    assert pool.free_names() == [a] and mine() == [a]
    deadline = time.monotonic() + 10
    while mine() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mine() == [] and pool.free_names() == []  # idle for idle_s: removed
    pool.idle_s = 30.0
    big = pool.write(data(80 * MiB, 2))  # larger than the 64 MiB kept free
    shm.release([big], reuse=[big])
    assert mine() == [] and pool.free_names() == []
    b = pool.write(data(2 * MiB, 3))
    shm.release([b], reuse=[b])
    assert mine() == [b]
    pool.clear()
    assert mine() == []


def test_an_argument_is_only_reused_for_one_at_least_as_large_and_at_most_twice(
        pool: shm.Pool) -> None:
    a = pool.write(data(8 * MiB, 1))
    shm.release([a], reuse=[a])
    small = pool.write(data(2 * MiB, 2))  # a quarter of it: a new file, the big one stays
    assert small != a and pool.free_names() == [a]
    fits = pool.write(data(6 * MiB, 3))
    assert fits == a


def test_a_worker_reports_only_the_files_nothing_views_and_copies_one_still_viewed() -> None:
    """What the executor does: unpickle under borrowing(), drop the arguments, settle()."""
    owner = another()  # not this process's pool: nothing is reused here
    names = [shm._new_file(f"{shm.PREFIX}{owner}-{shm.POOLED}{i:016x}",
                           data(2 * MiB, i)) for i in range(3)]
    try:
        with shm.borrowing() as lent:
            args = [ser._rebuild_shm_tensor(n, 2 * MiB, "float32", (MiB // 2,), False)
                    for n in names]
        assert [b.name for b in lent] == names and all(os.path.exists(
            os.path.join(shm.SHM_DIR, n)) for n in names)  # pooled: not unlinked by the reader
        kept = args[1]  # the function keeps its second argument
        out = shm.Outgoing(owner, MiB, lent=lent)
        frames = ser.dumps(args[1], out)  # and returns it
        assert out.names == [names[1]]  # named, not copied
        del args
        freed = shm.settle(lent, out, frames)
        assert freed == [names[0], names[2]]  # the kept one is still viewed
        copy = out.names[0]
        assert copy != names[1] and len(copy) == len(names[1])
        kept.fill_(-1.0)  # what the worker does later does not reach the result
        value = ser.loads(frames)
        assert torch.equal(value, torch.full((MiB // 2,), 1.0))
        assert not os.path.exists(os.path.join(shm.SHM_DIR, copy))  # taken: unlinked
    finally:
        for n in names:
            shm._unlink(n)


def test_the_sweep_removes_only_dead_owners_files(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's sweep: the files of a caller that died go; a live caller's stay
    (unless it is the owner named); names that are not gpufn's, or name no pid, stay."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    names = [f"{shm.PREFIX}{live}-{shm.POOLED}a", f"{shm.PREFIX}{live}-b",
             f"{shm.PREFIX}{dead.pid}-c", f"{shm.PREFIX}{dead.pid}-{shm.POOLED}d",
             f"{shm.PREFIX}x-e", "other-1-f"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert shm.sweep() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [names[0], names[1], names[4], names[5]])
    assert shm.sweep(owner=live) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[4], names[5]])


def test_numpy_arrays_and_pickle_buffers_over_the_threshold_go_through_files() -> None:
    """Every out-of-band buffer of at least the threshold (numpy's, a bare PickleBuffer)
    is a file named by a short frame; smaller ones stay frames; the receiver's values
    are views of the mappings, writable or not as sent, and no file is left."""
    import pickle

    import numpy as np

    big = np.arange(MiB // 2, dtype=np.float32).reshape(512, 1024)  # 2 MiB
    fortran = np.asfortranarray(np.ones((512, 512)))  # 2 MiB, F-contiguous
    small = np.full(64 * 1024, 3, dtype=np.int32)  # 256 KiB: out of band, not a file
    readonly = np.frombuffer(bytes(2 * MiB), dtype=np.uint8)
    out = shm.Outgoing(os.getpid(), MiB)
    frames = ser.dumps({"big": big, "f": fortran, "small": small, "ro": readonly,
                        "buf": pickle.PickleBuffer(bytearray(b"z" * 2 * MiB))}, out)
    assert len(out.names) == 4 and mine() == sorted(out.names)
    assert out.nbytes == 8 * MiB and sum(len(f) < 1024 for f in frames[1:]) == 4
    assert sorted(len(f) for f in frames[1:])[-1] == small.nbytes  # the socket's frame
    back = ser.loads(frames)
    assert mine() == []  # taken: unlinked, the memory lives in the mappings
    assert np.array_equal(back["big"], big) and back["big"].flags.writeable
    assert np.array_equal(back["f"], fortran) and back["f"].flags.f_contiguous
    assert np.array_equal(back["small"], small)
    assert np.array_equal(back["ro"], readonly) and not back["ro"].flags.writeable
    assert bytes(back["buf"]) == b"z" * 2 * MiB
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert all(n in maps for n in out.names)  # views of the files' mappings, no copies
    del back
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert not any(n in maps for n in out.names)  # unmapped with their last view


def test_a_worker_s_array_result_in_its_argument_file_is_named_or_copied_if_kept() -> None:
    """As for tensors: an array the function returns and dropped is sent back as its
    argument's file; one it kept is sent as a copy (the mark rewritten), so what the
    worker does to it later does not reach the result."""
    import numpy as np

    owner = another()  # not this process's pool: nothing is reused here
    names = [shm._new_file(f"{shm.PREFIX}{owner}-{shm.POOLED}{i:016x}",
                           data(2 * MiB, i)) for i in range(2)]
    stream = ser.dumps(np.zeros(MiB // 2, dtype=np.float32))[0]
    try:
        with shm.borrowing() as lent:
            args = [ser.loads([stream, shm.mark(n, 2 * MiB, 0, False)]) for n in names]
        assert [b.name for b in lent] == names
        assert float(args[0][0]) == 0.0 and float(args[1][0]) == 1.0
        out = shm.Outgoing(owner, MiB, lent=lent)
        frames = ser.dumps((args[0], args[1][MiB // 4:]), out)  # the second from an offset
        assert out.names == names and len(frames) == 3  # named, not copied
        kept = args[1]
        del args
        freed = shm.settle(lent, out, frames)
        assert freed == []  # both carry the result: the first as it is, ...
        assert out.names[0] == names[0]
        copy = out.names[1]  # ... the second, still viewed, as a copy
        assert copy != names[1] and copy.encode() in bytes(frames[2])
        kept.fill(-1.0)
        first, second = ser.loads(frames)
        assert np.array_equal(second, np.full(MiB // 4, 1.0, dtype=np.float32))
        assert np.array_equal(first, np.full(MiB // 2, 0.0, dtype=np.float32))
        assert not os.path.exists(os.path.join(shm.SHM_DIR, copy))  # taken: unlinked
    finally:
        for n in names:
            shm._unlink(n)


def test_a_frame_that_is_neither_a_buffer_nor_a_mark_is_refused_clearly() -> None:
    import numpy as np

    stream = ser.dumps(np.zeros(MiB // 2, dtype=np.float32))[0]
    with pytest.raises(SerializationError, match="one gpufn version on every process"):
        ser.loads([stream, b"not a mark"])
    with pytest.raises(ValueError, match="not a gpufn shared-memory name"):
        ser.loads([stream, shm.mark("/etc/passwd", 2 * MiB, 0, False)])


# Written for the mutants cosmic-ray picked in gpufn/wire/shm.py
# (scripts/mutants.py --room shm).


def borrowed_files(owner: int, n: int, nbytes: int = 2 * MiB) -> list[str]:
    """`n` pooled argument files of another process `owner` (as a caller's pool makes)."""
    return [shm._new_file(f"{shm.PREFIX}{owner}-{shm.POOLED}{i:016x}", data(nbytes, i + 1))
            for i in range(n)]


def test_a_result_goes_into_a_dropped_argument_file_at_most_twice_its_size() -> None:
    """A worker's result is written into an argument file of its caller's pool that no
    view holds any more, when the file is at least as large and at most twice as large;
    the file then carries the result (not reported free), and no new file is made."""
    owner = another()
    names = borrowed_files(owner, 3)
    out = shm.Outgoing(owner, MiB)
    try:
        with shm.borrowing() as lent:
            args = [ser._rebuild_shm_tensor(n, 2 * MiB, "float32", (MiB // 2,), False)
                    for n in names]
        del args
        gc.collect()
        out.lent = lent
        same = out.put(data(2 * MiB, 7))  # as large: into the first
        half = out.put(data(MiB, 8))  # half as large: into the second
        small = out.put(data(MiB - 64 * 1024, 9))  # less than half: a new file
        assert (same, half) == (names[0], names[1])
        assert small is not None and small not in names
        assert out.names == [same, half, small] and out.nbytes == 4 * MiB - 64 * 1024
        freed = shm.settle(lent, out, [])
        assert freed == [names[2]]  # the two carrying the result are not free
        with open(os.path.join(shm.SHM_DIR, names[1]), "rb") as f:
            assert f.read(MiB) == bytes(data(MiB, 8))
    finally:
        for n in [*names, *out.names]:
            shm._unlink(n)


def test_a_kept_argument_returned_in_part_is_copied_only_as_far_as_the_result_reaches() -> None:
    owner = another()
    names = borrowed_files(owner, 1)
    out = shm.Outgoing(owner, 64 * 1024)
    try:
        with shm.borrowing() as lent:
            arg = ser._rebuild_shm_tensor(names[0], 2 * MiB, "float32", (MiB // 2,), False)
        out.lent = lent
        frames = ser.dumps(arg[:MiB // 4], out)  # the first MiB of the 2 MiB file
        assert out.names == names
        freed = shm.settle(lent, out, frames)  # `arg` still views it: a copy
        assert freed == [] and out.names != names
        assert os.path.getsize(os.path.join(shm.SHM_DIR, out.names[0])) == MiB
        arg.fill_(-1.0)
        assert torch.equal(ser.loads(frames), torch.full((MiB // 4,), 1.0))
    finally:
        for n in [*names, *out.names]:
            shm._unlink(n)


def test_a_kept_argument_from_a_caller_s_pool_is_returned_as_a_copy() -> None:
    """The copy's name is as long as a pooled file's (the stream holds the name)."""
    caller = shm.Pool(64 * MiB)
    caller.pid = another()  # another process's pool
    name = caller.write(data(2 * MiB, 5))
    out = shm.Outgoing(caller.pid, MiB)
    try:
        with shm.borrowing() as lent:
            arg = ser._rebuild_shm_tensor(name, 2 * MiB, "float32", (MiB // 2,), False)
        out.lent = lent
        frames = ser.dumps(arg, out)
        shm.settle(lent, out, frames)
        assert out.names != [name] and len(out.names[0]) == len(name)
        arg.fill_(-1.0)
        assert torch.equal(ser.loads(frames), torch.full((MiB // 2,), 5.0))
    finally:
        for n in [name, *out.names]:
            shm._unlink(n)


def test_a_mark_with_a_negative_size_or_offset_is_refused() -> None:
    assert shm.marked(shm.mark("gpufn-1-x", 5, 3, True)) == ("gpufn-1-x", 5, 3, True)
    assert shm.marked(shm.mark("gpufn-1-x", 0, 0, False)) == ("gpufn-1-x", 0, 0, False)
    for nbytes, offset in ((-1, 0), (0, -1), (-1, -1)):
        with pytest.raises(SerializationError, match="negative size"):
            shm.marked(shm.mark("gpufn-1-x", nbytes, offset, False))


def test_a_full_tmpfs_is_said_at_most_once_a_minute(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    clock = [50_000.0]
    monkeypatch.setattr(shm.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(shm, "_said_full", 0.0)
    e = OSError(28, "No space left on device")
    said: list[bool] = []
    with caplog.at_level("WARNING", logger="gpufn.shm"):
        for t in (50_000.0, 50_001.0, 50_059.9, 50_060.0, 50_060.5, 50_120.0):
            clock[0] = t
            before = len(caplog.records)
            shm._say_full(e, 4 * MiB)
            said.append(len(caplog.records) > before)
    assert said == [True, False, False, True, False, True]
    assert all(f"could not take {4 * MiB} bytes (No space left on device); sending"
               in r.getMessage() for r in caplog.records)


def test_a_payload_file_gone_before_its_reader_unlinks_it_is_still_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender removes a call's files when the call ends (a cancel): one removed
    while its worker maps it is read all the same (the mapping holds the memory)."""
    import mmap

    out = shm.Outgoing(os.getpid(), MiB)
    name = out.put(data(2 * MiB, 4))
    assert name is not None
    real = mmap.mmap

    def sender_releases_first(fd: int, n: int, **kw: int) -> mmap.mmap:
        shm.release([name])
        return real(fd, n, **kw)

    monkeypatch.setattr(mmap, "mmap", sender_releases_first)
    got = shm.take(name, 2 * MiB)
    assert bytes(got[:8]) == bytes(data(2 * MiB, 4)[:8]) and mine() == []


def test_a_released_pooled_file_does_not_stop_the_release_of_the_next(pool: shm.Pool) -> None:
    """Releasing a call's files: one of this process's pool goes back to it, one of
    another process's pool is left to its owner, and the files after each still go."""
    a = pool.write(data(2 * MiB, 1))
    theirs = borrowed_files(another(), 1)[0]
    out = shm.Outgoing(os.getpid(), MiB)
    b, c = out.put(data(2 * MiB, 2)), out.put(data(2 * MiB, 3))
    assert b is not None and c is not None and mine() == sorted([a, b, c])
    try:
        shm.release([a, b, theirs, c], reuse=[a])
        assert mine() == [a] and pool.free_names() == [a]
        assert os.path.exists(os.path.join(shm.SHM_DIR, theirs))
    finally:
        shm._unlink(theirs)


def test_payload_files_are_made_readable_by_their_user_only() -> None:
    import stat

    out = shm.Outgoing(os.getpid(), MiB)
    name = out.put(data(2 * MiB, 1))
    assert name is not None
    try:
        mode = os.stat(os.path.join(shm.SHM_DIR, name)).st_mode
        assert stat.S_IMODE(mode) == 0o600
    finally:
        shm.release([name])


def test_owned_keeps_only_gpufn_file_names_of_a_list() -> None:
    names = ["gpufn-12-ab", "gpufn-12-p00", "other-1-x", "gpufn-/../x", 7, None]
    assert shm.owned(names) == ["gpufn-12-ab", "gpufn-12-p00"]
    assert shm.owned("gpufn-12-ab") == [] and shm.owned(None) == []
    assert shm.owned(("gpufn-12-ab",)) == []


def test_each_process_gets_its_own_pool_of_the_configured_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "_pool", None)
    monkeypatch.setenv("GPUFN_SHM_POOL", "3MiB")
    p = shm.pool()
    assert p is not None and p.cap == 3 * MiB and p.pid == os.getpid()
    assert shm.pool() is p  # kept
    p.pid = os.getpid() + 10_000_000  # as a forked child sees its parent's
    child = shm.pool()
    assert child is not None and child is not p and child.pid == os.getpid()
    monkeypatch.setattr(shm, "_pool", None)
    monkeypatch.setenv("GPUFN_SHM_POOL", "0")
    assert shm.pool() is None
    monkeypatch.setenv("GPUFN_SHM_POOL", "1")  # any size at all: a pool
    one = shm.pool()
    assert one is not None and one.cap == 1


def test_a_shm_folder_that_is_a_file_turns_shared_memory_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    where = tmp_path / "shm"
    where.write_bytes(b"")  # writable, but no folder
    monkeypatch.setattr(shm, "SHM_DIR", str(where))
    monkeypatch.setattr(shm, "_host", None)
    with caplog.at_level("WARNING", logger="gpufn.shm"):
        assert shm.host_id() == ""
    assert "not a folder this user can write" in caplog.text
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))  # chosen, and a folder: not said
    monkeypatch.setattr(shm, "_host", None)
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpufn.shm"):
        assert shm.host_id().endswith(f"/{os.getuid()}{tmp_path}")
    assert caplog.records == []


def test_a_file_exactly_filling_the_cap_is_kept_free() -> None:
    p = shm.Pool(2 * MiB)
    a = p.write(data(2 * MiB, 1))
    try:
        p.done(a, True)
        assert p.free_names() == [a]
        b = p.write(data(2 * MiB, 2))
        c = p.write(data(MiB, 3))  # a 1 MiB file besides: over the cap, removed when done
        p.done(b, True)
        p.done(c, True)
        assert b == a and p.free_names() == [a] and mine() == [a]
    finally:
        p.clear()


def test_the_idle_timer_removes_only_files_idle_long_enough() -> None:
    p = shm.Pool(64 * MiB, idle_s=30.0)
    a = p.write(data(2 * MiB, 1))
    try:
        p.done(a, True)
        p._expire()  # as the timer would, far too early for this file
        assert p.free_names() == [a] and mine() == [a]
    finally:
        p.clear()
    assert mine() == []


def test_a_free_file_removed_under_the_pool_is_replaced_or_forgotten() -> None:
    """The sweep (or a person) removed a free file: the next argument gets a new file,
    and clearing the pool passes over one already gone."""
    p = shm.Pool(64 * MiB)
    a = p.write(data(2 * MiB, 1))
    b = p.write(data(2 * MiB, 2))
    try:
        p.done(a, True)
        p.done(b, True)
        for n in (a, b):
            os.unlink(os.path.join(shm.SHM_DIR, n))
        c = p.write(data(2 * MiB, 3))  # the free file it picked is gone: a new one
        assert c not in (a, b) and mine() == [c]
        with open(os.path.join(shm.SHM_DIR, c), "rb") as f:
            assert f.read(8) == bytes(data(2 * MiB, 3)[:8])
        p.clear()  # the other one, gone too
        assert p.free_names() == []
    finally:
        p.clear()
        for n in mine():
            os.unlink(os.path.join(shm.SHM_DIR, n))


def test_a_pool_s_idle_timer_does_not_hold_up_the_process_s_exit() -> None:
    import subprocess
    import sys

    code = ("import os\n"
            "from gpufn.wire import shm\n"
            "p = shm.Pool(64 * 2**20, idle_s=60.0)\n"
            "a = p.write(memoryview(bytes(2**20)))\n"
            "p.done(a, True)\n"
            "assert p.free_names() == [a]\n"
            "os.unlink(os.path.join(shm.SHM_DIR, a))\n")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=20)
    assert time.monotonic() - t0 < 30  # not the 60 s of the timer


def test_a_free_file_goes_after_thirty_idle_seconds_to_the_tick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(shm.time, "monotonic", lambda: clock[0])
    p = shm.Pool(64 * MiB)
    a = p.write(data(2 * MiB, 1))
    try:
        p.done(a, True)  # idle from 1000.0
        clock[0] = 1029.99
        p._expire()
        assert p.free_names() == [a]
        clock[0] = 1030.0  # POOL_IDLE_S: 30 s
        p._expire()
        assert p.free_names() == [] and mine() == []
    finally:
        p.clear()


def test_the_idle_timer_wakes_when_the_oldest_file_is_due_not_before() -> None:
    p = shm.Pool(64 * MiB, idle_s=30.0)
    woke: list[float] = []
    expire = p._expire

    def counted() -> None:
        woke.append(time.monotonic())
        expire()

    p._expire = counted  # type: ignore[method-assign]
    a = p.write(data(2 * MiB, 1))
    try:
        p.done(a, True)
        time.sleep(0.3)
        assert woke == [] and p.free_names() == [a]
    finally:
        p.clear()


def test_a_free_file_goes_soon_after_its_idle_time() -> None:
    """The timer wakes once, just after the file's idle time (not before it, to look
    again and again)."""
    p = shm.Pool(64 * MiB, idle_s=0.2)
    woke: list[float] = []
    expire = p._expire

    def counted() -> None:
        woke.append(time.monotonic())
        expire()

    p._expire = counted  # type: ignore[method-assign]
    a = p.write(data(2 * MiB, 1))
    try:
        p.done(a, True)
        t0 = time.monotonic()
        while mine() and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert mine() == [] and time.monotonic() - t0 < 1.0
        assert len(woke) == 1 and woke[0] - t0 >= 0.2
    finally:
        p.clear()


def test_hold_says_whether_the_file_is_the_pool_s(pool: shm.Pool) -> None:
    name = pool.write(data(2 * MiB, 1))
    assert pool.hold(name) is True
    assert pool.hold(f"{shm.PREFIX}{os.getpid()}-{shm.POOLED}{0:016x}") is False
    shm.release([name], reuse=[name])
    assert pool.free_names() == []  # held until its result is read


def test_a_pooled_file_has_whole_mebibytes_and_no_more() -> None:
    p = shm.Pool(64 * MiB)
    a = p.write(data(3 * MiB // 2, 1))
    try:
        path = os.path.join(shm.SHM_DIR, a)
        assert os.path.getsize(path) == 2 * MiB
        assert os.stat(path).st_blocks * 512 >= 2 * MiB  # every page there already
        with open(path, "rb") as f:
            assert f.read(3 * MiB // 2) == bytes(data(3 * MiB // 2, 1))
    finally:
        p.done(a, False)
        p.clear()
    assert mine() == []


def test_a_result_read_past_its_pooled_file_s_end_fails_and_frees_the_file(
        pool: shm.Pool) -> None:
    name = pool.write(data(2 * MiB, 1))
    shm.hold([name])
    shm.release([name], reuse=[name])
    assert pool.free_names() == []  # held for its result
    with pytest.raises(ValueError):
        pool.view(name, 4 * MiB)
    assert pool.free_names() == [name]  # the failed read let go of it


def test_a_borrowed_file_is_unmapped_once_settled_and_no_longer_viewed() -> None:
    owner = another()
    names = borrowed_files(owner, 1)
    try:
        with shm.borrowing() as lent:
            arg = ser._rebuild_shm_tensor(names[0], 2 * MiB, "float32", (MiB // 2,), False)
        with open("/proc/self/maps") as f:
            assert names[0] in f.read()
        del arg
        assert shm.settle(lent, None, []) == names
        gc.collect()
        with open("/proc/self/maps") as f:
            assert names[0] not in f.read()  # `lent` is still here; the mapping is not
        assert len(lent) == 1
    finally:
        shm._unlink(names[0])


def test_only_a_buffer_wholly_inside_an_argument_file_is_named() -> None:
    owner = another()
    names = borrowed_files(owner, 1)
    try:
        with shm.borrowing() as lent:
            arg = ser._rebuild_shm_tensor(names[0], 2 * MiB, "float32", (MiB // 2,), False)
        out = shm.Outgoing(owner, MiB, lent=lent)
        base = arg.data_ptr()
        assert out.view_of(base + 2 * MiB - 10, 20) is None  # past its end
        assert out.view_of(base + 2 * MiB, 10) is None  # just after it
        assert out.view_of(base - 10, 10) is None  # just before it
        assert out.view_of(base + 2 * MiB - 10, 10) == (names[0], 2 * MiB - 10)
        assert out.names == names and out.nbytes == 10
    finally:
        shm._unlink(names[0])


def test_a_zero_byte_read_of_a_borrowed_file_is_an_empty_array() -> None:
    owner = another()
    names = borrowed_files(owner, 1)
    try:
        with shm.borrowing() as lent:
            got = shm.take(names[0], 0)
        assert got.nbytes == 0 and [b.name for b in lent] == names
    finally:
        shm._unlink(names[0])


def test_releasing_files_their_receiver_already_took_is_quiet() -> None:
    out = shm.Outgoing(os.getpid(), MiB)
    frames = ser.dumps(torch.ones(MiB // 2), out)
    assert torch.equal(ser.loads(frames), torch.ones(MiB // 2))  # taken: unlinked
    assert mine() == []
    shm.release(out.names)  # the call ended: nothing left to remove, no error


def test_a_free_file_the_pool_cannot_open_again_is_removed_not_left() -> None:
    """Out of descriptors (EMFILE), the pool cannot map its free file for the next
    argument: it forgets the file and removes it (no file left that nothing owns), and
    the write fails (the argument then goes through the socket)."""
    import subprocess
    import sys

    code = ("import os, resource\n"
            "from gpufn.wire import shm\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
            "p = shm.Pool(64 * 2**20)\n"
            "a = p.write(memoryview(bytes(2**20)))\n"
            "p.done(a, True)\n"
            "held = []\n"
            "try:\n"
            "    while True:\n"
            "        held.append(os.open('/dev/null', os.O_RDONLY))\n"
            "except OSError:\n"
            "    pass\n"
            "try:\n"
            "    p.write(memoryview(bytes(2**20)))\n"
            "    print('written')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "for fd in held:\n"
            "    os.close(fd)\n"
            "print(p.free_names(), os.path.exists(os.path.join(shm.SHM_DIR, a)))\n"
            "p.clear()\n"
            "shm.sweep(os.getpid())\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=30,
                         capture_output=True, text=True).stdout.split("\n")
    assert out[:2] == [f"refused {errno.EMFILE}", "[] False"]


def test_a_payload_that_cannot_be_written_goes_through_the_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """put() -> None (the caller sends the bytes in its frames), said, nothing noted."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path / "gone"))
    monkeypatch.setattr(shm, "_said_full", 0.0)
    out = shm.Outgoing(os.getpid(), MiB)
    with caplog.at_level("WARNING", logger="gpufn.shm"):
        assert out.put(data(2 * MiB, 1)) is None
    assert out.names == [] and out.nbytes == 0
    assert "through the socket instead" in caplog.text
    frames = ser.dumps(torch.ones(MiB // 2), out)
    assert out.names == [] and sum(len(f) for f in frames[1:]) == 2 * MiB


def test_only_gpufn_names_without_a_folder_are_taken() -> None:
    for bad in ("gpufn-1/../x", "other-1-x", "/dev/shm/gpufn-1-x"):
        with pytest.raises(ValueError, match="not a gpufn shared-memory name"):
            shm.take(bad, 10)


def test_a_free_file_twice_an_argument_s_size_is_written_again(pool: shm.Pool) -> None:
    a = pool.write(data(2 * MiB, 1))
    shm.release([a], reuse=[a])
    assert pool.write(data(MiB, 2)) == a


def test_releasing_a_one_shot_file_beside_a_free_pooled_one_removes_it(pool: shm.Pool) -> None:
    """A call's one-shot file (not pooled) is removed, whatever the pool holds free; a
    pooled file released twice stays free."""
    a = pool.write(data(2 * MiB, 1))
    shm.release([a], reuse=[a])
    out = shm.Outgoing(os.getpid(), MiB)
    b = out.put(data(2 * MiB, 2))
    assert b is not None and mine() == sorted([a, b])
    shm.release([b])
    assert mine() == [a]
    shm.release([a], reuse=[a])  # again: still the pool's
    assert mine() == [a] and pool.free_names() == [a]


def test_a_result_s_file_removed_when_its_last_view_goes(pool: shm.Pool) -> None:
    """A result viewing a pooled file whose call said it was not let go of: the file is
    removed (not kept for reuse) once the tensor is gone."""
    x = torch.arange(MiB, dtype=torch.float32)
    name = pool.write(memoryview(x.view(torch.uint8).numpy()))
    got = ser._rebuild_shm_tensor(name, x.nbytes, "float32", (MiB,), False)
    shm.release([name])  # not let go of: removed once nothing uses it
    assert mine() == [name] and torch.equal(got, x)
    del got
    gc.collect()
    assert mine() == [] and pool.free_names() == []


def test_a_forked_child_never_removes_its_parent_s_pooled_files(pool: shm.Pool) -> None:
    a = pool.write(data(2 * MiB, 1))
    shm.release([a], reuse=[a])
    assert shm.pool() is pool
    pid = os.fork()
    if pid == 0:  # the child: its own pool; clearing the parent's leaves the files
        try:
            mine_now = shm.pool()
            pool.clear()
            os._exit(0 if mine_now is not pool and mine_now is not None else 3)
        finally:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert mine() == [a]


def test_the_sweep_of_a_folder_that_cannot_be_listed_removes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path / "gone"))
    assert shm.sweep() == 0


def test_an_argument_under_half_a_free_file_s_size_gets_a_new_file(pool: shm.Pool) -> None:
    a = pool.write(data(2 * MiB, 1))
    shm.release([a], reuse=[a])
    small = pool.write(data(3 * MiB // 4, 2))  # 2 MiB is more than twice 0.75 MiB
    assert small != a and pool.free_names() == [a]


def test_a_file_whose_write_fails_is_closed_and_removed() -> None:
    name = f"{shm.PREFIX}{os.getpid()}-{0:016x}"
    strided = memoryview(bytes(2 * MiB))[::2]  # not contiguous: pwrite refuses it
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises((BufferError, TypeError, ValueError)):
        shm._new_file(name, strided)
    assert mine() == [] and len(os.listdir("/proc/self/fd")) == fds


def test_hold_without_a_pool_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "_pool", None)
    shm.hold([f"{shm.PREFIX}{os.getpid()}-{shm.POOLED}{0:016x}"])  # no pool: no error


def test_a_host_without_a_boot_id_uses_no_shared_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(path: str, *a: object, **kw: object) -> object:
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(shm, "open", no_proc, raising=False)  # /proc masked
    monkeypatch.setattr(shm, "_host", None)
    assert shm.host_id() == ""


def test_a_result_s_bytes_that_begin_like_a_mark_are_not_rewritten() -> None:
    """settle() renames a copied file in the stream and in the marks, never inside a
    socket frame of the result's own bytes, whatever they hold."""
    owner = another()
    names = borrowed_files(owner, 1)
    out = shm.Outgoing(owner, MiB)
    try:
        with shm.borrowing() as lent:
            arg = ser._rebuild_shm_tensor(names[0], 2 * MiB, "float32", (MiB // 2,), False)
        out.lent = lent
        payload = shm.MARK + names[0].encode() + b" " * (100 * 1024)  # out of band, no file
        frames = ser.dumps((arg, bytearray(payload)), out)
        shm.settle(lent, out, frames)  # `arg` is still viewed: a copy, renamed
        assert out.names != names
        back_arg, back = ser.loads(frames)
        assert bytes(back) == payload and torch.equal(back_arg, torch.full((MiB // 2,), 1.0))
    finally:
        for n in [*names, *out.names]:
            shm._unlink(n)
