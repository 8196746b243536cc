"""The result cache of `@gpu(cache=True | "path")`: results on a (shared) filesystem, keyed
by the function's code hash and the call's argument hash; identical calls run once.

It works in the client, before a call is submitted, so a hit never consumes a device and
the scheduler never sees (or unpickles) a cached value. The store is a directory that is
safe across processes and hosts on a shared filesystem (NFS included): a result is written
to a temporary file and renamed into place (atomic), and a call about to be computed is
*claimed* by creating `<key>.claim` with O_EXCL. Whoever holds the claim computes; every
other caller of the same key, in any process on any host, waits for the result file.
A claim is kept alive by its owner touching it; one whose lease expired (not touched for
`LEASE_S`, wherever its owner was) is broken and the call is claimed anew, and so is one
whose owner on this host is gone (its pid is not running) at once. So a re-run after a
kill computes exactly the results that are missing, and a claim whose pid was reused by
an unrelated process (or came from another container with the same host name) holds no
waiter longer than the lease.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import struct
import threading
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufn.net.processes import alive
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser

LEASE_S = 30.0  # a claim not touched for this long is stale, wherever its owner is
TOUCH_S = 5.0  # how often an owner touches its claims
_MAGIC = b"GPUFNR1\n"
_HOST = socket.gethostname()

Submit = Callable[[], tuple[str, "Future[p.Result]"]]


# --------------------------------------------------------------------------- keys


def code_digest(fn: Any, extra: Sequence[str] = ()) -> str:
    """A hash of what a function computes: its qualified name, bytecode, constants and names
    (nested functions included), defaults and plain closure values. Not its file's other
    lines or line numbers, so editing the rest of a script keeps its cached results."""
    h = hashlib.blake2b(digest_size=16)

    def put(s: str | bytes) -> None:
        b = s.encode() if isinstance(s, str) else s
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    def const(c: Any) -> str:
        if isinstance(c, frozenset):  # its order depends on the hash seed
            return "frozenset(" + ",".join(sorted(const(x) for x in c)) + ")"
        if isinstance(c, tuple):
            return "(" + ",".join(const(x) for x in c) + ")"
        return repr(c) if isinstance(c, (int, float, complex, str, bytes, bool, type(None))) \
            else type(c).__qualname__

    def walk(code: types.CodeType) -> None:
        put(code.co_qualname if hasattr(code, "co_qualname") else code.co_name)
        put(code.co_code)
        put(",".join(code.co_names))
        put(",".join(code.co_varnames))
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                walk(c)
            else:
                put(const(c))

    target = getattr(fn, "__gpufn_target__", fn)
    put(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}")
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType):
        walk(code)
        put(const(getattr(target, "__defaults__", None)))
        put(const(tuple(sorted((getattr(target, "__kwdefaults__", None) or {}).items()))))
        for cell in getattr(target, "__closure__", None) or ():
            try:
                put(const(cell.cell_contents))
            except ValueError:  # an empty cell
                put("<empty>")
    else:  # a callable object: its pickled bytes
        put(ser.content_hash(*ser.dumps(target)))
    for e in extra:
        put(e)
    return h.hexdigest()


def argument_key(code_key: str, frames: Sequence[Any]) -> str:
    """The cache key of one call: the code key and the hash of its pickled argument frames."""
    parts = [bytes(memoryview(f.buffer if hasattr(f, "buffer") else f)) for f in frames]
    return ser.content_hash(code_key.encode(), *parts)


# --------------------------------------------------------------------------- the store


def _as_bytes(f: Any) -> memoryview:
    return memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B")


class Store:
    """Results and claims in one directory, shared by every process and host that uses it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.owned: dict[str, str] = {}  # key -> token of the claims this process holds
        self._lock = threading.Lock()

    def _path(self, key: str, suffix: str) -> Path:
        return self.root / key[:2] / f"{key}{suffix}"

    def read(self, key: str) -> list[bytes] | None:
        """The stored result frames of `key`, or None."""
        try:
            data = self._path(key, ".result").read_bytes()
        except FileNotFoundError:
            return None
        if not data.startswith(_MAGIC):
            return None
        view, at = memoryview(data), len(_MAGIC)
        (n,) = struct.unpack_from("<I", view, at)
        at += 4
        frames = []
        for _ in range(n):
            (size,) = struct.unpack_from("<Q", view, at)
            at += 8
            frames.append(bytes(view[at:at + size]))
            at += size
        return frames

    def write(self, key: str, frames: Sequence[Any]) -> None:
        """Store a result: written beside its place, then renamed into it (atomic)."""
        final = self._path(key, ".result")
        final.parent.mkdir(exist_ok=True)
        tmp = final.with_name(f"{final.name}.{secrets.token_hex(6)}.tmp")
        views = [_as_bytes(f) for f in frames]
        with open(tmp, "wb") as out:
            out.write(_MAGIC + struct.pack("<I", len(views)))
            for v in views:
                out.write(struct.pack("<Q", v.nbytes))
                out.write(v)
        os.replace(tmp, final)

    def claim(self, key: str) -> bool:
        """Take the right to compute `key`; False while a live owner holds it."""
        path = self._path(key, ".claim")
        path.parent.mkdir(exist_ok=True)
        token = secrets.token_hex(8)
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._break_if_stale(path):
                    return False
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"host": _HOST, "pid": os.getpid(), "token": token}, f)
            with self._lock:
                self.owned[key] = token
            return True
        return False

    def release(self, key: str) -> None:
        with self._lock:
            token = self.owned.pop(key, None)
        if token is not None and self._owner(self._path(key, ".claim")).get("token") == token:
            self._path(key, ".claim").unlink(missing_ok=True)

    def claimed(self, key: str) -> bool:
        """Whether a live owner holds `key` (a stale claim is broken here)."""
        path = self._path(key, ".claim")
        return path.exists() and not self._break_if_stale(path)

    def touch_owned(self) -> None:
        with self._lock:
            keys = list(self.owned)
        for key in keys:
            try:
                os.utime(self._path(key, ".claim"))
            except OSError:
                pass

    @staticmethod
    def _owner(path: Path) -> dict[str, Any]:
        try:
            owner = json.loads(path.read_text())
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}

    def _break_if_stale(self, path: Path) -> bool:
        """Remove a claim whose owner is gone; True if it is gone now."""
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return True
        owner = self._owner(path)
        # The lease holds everywhere: a live pid on this host may be another process that
        # reused the number, or a process of another container with the same host name.
        stale = age > LEASE_S if owner else age > LEASE_S / 3  # (still being written)
        if not stale and owner.get("host") == _HOST and isinstance(owner.get("pid"), int):
            stale = not alive(owner["pid"])  # gone from this host: no need to wait
        if not stale:
            return False
        # Rename first: of several breakers only one wins, and none removes a new claim.
        grave = path.with_name(f"{path.name}.{secrets.token_hex(6)}.stale")
        try:
            os.rename(path, grave)
            grave.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        return True


# --------------------------------------------------------------------------- the calls


@dataclass
class CacheStats:
    """What a function's cache did in this process."""

    hits: int = 0  # results read from the store
    computed: int = 0  # calls this process submitted
    waited: int = 0  # results another caller (here or elsewhere) was computing

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "computed": self.computed, "waited": self.waited}


def _hit(key: str, frames: list[bytes]) -> p.Result:
    return p.Result(f"cache-{key[:16]}", True, "", "", p.ResultMeta(duration=0.0), tuple(frames))


class ResultCache:
    """One function's cache: lookups, single-flight claims and waits for one code key."""

    _stores: dict[str, Store] = {}
    _stores_lock = threading.Lock()

    def __init__(self, root: str | Path, code_key: str) -> None:
        root = Path(root).expanduser().resolve()
        with ResultCache._stores_lock:  # one store (and claim book) per directory per process
            store = ResultCache._stores.get(str(root))
            if store is None:
                store = ResultCache._stores[str(root)] = Store(root)
        self.store = store
        self.code_key = code_key
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._local: dict[str, Future[p.Result]] = {}  # keys this process is resolving
        self._waiting: dict[str, Submit] = {}  # keys another caller holds
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def key(self, frames: Sequence[Any]) -> str:
        return argument_key(self.code_key, frames)

    def call(self, frames: Sequence[Any], submit: Submit) -> tuple[str, Future[p.Result]]:
        """(an id, a future of the Result) for a call with these argument frames: the stored
        result, the result of an identical call in flight anywhere, or `submit()`'s."""
        key = self.key(frames)
        with self._lock:
            fut = self._local.get(key)
            if fut is not None:  # the same call is already being resolved in this process
                self.stats.waited += 1
                return f"cache-{key[:16]}", _follow(fut)
            fut = self._local[key] = Future()
        fut.add_done_callback(lambda _f: self._forget(key))
        return self._resolve(key, fut, submit), fut

    def _forget(self, key: str) -> None:
        with self._lock:
            self._local.pop(key, None)

    def _resolve(self, key: str, fut: Future[p.Result], submit: Submit) -> str:
        frames = self.store.read(key)
        if frames is not None:
            self.stats.hits += 1
            fut.set_result(_hit(key, frames))
            return f"cache-{key[:16]}"
        if self.store.claim(key):
            frames = self.store.read(key)  # stored between the read and the claim
            if frames is not None:
                self.store.release(key)
                self.stats.hits += 1
                fut.set_result(_hit(key, frames))
                return f"cache-{key[:16]}"
            return self._compute(key, fut, submit)
        with self._lock:
            self._waiting[key] = submit
        self._ensure_thread()
        self._wake.set()
        return f"cache-{key[:16]}"

    def _compute(self, key: str, fut: Future[p.Result], submit: Submit) -> str:
        self.stats.computed += 1
        self._ensure_thread()  # it touches the claim while the call runs
        try:
            inv, call = submit()
        except BaseException as e:
            self.store.release(key)
            fut.set_exception(e)
            raise
        call.add_done_callback(lambda c: self._computed(key, fut, c))
        return inv

    def _computed(self, key: str, fut: Future[p.Result], call: Future[p.Result]) -> None:
        try:
            res = call.result()
        except BaseException as e:
            self.store.release(key)
            fut.set_exception(e)
            return
        try:
            if res.ok and res.meta.gather is None:
                self.store.write(key, res.frames)  # errors are not cached: they run again
        finally:
            self.store.release(key)
            fut.set_result(res)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="gpufn-cache",
                                                daemon=True)
                self._thread.start()

    def _watch(self) -> None:
        """Touch this process's claims; poll the keys others hold until their result
        appears (a hit) or their claim goes away without one (then compute here)."""
        delay, last_touch = 0.01, 0.0
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            now = time.monotonic()
            if now - last_touch > TOUCH_S:
                self.store.touch_owned()
                last_touch = now
            with self._lock:
                waiting = list(self._waiting.items())
            progressed = False
            for key, submit in waiting:
                fut = self._local.get(key)
                frames = self.store.read(key)
                if fut is None or fut.done():
                    self._drop_waiting(key)
                elif frames is not None:
                    self._drop_waiting(key)
                    self.stats.waited += 1
                    fut.set_result(_hit(key, frames))
                    progressed = True
                elif not self.store.claimed(key) and self.store.claim(key):
                    self._drop_waiting(key)
                    progressed = True
                    frames = self.store.read(key)  # stored between the look and the claim
                    if frames is not None:
                        self.store.release(key)
                        self.stats.waited += 1
                        fut.set_result(_hit(key, frames))
                        continue
                    try:
                        self._compute(key, fut, submit)
                    except BaseException:
                        pass  # the future carries the error
            delay = 0.01 if progressed else min(delay * 2, 0.25)

    def _drop_waiting(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)


def _follow(fut: Future[p.Result]) -> Future[p.Result]:
    """A new future completed with `fut`'s outcome (each caller gets its own)."""
    out: Future[p.Result] = Future()

    def done(f: Future[p.Result]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(f.result())

    fut.add_done_callback(done)
    return out
