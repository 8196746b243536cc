"""Process groups for gangs inside a worker: join the scheduler's rendezvous, reuse, abort, leave.

A worker process is in at most one gang at a time, so the gang's group is torch's
*default* process group: user code calls `dist.all_reduce(t)` without a group argument,
and `DeviceMesh`, `parallelize_module` and `torch.distributed.pipelining` find it where
they expect it. The group is kept between calls (warm reuse) and replaced only when the
scheduler hands out a different gang or a new generation of the same gang.

Rendezvous: the scheduler hosts one long-lived `TCPStore` (`host_store`, port 0); each
gang generation gets its own key space `gpufn/{gang_id}/{generation}` through a
`PrefixStore`, so no two formations can see each other's keys. After any failure the
scheduler bumps the generation, which makes every rank re-join a fresh group.

Abort (`GroupManager.abort`, callable from any thread while a collective is blocked):

* NCCL: `distributed_c10d._abort_process_group()` (ncclCommAbort on every communicator,
  which also ends kernels and waits blocked in this process). Workers default to
  `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (clean up, keep the process), so a collective that
  runs past `timeout_s` aborts its communicator instead of killing the worker.
* gloo: torch's gloo backend has no abort (`abort()`/`shutdown()` are no-ops in 2.13) and
  only closes its sockets in its destructor, which any lingering reference (a DeviceMesh,
  a DTensor model) delays; a blocked collective would wait for its full timeout. So the
  manager records the TCP sockets the backend opened during `init_process_group` and, on
  abort, `shutdown(SHUT_RD)`s the connected ones (never the listener, never closes an fd
  it does not own), holding a duplicate of each for `HOLD_SECONDS`. gloo's loop then
  reads EOF on each, fails every op posted on it ("Connection closed by peer") and
  closes its fd; the held duplicate keeps the connection itself open meanwhile. Every
  other rank is aborted by the scheduler and does the same; when the hold ends, the
  connections close, which also ends a peer's collective that no abort reached.

  Why only the reading side, and why the hold: a gloo bug (torch 2.13's, and gloo's main
  today). A send of an unbound buffer whose write fails (EPIPE, ECONNRESET) is queued, and
  the pair's failure never fails queued sends, so that collective waits for the gang's
  whole timeout and the scheduler kills the worker 10 s after its abort. A write fails so
  when this side shut its writing side down, or when the peer's socket is closed (its
  kernel resets what arrives). While the hold lasts, a send of any rank's gloo thread
  still under way (posted just before its abort) finds both ends open and completes. The
  breaker loop of `bench/gang_abort.py` (gangs whose rank 0 raises while the others enter
  an all_reduce) left a worker stuck in 3.3-5.3% of gangs with `SHUT_RDWR` and no hold.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from gpufn.exceptions import Cancelled, GpufnError
from gpufn.runtime.context import mesh_for
from gpufn.wire.rendezvous import (
    DEFAULT_TIMEOUT_S,
    ENV_BACKEND,
    GangSpec,
    host_store,
    resolve_backend,
)

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

log = logging.getLogger("gpufn.groups")


__all__ = ["DEFAULT_TIMEOUT_S", "ENV_BACKEND", "GangAborted", "GangSpec", "GroupManager",
           "host_store", "mesh_for", "resolve_backend"]

# Set (unless the user already did) before an NCCL group is created: on a collective
# error or timeout, abort the communicators but keep the worker process alive.
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


class GangAborted(GpufnError):
    """The gang's process group was torn down (a rank failed, or the scheduler aborted it)."""


# --------------------------------------------------------------------------- sockets


def _socket_fds() -> dict[int, str]:
    """This process's socket fds -> "socket:[inode]" (Linux /proc; {} elsewhere)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def _shutdown_sockets(fds: dict[int, str]) -> list[int]:
    """shutdown(SHUT_RD) the connected TCP sockets among `fds` still open as recorded.

    Never closes an fd (the owner does); skips listeners (gloo's accept loop aborts the
    process on an error there) and any fd that was since reused for another socket.
    Returns a duplicate fd of each socket shut down, which keeps the connection open
    after its owner closes its fd: the caller closes them (`_close_later`).
    """
    held: list[int] = []
    for fd, inode in fds.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != inode:
                continue
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            try:
                held.append(os.dup(fd))
            except OSError:  # no fd left: shut it down all the same
                pass
            s.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        finally:
            s.detach()
    return held


# How long an aborted group's connections stay open after their reading side was shut
# down: long enough for every rank to take the scheduler's abort (see the module doc).
HOLD_SECONDS = 2.0


# The held duplicates of this process, oldest first, and how many may be held at once:
# aborts in a fast loop of a wide gang must not run the worker out of descriptors, so
# past the bound the oldest are closed early (each fd is closed once, under the lock).
HELD_MAX = 256
_held: collections.deque[int] = collections.deque()
_held_lock = threading.Lock()


def _close_later(fds: list[int], seconds: float) -> None:
    """Close `fds` after `seconds`, on a daemon timer (at once for 0), or earlier when
    more than HELD_MAX are held."""
    with _held_lock:
        _held.extend(fds)
        while len(_held) > HELD_MAX:
            _close_quietly(_held.popleft())
    if seconds <= 0:
        _release(fds)
        return
    timer = threading.Timer(seconds, _release, args=(fds,))
    timer.daemon = True
    timer.start()


def _release(fds: list[int]) -> None:
    with _held_lock:
        for fd in fds:
            try:
                _held.remove(fd)
            except ValueError:  # closed early by the bound
                continue
            _close_quietly(fd)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# --------------------------------------------------------------------------- manager


class GroupManager:
    """The gang process group of one worker process (torch's default group).

    `ensure` runs in the call's thread before the function; `abort` may come from any
    thread (the worker's I/O loop on the scheduler's order) and never waits for a
    collective to finish; `leave` is the clean path when the scheduler re-gangs.
    """

    def __init__(self) -> None:
        self.inits = 0  # init_process_group calls made by this process
        self.connects = 0  # connections made to the scheduler's store
        self.last_init_s = 0.0  # seconds the last join took (store connect + init)
        self.current: GangSpec | None = None
        self._pg: ProcessGroup | None = None
        self._store: Any = None
        # The connection to the scheduler's store, kept across joins: connecting costs a
        # reverse DNS lookup in torch (its socket's name for logs), which waited 5 s for a
        # DNS server that did not answer in ~1% of re-joins on a machine without network.
        self._client: tuple[tuple[str, int], Any] | None = None
        self._fds: dict[int, str] = {}  # gloo sockets opened by the last init
        self._lock = threading.RLock()
        self._abort_epoch = 0
        self._joining: GangSpec | None = None
        self.last_abort: str = ""

    # ------------------------------------------------------------------ join

    def ensure(self, gang: GangSpec, device: torch.device) -> ProcessGroup:
        """The group for `gang`: the warm one if it is the same, else a freshly joined one.

        Blocks until every rank has joined (at most `gang.timeout_s`). Raises GangAborted
        if `abort` is called meanwhile, or if the warm group was destroyed behind our back.
        """
        import torch.distributed as dist

        with self._lock:
            if gang.same_group(self.current) and self._pg is not None:
                if dist.is_initialized() and dist.group.WORLD is self._pg:
                    return self._pg
                self._forget()
                raise GangAborted(
                    f"the process group of gang {gang.gang_id} (generation {gang.generation}) "
                    "was destroyed by code outside gpufn; the gang must re-form"
                )
            if self.current is not None or dist.is_initialized():
                self._leave_locked()
            epoch = self._abort_epoch
            self._joining = gang

        try:
            pg, store, fds, seconds = self._join(gang, device)
        except BaseException:
            with self._lock:
                self._joining = None
                self._client = None  # a broken connection is not kept: the next join connects
            self._drop_world()  # a half-made default group would block the next join
            raise

        with self._lock:
            self._joining = None
            self.inits += 1
            self.last_init_s = seconds
            self._pg, self._store, self._fds, self.current = pg, store, fds, gang
            if self._abort_epoch != epoch:
                reason = self.last_abort
                self._abort_locked(reason)
                raise GangAborted(f"gang {gang.gang_id} was aborted while joining: {reason}")
        log.info(
            "joined gang %s gen %d as rank %d/%d (%s) in %.3fs", gang.gang_id, gang.generation,
            gang.rank, gang.world_size, gang.backend, seconds,
        )
        return pg

    def _store_client(self, gang: GangSpec, timeout: timedelta) -> Any:
        """The client of the scheduler's store at the gang's address: the one kept from an
        earlier join if it is the same address, else a new one (kept for the next)."""
        import torch.distributed as dist

        where = (gang.store_host, gang.store_port)
        if self._client is not None and self._client[0] == where:
            store = self._client[1]
            try:  # one round trip: a store restarted on the same port broke this connection
                store.check(["gpufn/alive"])
            except Exception as e:
                log.info("reconnecting to the gang store at %s:%s (%s)", *where, type(e).__name__)
            else:
                store.set_timeout(timeout)
                return store
        self._client = None
        store = dist.TCPStore(gang.store_host, gang.store_port, is_master=False, timeout=timeout)
        self.connects += 1
        self._client = (where, store)
        return store

    def _join(
        self, gang: GangSpec, device: torch.device
    ) -> tuple[ProcessGroup, Any, dict[int, str], float]:
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        t0 = time.perf_counter()
        timeout = timedelta(seconds=gang.timeout_s)
        device = torch.device(device)
        cuda = device.type == "cuda"
        if "nccl" in gang.backend:
            for k, v in NCCL_ENV_DEFAULTS.items():
                os.environ.setdefault(k, v)
        if cuda:
            torch.cuda.set_device(device)
        store = self._store_client(gang, timeout)
        prefix = dist.PrefixStore(gang.prefix, store)
        track = gang.backend == "gloo"
        before = _socket_fds() if track else {}
        hook = sys.excepthook
        # The default group's name is str(_world.group_count), which a failed init leaves
        # incremented; ranks whose counters differ would rendezvous under different keys
        # and hang until the timeout. Nothing else is initialized here, so start at 0.
        if not dist.is_initialized() and hasattr(c10d, "_world"):
            c10d._world.group_count = 0
        try:
            dist.init_process_group(
                backend=gang.backend, store=prefix, rank=gang.rank,
                world_size=gang.world_size, timeout=timeout,
                device_id=device if cuda and "nccl" in gang.backend else None,
            )
        finally:
            # init_process_group wraps sys.excepthook with a "[rankN]" prefix each time;
            # after many re-gangs that would nest (with stale ranks). Keep the worker's.
            sys.excepthook = hook
        fds = {}
        if track:
            fds = {fd: ino for fd, ino in _socket_fds().items() if before.get(fd) != ino}
        pg = dist.group.WORLD
        assert pg is not None
        return pg, store, fds, time.perf_counter() - t0

    # ------------------------------------------------------------------ teardown

    def abort(
        self, reason: str, *, gang_id: str | None = None, generation: int | None = None
    ) -> None:
        """Tear the group down now; blocked collectives here and on peers end with an error.

        Safe from any thread, also while a collective is blocked in this process or a
        join is in progress (that join then raises GangAborted), and idempotent. Tensors
        and models stay intact; the next `ensure` joins afresh. With `gang_id` (and
        `generation`), an order meant for another formation (a stale message) is ignored.
        """
        with self._lock:
            if gang_id is not None:
                target = self._joining or self.current
                if target is None or target.gang_id != gang_id or (
                    generation is not None and target.generation != generation
                ):
                    log.info("ignoring abort for gang %s gen %s: not ours", gang_id, generation)
                    return
            self._abort_epoch += 1
            self.last_abort = reason
            self._abort_locked(reason)

    def _abort_locked(self, reason: str) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        gang, pg = self.current, self._pg
        if gang is None and pg is None:
            return
        backend = gang.backend if gang is not None else ""
        log.warning(
            "aborting gang %s gen %s: %s",
            gang.gang_id if gang else "?", gang.generation if gang else "?", reason,
        )
        try:
            # gloo: make blocked ops here fail at once, and keep the connections open a
            # while (see module doc). Done while we still hold the group, so its fds
            # cannot have been closed.
            _close_later(_shutdown_sockets(self._fds), HOLD_SECONDS)
            if pg is not None and dist.is_initialized() and dist.group.WORLD is pg:
                if "nccl" in backend:
                    c10d._abort_process_group()  # ncclCommAbort on all comms, clears _world
                else:
                    dist.destroy_process_group()
        except Exception as e:  # never let teardown take the worker down
            log.warning("abort of gang %s: %s: %s", gang.gang_id if gang else "?",
                        type(e).__name__, e)
            self._drop_world()
        finally:
            self._forget()

    def leave(self) -> None:
        """Destroy the group cleanly (the scheduler moved this worker to another gang)."""
        with self._lock:
            self._leave_locked()

    def _leave_locked(self) -> None:
        import torch.distributed as dist

        gang, pg = self.current, self._pg
        try:
            if dist.is_initialized():
                if pg is not None and dist.group.WORLD is not pg:
                    log.warning("a process group gpufn did not create was active; destroying it")
                dist.destroy_process_group()
        except Exception as e:
            log.warning("leaving gang %s failed (%s: %s); aborting it instead",
                        gang.gang_id if gang else "?", type(e).__name__, e)
            _close_later(_shutdown_sockets(self._fds), HOLD_SECONDS)
            self._drop_world()
        finally:
            self._forget()

    def _forget(self) -> None:
        self.current = None
        self._pg = None
        self._store = None
        self._fds = {}

    @staticmethod
    def _drop_world() -> None:
        """Last resort: make torch forget the default group so a new one can be created."""
        from torch.distributed import distributed_c10d as c10d

        try:
            if c10d.GroupMember.WORLD is not None:
                c10d._abort_process_group()
        except Exception:
            try:
                c10d._update_default_pg(None)
                c10d._world.pg_map.clear()
                c10d._world.pg_names.clear()
                c10d._world.pg_group_ranks.clear()
                c10d._world.pg_backend_config.clear()
                c10d._world.group_count = 0
            except Exception:
                pass


_COMM_MARKERS = ("gloo", "NCCL", "nccl", "Connection closed by peer", "Connection reset by peer",
                 "ProcessGroup", "process group")


def is_comm_error(exc: BaseException) -> bool:
    """A failure caused by a peer rank going away (its abort, its death), not by this rank."""
    if isinstance(exc, Cancelled) or type(exc).__name__ in (
            "GangAborted", "DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_MARKERS)
