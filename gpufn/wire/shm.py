"""Same-host big payloads through shared memory: a tensor, bytes or any other out-of-band
buffer (a numpy array's, a `pickle.PickleBuffer`) of GPUFN_SHM_THRESHOLD (64 MiB) or more
is written once into a file in /dev/shm and only its name travels through the sockets (in
the pickle stream, or as the buffer's frame: `mark`); the receiver maps the file (zero
copies: the tensor or array is a view of the mapping) and unlinks it at once, so its
memory goes back when the value is freed.

The folder is GPUFN_SHM_DIR (/dev/shm). A file that cannot be written there (the tmpfs is
full) is not an error: that buffer travels through the socket instead (`put` -> None),
and nothing of it is left behind; pooled files get all their pages when made
(`posix_fallocate`), so writing into one again can never fault on a full tmpfs.

Files are named `gpufn-<owner pid>-<random>`, the owner being the caller of the call the
payload belongs to. The sender also unlinks what it made when the call ends (a call
cancelled before a worker read its arguments), and `sweep()` (run by each host's
supervisor) removes the files whose owner died. Used only between processes that share
a host *and* a user (`host_id()`), so the receiver can always open the file.

A caller's argument files come from its `Pool` (names `gpufn-<pid>-p<random>`): the
worker maps such a file without unlinking it and, when the call ends, says whether any
view of it survived (`ResultMeta.shm_freed`); only a file no worker still maps is written
again for a later call (a copy into pages already there, no new file, no page faults),
any other is unlinked as before. Idle pooled files go after POOL_IDLE_S and at exit.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpufn.exceptions import SerializationError
from gpufn.wire import config
from gpufn.wire.pids import alive

log = logging.getLogger("gpufn.shm")

SHM_DIR = config.shm_dir()
PREFIX = "gpufn-"
POOLED = "p"  # after `gpufn-<pid>-`: a pooled file, kept by its receiver's take()
COPIED = "c"  # a one-shot copy of a pooled file (same length of name; see settle())
POOL_IDLE_S = 30.0  # a pooled file unused this long is removed
MARK = b"gpufn-shm "  # starts an out-of-band frame that names a file instead of holding bytes
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

_host: str | None = None


def host_id() -> str:
    """Who can open this process's shared-memory files: the boot, the host, the user and
    the folder ("" where it is not writable: shared memory is then never used)."""
    global _host
    if _host is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            ok = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
        except OSError:
            boot, ok = "", False
        if not ok and SHM_DIR != config.SHM_DIR_DEFAULT:  # chosen, so said
            log.warning("GPUFN_SHM_DIR=%s is not a folder this user can write: big payloads "
                        "go through the sockets (create it, or mount a tmpfs there)", SHM_DIR)
        # The folder too: processes given different ones cannot read each other's files.
        _host = f"{boot}/{socket.gethostname()}/{os.getuid()}{SHM_DIR}" if ok and boot else ""
    return _host


@dataclass(slots=True)
class Outgoing:
    """Where one payload's big buffers go: files owned by `owner` (the caller's pid), at
    least `threshold` bytes each; `names` collects what was written. With `pool`, the
    files are the pool's (reused across calls)."""

    owner: int
    threshold: int
    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    pool: Pool | None = None
    lent: list[Borrowed] = field(default_factory=list)  # a worker's: its call's argument files

    def put(self, buf: memoryview) -> str | None:
        """Copy `buf` (C-contiguous bytes) into a shared-memory file; its name, or None when
        no file can be written (a full tmpfs): the caller sends `buf` through the socket.
        A worker writes a result into an argument file of its caller's pool that nothing
        views any more (one copy into pages already there), else into a new file."""
        view = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
        try:
            name = self._write(view)
        except OSError as e:
            _say_full(e, view.nbytes)
            return None
        self.names.append(name)
        self.nbytes += view.nbytes
        return name

    def _write(self, view: memoryview) -> str:
        spare = next((b for b in self.lent if not b.used and b.mm is not None
                      and view.nbytes <= b.size <= 2 * view.nbytes and b.lease() is None), None)
        if spare is not None and spare.mm is not None:
            spare.mm[:view.nbytes] = view
            spare.used, spare.extent = True, view.nbytes
            name = spare.name
        elif self.pool is not None:
            name = self.pool.write(view)
        else:
            name = _new_file(f"{PREFIX}{self.owner}-{secrets.token_hex(8)}", view)
        return name

    def view_of(self, ptr: int, nbytes: int) -> tuple[str, int] | None:
        """(file, offset) when bytes [ptr, ptr + nbytes) lie in an argument file this
        worker mapped: the result can name that file instead of copying (see settle())."""
        for b in self.lent:
            if b.mm is not None and b.base <= ptr and ptr + nbytes <= b.base + b.size:
                b.used = True
                b.extent = max(b.extent, ptr - b.base + nbytes)
                self.names.append(b.name)
                self.nbytes += nbytes
                return b.name, ptr - b.base
        return None


def mark(name: str, nbytes: int, offset: int, readonly: bool) -> bytes:
    """The frame that stands for an out-of-band buffer written to (or lying in) file
    `name` at `offset`; far shorter than any real out-of-band frame."""
    return b"%s%s %d %d %d" % (MARK, name.encode(), nbytes, offset, readonly)


def marked(frame: Any) -> tuple[str, int, int, bool]:
    """(name, nbytes, offset, readonly) of a `mark` frame, checked."""
    raw = bytes(frame)
    try:
        if not raw.startswith(MARK):
            raise ValueError("no mark")
        name, nbytes, offset, readonly = raw[len(MARK):].decode().split(" ")
        out = name, int(nbytes), int(offset), readonly == "1"
    except ValueError:
        raise SerializationError(f"a payload frame of {len(raw)} bytes is neither a buffer nor "
                                 "a shared-memory mark: a peer of another gpufn version? "
                                 "Run one gpufn version on every process.") from None
    if out[1] < 0 or out[2] < 0:
        raise SerializationError(f"a shared-memory mark with a negative size: {raw!r}")
    return out


_said_full = 0.0


def _say_full(e: OSError, nbytes: int) -> None:
    """A payload file could not be written: said at most once a minute per process."""
    global _said_full
    now = time.monotonic()
    if now - _said_full >= 60.0 or not _said_full:
        _said_full = now
        log.warning("shared memory in %s could not take %d bytes (%s); sending them through "
                    "the socket instead (free space there, or give GPUFN_SHM_DIR a larger "
                    "tmpfs)", SHM_DIR, nbytes, e.strerror or e)

@dataclass(slots=True)
class Borrowed:
    """A pooled argument file a worker mapped for a call (`borrowing()`): the views its
    tensors hold (`lease`), and whether the call's result names it (`used`)."""

    name: str
    mm: mmap.mmap | None
    lease: weakref.ref[Any]
    base: int
    size: int
    used: bool = False
    extent: int = 0  # bytes of it the result covers


def _new_file(name: str, view: memoryview, size: int = 0) -> str:
    """A new file holding `view` (its length `size` when larger); its name."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if size > view.nbytes:  # the tail's pages now (the write takes the rest's): a
            os.posix_fallocate(fd, view.nbytes, size - view.nbytes)  # reuse cannot fault
        write_all(fd, view)
    except BaseException:
        os.close(fd)
        release([name])
        raise
    os.close(fd)
    return name


def write_all(fd: int, view: memoryview, offset: int = 0) -> None:
    """Copy `view` into the file at `offset` with pwrite: one copy, and a fresh tmpfs file
    allocates its pages inside the write (about half the cost of mapping the new file,
    faulting its pages in and unmapping it again)."""
    n = 0
    while n < view.nbytes:
        n += os.pwrite(fd, view[n:], offset + n)


def take(name: str, nbytes: int) -> Any:
    """Map a payload file (read-write, private to this process's view) and unlink it: the
    memory lives as long as the mapping. A pooled file is not unlinked (its owner reuses
    or removes it); the mapping is noted for `borrowing()`."""
    if os.sep in name or not name.startswith(PREFIX):
        raise ValueError(f"not a gpufn shared-memory name: {name!r}")
    path = os.path.join(SHM_DIR, name)
    pooled = _is_pooled(name)
    p = _pool
    if pooled and p is not None and p.pid == os.getpid() and _owner(name) == p.pid:
        return p.view(name, nbytes)  # a result in a file of this caller's own pool
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS)  # its pages mapped at once
    finally:
        os.close(fd)
        if not pooled:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if not pooled:
        return mm
    lent = getattr(_borrowed, "names", None)
    if lent is not None:  # a worker reading a call's arguments
        import numpy as np

        arr = np.frombuffer(mm, dtype=np.uint8) if nbytes else np.empty(0, np.uint8)
        lent.append(Borrowed(name, mm, weakref.ref(arr), int(arr.ctypes.data), nbytes))
        return arr
    return mm


def _is_pooled(name: str) -> bool:
    return name[len(PREFIX):].partition("-")[2].startswith(POOLED)


def _owner(name: str) -> int:
    try:
        return int(name[len(PREFIX):].partition("-")[0])
    except ValueError:
        return -1


_borrowed = threading.local()


class borrowing:
    """Collect the pooled files that `take()` maps in this thread while the block runs
    (a worker unpickling a call's arguments); `settle()` says which are no longer used.
    A class, not a generator: it runs once per call on a worker, where a generator-based
    context manager was ~0.8 of a no-op call's ~10 us in the executor."""

    __slots__ = ("lent", "outer")

    def __enter__(self) -> list[Borrowed]:
        self.lent: list[Borrowed] = []
        self.outer = getattr(_borrowed, "names", None)
        _borrowed.names = self.lent
        return self.lent

    def __exit__(self, *exc: object) -> None:
        _borrowed.names = self.outer


def settle(lent: list[Borrowed], out: Outgoing | None, frames: list[Any]) -> list[str]:
    """After a worker dropped a call's arguments and result: the borrowed files it no
    longer maps (their owner may write them again). A file the result names but that a
    view outlived (the function kept its argument) is sent as a copy made now, under a
    name of the same length written over the old one in `frames` (the stream and the
    marks), since its owner's data must not change under that view."""
    for b in lent:
        if b.used and b.lease() is not None and b.mm is not None and out is not None:
            owner = b.name[len(PREFIX):].partition("-")[0]
            copy = f"{PREFIX}{owner}-{COPIED}{secrets.token_hex(8)}"  # as long as b.name
            _new_file(copy, memoryview(b.mm)[:b.extent])
            old, new = b.name.encode(), copy.encode()
            for i, f in enumerate(frames):
                if i == 0 or (len(f) < 1024 and bytes(f[:len(MARK)]) == MARK):
                    frames[i] = bytes(f).replace(old, new)
            out.names = [copy if n == b.name else n for n in out.names]
            b.used = False
    freed = [b.name for b in lent if not b.used and b.lease() is None]
    for b in lent:
        b.mm = None  # what still views it keeps the mapping
    return freed


def release(names: Iterable[str], reuse: Iterable[str] = ()) -> None:
    """Remove payload files that no receiver took (already taken ones are gone); this
    process's pooled files go back to its pool when named in `reuse` (the receiver said
    it let go of them), else they are removed too."""
    keep = set(reuse)
    for name in names:
        if _is_pooled(name) and _owner(name) != os.getpid():
            continue  # another process's pool: its owner removes it (or the sweep)
        if _pool is not None and _pool.pid == os.getpid() and _pool.done(name, name in keep):
            continue
        _unlink(name)


def hold(names: Iterable[str]) -> None:
    """Results name these files of this process's pool: keep them until they are read."""
    for name in names:
        if _pool is not None and _pool.pid == os.getpid():
            _pool.hold(name)


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except (FileNotFoundError, NotADirectoryError):
        pass


_sweep_lock = threading.Lock()


def sweep(owner: int | None = None) -> int:
    """Remove the payload files of dead owners (or, with `owner`, all of that one's);
    how many were removed."""
    n = 0
    with _sweep_lock:
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return 0
        for name in names:
            if not name.startswith(PREFIX):
                continue
            pid = _owner(name)
            if pid < 0:
                continue
            if (pid == owner) if owner is not None else not alive(pid):
                _unlink(name)
                n += 1
    return n


def owned(names: Any) -> list[str]:
    """The names in a Result's `meta.shm` (what a peer said it wrote), checked."""
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and n.startswith(PREFIX) and os.sep not in n]


@dataclass(slots=True)
class _Segment:
    name: str
    size: int
    mm: mmap.mmap | None = None  # this process's mapping, made when first needed
    idle_since: float = 0.0
    busy: bool = True  # lent to a call as its argument
    views: int = 0  # this process's result values that view it (a worker sent it back)
    holds: int = 0  # results that name it, not read yet
    reuse: bool = True  # written again once nothing uses it; else removed then


class Pool:
    """A caller's argument files kept for reuse: a big argument is copied into a free one
    at least as large (and at most twice) instead of a new file. A file is free again
    only when its call's worker let go of it (`done(name, True)`) and no result of this
    process views it; at most `cap` bytes are kept free, each for POOL_IDLE_S."""

    def __init__(self, cap: int, idle_s: float = POOL_IDLE_S) -> None:
        self.cap, self.idle_s = cap, idle_s
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._free: list[_Segment] = []
        self._used: dict[str, _Segment] = {}  # busy, viewed or held
        self._timer: threading.Timer | None = None

    def write(self, view: memoryview) -> str:
        """A pooled file holding `view`; its name (busy until `done`)."""
        n = view.nbytes
        with self._lock:
            fits = [s for s in self._free if n <= s.size <= 2 * n]
            seg = min(fits, key=lambda s: s.size) if fits else None
            if seg is not None:
                self._free.remove(seg)
        if seg is not None:
            try:
                self._mapped(seg)[:n] = view  # one copy, into pages already there
            except OSError:  # removed under us (a sweep): a new file instead
                self._forget(seg, unlink=True)
                seg = None
        if seg is None:
            size = -(-n // 2**20) * 2**20  # room for a slightly larger argument next time
            seg = _Segment(_new_file(f"{PREFIX}{self.pid}-{POOLED}{secrets.token_hex(8)}",
                                     view, size), size)
        with self._lock:
            seg.busy, seg.reuse = True, True
            self._used[seg.name] = seg
        return seg.name

    def owns(self, name: str) -> bool:
        with self._lock:
            return name in self._used

    def done(self, name: str, reuse: bool) -> bool:
        """The call that used `name` as an argument ended: keep it for reuse (its worker
        let go of it), or remove it. False when `name` is not this pool's."""
        with self._lock:
            seg = self._used.get(name)
            if seg is None:
                return any(s.name == name for s in self._free)
            seg.busy = False
            seg.reuse = seg.reuse and reuse
        self._settle(seg)
        return True

    def hold(self, name: str) -> bool:
        """A result names `name` and will be read: keep it until then (`view`)."""
        with self._lock:
            seg = self._used.get(name)
            if seg is not None:
                seg.holds += 1
            return seg is not None

    def view(self, name: str, nbytes: int) -> Any:
        """A result's bytes in a file of this pool: an array over this process's mapping,
        the file in use until the array (and every tensor over it) is gone."""
        import numpy as np

        with self._lock:
            seg = self._used.get(name)
            if seg is None or not (seg.busy or seg.views or seg.holds):
                raise FileNotFoundError(f"shared-memory result {name} was already read and "
                                        "its memory reused")
            if seg.holds:
                seg.holds -= 1
            seg.views += 1
        try:
            arr = np.frombuffer(self._mapped(seg), dtype=np.uint8, count=nbytes)
        except BaseException:
            self._unview(seg)
            raise
        weakref.finalize(arr, self._unview, seg)
        return arr

    def _mapped(self, seg: _Segment) -> mmap.mmap:
        if seg.mm is None:
            fd = os.open(os.path.join(SHM_DIR, seg.name), os.O_RDWR)
            try:
                seg.mm = mmap.mmap(fd, seg.size, flags=_MAP_FLAGS)
            finally:
                os.close(fd)
        return seg.mm

    def _unview(self, seg: _Segment) -> None:
        with self._lock:
            seg.views -= 1
        self._settle(seg)

    def _settle(self, seg: _Segment) -> None:
        """Free or remove `seg` once nothing uses it."""
        with self._lock:
            if seg.busy or seg.views or seg.holds or self._used.get(seg.name) is not seg:
                return
            del self._used[seg.name]
            free = sum(s.size for s in self._free)
            keep = seg.reuse and os.getpid() == self.pid and free + seg.size <= self.cap
            if keep:
                seg.idle_since = time.monotonic()
                self._free.append(seg)
                self._arm()
        if not keep:
            self._forget(seg, unlink=True)

    def clear(self) -> None:
        """Remove every free file (ones in use go when nothing uses them)."""
        with self._lock:
            free, self._free = self._free, []
        for seg in free:
            self._forget(seg, unlink=True)

    def free_names(self) -> list[str]:
        with self._lock:
            return [s.name for s in self._free]

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._timer = None
            old = [s for s in self._free if now - s.idle_since >= self.idle_s]
            self._free = [s for s in self._free if s not in old]
            self._arm()
        for seg in old:
            self._forget(seg, unlink=True)

    def _arm(self) -> None:  # with the lock held
        if self._timer is None and self._free:
            wait = max(0.0, min(s.idle_since for s in self._free) + self.idle_s - time.monotonic())
            self._timer = threading.Timer(wait + 0.01, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _forget(self, seg: _Segment, unlink: bool) -> None:
        if seg.mm is not None:
            try:
                seg.mm.close()
            except BufferError:  # still viewed here: the mapping goes with its last view
                pass
            seg.mm = None
        if unlink and os.getpid() == self.pid:
            try:
                os.unlink(os.path.join(SHM_DIR, seg.name))
            except FileNotFoundError:
                pass


_pool: Pool | None = None
_pool_lock = threading.Lock()


def pool() -> Pool | None:
    """This process's pool of argument files (None with GPUFN_SHM_POOL=0)."""
    global _pool
    if _pool is None or _pool.pid != os.getpid():  # a forked child starts its own
        with _pool_lock:
            if _pool is None or _pool.pid != os.getpid():
                cap = config.shm_pool_bytes()
                _pool = Pool(cap) if cap > 0 else None
    return _pool
