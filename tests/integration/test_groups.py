"""Gang process groups with real processes: gloo, a TCPStore hosted here on port 0.

Three long-lived worker processes (spawned once for the module, like gpufn workers)
each run a `GroupManager` and obey commands over a pipe, so one test can block a rank in
a collective while another rank aborts. A worker that stops answering is replaced
before the next test; every worker is killed when the module ends or a test fails.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from gpufn.worker.groups import (
    ENV_BACKEND,
    HOLD_SECONDS,
    GangAborted,
    GangSpec,
    GroupManager,
    host_store,
    resolve_backend,
)

# 120 s: the first test also pays for spawning the three rank processes (torch imports),
# which takes a minute on two busy cores
TIMEOUT = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- worker side


def _worker_main(conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from gpufn.runtime.context import CallContext
    from gpufn.worker.groups import GroupManager, mesh_for

    mgr = GroupManager()
    device = torch.device("cpu")
    keep = torch.arange(1000, dtype=torch.float64)  # allocated before any group exists
    pinned: list[Any] = []

    def all_reduce(value: float) -> list[float]:
        t = torch.full((4,), float(value))
        dist.all_reduce(t)
        return t.tolist()

    def handle(op: str, arg: Any) -> Any:
        if op == "ping":
            return "pong"
        if op == "ensure":
            gang = GangSpec.from_wire(arg)
            pg = mgr.ensure(gang, device)
            return {"inits": mgr.inits, "rank": pg.rank(), "size": pg.size(),
                    "init_s": mgr.last_init_s,
                    "connects": mgr.connects}
        if op == "ensure_abort_while_joining":  # an abort arrives while this rank is joining
            def abort_once_joining() -> None:
                while mgr._joining is None:  # the join has begun (it cannot end without a peer)
                    time.sleep(0.005)
                mgr.abort("test: abort while joining")
                conn.send(("event", "aborted while joining", 0.0))

            threading.Thread(target=abort_once_joining, daemon=True).start()
            mgr.ensure(GangSpec.from_wire(arg), device)
            return "joined"
        if op == "all_reduce":
            return all_reduce(arg)
        if op == "all_reduce_abort_self":  # abort from another thread while blocked here
            threading.Timer(arg, mgr.abort, args=("test: abort from a thread",)).start()
            return all_reduce(1.0)
        if op == "abort_for":  # an abort order naming a gang formation
            reason, gang_id, generation = arg
            mgr.abort(reason, gang_id=gang_id, generation=generation)
            return mgr.current is not None
        if op == "abort":
            mgr.abort(arg)
            return mgr.current is None and not dist.is_initialized()
        if op == "leave":
            mgr.leave()
            return mgr.current is None and not dist.is_initialized()
        if op == "pin":  # hold the group the way a cached DeviceMesh / DTensor model would
            gang = mgr.current
            assert gang is not None
            ctx = CallContext("inv", "f", rank=gang.rank, world_size=gang.world_size,
                              device=device, group=dist.group.WORLD)
            pinned.append(mesh_for(ctx))
            return True
        if op == "mesh":
            from torch.distributed.tensor import Shard, distribute_tensor

            gang = mgr.current
            assert gang is not None
            ctx = CallContext("inv", "f", rank=gang.rank, world_size=gang.world_size,
                              device=device, group=dist.group.WORLD)
            mesh = ctx.mesh
            full = torch.arange(8, dtype=torch.float32)
            dt = distribute_tensor(full, mesh, [Shard(0)])
            return {
                "shape": list(mesh.shape), "device_type": mesh.device_type,
                "local": dt.to_local().tolist(), "full": dt.full_tensor().tolist(),
            }
        if op == "user_destroy":  # user code tearing the group down itself
            dist.destroy_process_group()
            return True
        if op == "keep":
            return float(keep.sum())
        if op == "state":
            return {"inits": mgr.inits, "current": mgr.current is not None}
        raise ValueError(op)

    while True:
        try:
            op, arg = conn.recv()
        except (EOFError, OSError):
            return
        t0 = time.perf_counter()
        try:
            reply = ("ok", handle(op, arg))
        except Exception as e:
            reply = ("err", f"{type(e).__name__}: {e}")
        conn.send((*reply, time.perf_counter() - t0))


# --------------------------------------------------------------------------- test side


class Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def send(self, op: str, arg: Any = None) -> None:
        self.conn.send((op, arg))

    def recv(self, timeout: float = 20.0) -> tuple[str, Any, float]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.proc.pid} gave no answer in {timeout}s")
        status, value, seconds = self.conn.recv()
        return status, value, seconds

    def call(self, op: str, arg: Any = None, timeout: float = 20.0) -> Any:
        self.send(op, arg)
        status, value, _ = self.recv(timeout)
        if status != "ok":
            raise AssertionError(f"{op} failed in worker: {value}")
        return value

    def alive(self) -> bool:
        if not self.proc.is_alive():
            return False
        try:
            return self.call("ping", timeout=3.0) == "pong"
        except (TimeoutError, AssertionError, OSError, EOFError):
            return False

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3)


class Pool:
    def __init__(self, n: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.store, self.port = host_store()
        self.workers = [Worker(self.ctx) for _ in range(n)]
        for w in self.workers:
            w.call("ping", timeout=100.0)

    def refresh(self) -> None:
        """Replace any worker that died or hangs; reset the others to no group."""
        fresh = []
        for i, w in enumerate(self.workers):
            if not w.alive():
                w.kill()
                self.workers[i] = Worker(self.ctx)
                fresh.append(self.workers[i])
            else:
                w.call("abort", "test reset", timeout=10.0)
        for w in fresh:
            w.call("ping", timeout=100.0)

    def close(self) -> None:
        for w in self.workers:
            w.kill()

    def spec(self, rank: int, world: int, *, gang_id: str, generation: int = 1,
             timeout_s: float = 30.0) -> dict[str, Any]:
        return GangSpec(
            gang_id=gang_id, generation=generation, rank=rank, world_size=world,
            store_host="127.0.0.1", store_port=self.port, backend="gloo",
            timeout_s=timeout_s, devices=tuple(f"test:{i}" for i in range(world)),
        ).to_wire()

    def form(self, ws: list[Worker], *, gang_id: str, generation: int = 1,
             timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """All ranks ensure() at once (they rendezvous with each other)."""
        for r, w in enumerate(ws):
            w.send("ensure", self.spec(r, len(ws), gang_id=gang_id, generation=generation,
                                       timeout_s=timeout_s))
        out = []
        for w in ws:
            status, value, _ = w.recv(timeout=timeout_s + 10)
            assert status == "ok", value
            out.append(value)
        return out

    def all_reduce(self, ws: list[Worker]) -> list[list[float]]:
        for r, w in enumerate(ws):
            w.send("all_reduce", float(r + 1))
        results = []
        for w in ws:
            status, value, _ = w.recv()
            assert status == "ok", value
            results.append(value)
        return results


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool(3)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def workers(pool: Pool) -> Iterator[Pool]:
    pool.refresh()
    ok = False
    try:
        yield pool
        ok = True
    finally:
        if not ok:  # a failed test may leave a rank blocked: the next refresh respawns
            for w in pool.workers:
                w.kill()


def gid() -> str:
    return uuid.uuid4().hex[:8]


def expect(world: int) -> list[float]:
    return [float(sum(range(1, world + 1)))] * 4

def reforms(workers: Pool, ranks: list[Any], g: str) -> None:
    """The same ranks join a new generation of the gang and reduce correctly."""
    workers.form(ranks, gang_id=g, generation=2)
    assert workers.all_reduce(ranks) == [expect(len(ranks))] * len(ranks)


def fails_fast_then_aborts(w: Any, value: float) -> None:
    """A rank whose peer tore the group down: its next collective fails by the end of the
    peer's hold (not at the timeout), then it aborts its side too."""
    w.send("all_reduce", value)
    status, reply, seconds = w.recv(timeout=10.0)
    assert status == "err" and seconds < HOLD_SECONDS + 2.5, (reply, seconds)
    w.call("abort", "test: peer aborted")



# --------------------------------------------------------------------------- pure bits


@TIMEOUT
def test_gang_spec_wire_round_trip() -> None:
    spec = GangSpec("g1", 3, 1, 2, "10.0.0.1", 29500, "nccl", 12.5, ("a:0", "a:1"))
    wire = spec.to_wire()
    assert wire["devices"] == ["a:0", "a:1"]
    assert GangSpec.from_wire(wire) == spec
    assert spec.prefix == "gpufn/g1/3"
    assert spec.same_group(GangSpec.from_wire(wire))
    assert not spec.same_group(GangSpec("g1", 4, 1, 2, "h", 1, "nccl"))
    with pytest.raises(ValueError):
        GangSpec("g", 1, 2, 2, "h", 1, "gloo")
    with pytest.raises(ValueError):
        GangSpec("g", 1, 0, 2, "h", 1, "gloo", devices=("a:0",))


@TIMEOUT
def test_resolve_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    assert resolve_backend("cuda") == "nccl"
    assert resolve_backend("cpu") == "gloo"
    monkeypatch.setenv(ENV_BACKEND, "cpu:gloo,cuda:nccl")
    assert resolve_backend("cuda") == "cpu:gloo,cuda:nccl"


@TIMEOUT
def test_abort_without_group_is_a_no_op() -> None:
    mgr = GroupManager()
    mgr.abort("nothing to abort")
    mgr.leave()
    assert mgr.current is None and mgr.inits == 0


@TIMEOUT
def test_held_duplicates_are_bounded_and_each_closed_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past HELD_MAX the oldest held fds close early; a timer whose fds were closed so
    closes nothing else (not an fd number reused since)."""
    import os

    from gpufn.worker import groups

    monkeypatch.setattr(groups, "HELD_MAX", 3)
    monkeypatch.setattr(groups, "_held", groups.collections.deque())
    r, w = os.pipe()
    try:
        first = [os.dup(r), os.dup(r)]
        groups._close_later(first, 60)
        second = [os.dup(r), os.dup(r)]
        groups._close_later(second, 60)
        assert list(groups._held) == [first[1], *second]  # the oldest went at once

        def is_open(fd: int) -> bool:
            try:
                os.fstat(fd)
                return True
            except OSError:
                return False

        assert not is_open(first[0]) and all(map(is_open, [first[1], *second]))
        reused = os.dup(r)  # takes the number the bound freed
        assert reused == first[0]
        groups._release(first)  # first's timer: closes first[1] only
        assert is_open(reused) and not is_open(first[1])
        groups._release(second)  # second's timer
        assert not any(map(is_open, second)) and not groups._held
        third = [os.dup(r)]
        groups._close_later(third, 0)  # 0 s: at once
        assert not is_open(third[0]) and not groups._held
        os.close(reused)
    finally:
        os.close(r)
        os.close(w)


@TIMEOUT
def test_the_store_connection_is_kept_and_made_again_once_broken() -> None:
    """Joins at one store address share one connection; a store restarted on the same
    port (a head restart) broke it, and the next join connects again."""
    import socket as sk
    from datetime import timedelta

    import torch.distributed as dist

    with sk.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    mgr = GroupManager()
    gang = GangSpec("g", 1, 0, 1, "127.0.0.1", port, "gloo")
    first = mgr._store_client(gang, timedelta(seconds=5))
    first.set("k", "v")
    assert mgr._store_client(gang, timedelta(seconds=7)) is first and mgr.connects == 1
    assert first.timeout == timedelta(seconds=7)  # the later join's timeout applies
    del server
    time.sleep(0.3)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    again = mgr._store_client(gang, timedelta(seconds=5))
    assert again is not first and mgr.connects == 2
    again.set("k", "v2")
    assert server.get("k") == b"v2"
    with sk.socket() as s:  # another address: another connection
        s.bind(("127.0.0.1", 0))
        other = s.getsockname()[1]
    server2 = dist.TCPStore("127.0.0.1", other, is_master=True, wait_for_workers=False)
    mgr._store_client(GangSpec("g", 1, 0, 1, "127.0.0.1", other, "gloo"), timedelta(seconds=5))
    assert mgr.connects == 3
    del server, server2


@TIMEOUT
def test_abort_ends_our_reads_and_keeps_the_connection_open_a_while() -> None:
    """Our reads end at once (gloo's loop sees EOF and fails every op posted on the
    socket), but the connection stays open through the held duplicate after gloo closes
    its fd: our writes still go out and the peer's writes still land (neither end resets
    the other), until the duplicates are closed. A send that fails (EPIPE, ECONNRESET)
    would be queued by gloo and never failed: its collective would wait for the gang's
    whole timeout (see `worker/groups.py`'s module doc)."""
    import socket as sk

    from gpufn.worker.groups import _close_later, _shutdown_sockets, _socket_fds

    with sk.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        before = _socket_fds()
        ours = sk.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        with peer:
            fds = {fd: ino for fd, ino in _socket_fds().items() if before.get(fd) != ino}
            assert ours.fileno() in fds and peer.fileno() in fds
            fds.pop(peer.fileno())  # the peer is another process's socket
            held = _shutdown_sockets(fds)
            assert len(held) == 1  # ours, not the listener
            assert listener.getsockopt(sk.SOL_SOCKET, sk.SO_ACCEPTCONN)  # still listening
            assert ours.recv(16) == b""  # our reading side: EOF at once
            assert ours.send(b"ours") == 4  # our writing side: open
            assert peer.recv(16) == b"ours"
            ours.close()  # what gloo does on that EOF
            for _ in range(3):  # the peer's sends land, however many, no reset
                assert peer.send(b"data") == 4
                time.sleep(0.02)
            peer.settimeout(0.2)
            with pytest.raises(TimeoutError):  # and the peer sees no end yet
                peer.recv(16)
            _close_later(held, 0)
            peer.settimeout(5)
            try:
                assert peer.recv(16) == b""  # the end, once the hold is over
            except ConnectionResetError:  # or a reset: our unread data was dropped
                pass


# --------------------------------------------------------------------------- processes


@TIMEOUT
def test_warm_reuse_needs_no_init(workers: Pool) -> None:
    a, b, _ = workers.workers
    g = gid()
    first = workers.form([a, b], gang_id=g)
    assert [r["rank"] for r in first] == [0, 1] and all(r["size"] == 2 for r in first)
    assert workers.all_reduce([a, b]) == [expect(2)] * 2
    second = workers.form([a, b], gang_id=g)
    assert [s["inits"] - f["inits"] for f, s in zip(first, second, strict=True)] == [0, 0]
    assert workers.all_reduce([a, b]) == [expect(2)] * 2
    # stale abort orders (another gang, an older generation) leave the warm group alone
    assert a.call("abort_for", ("stale", "other-gang", None)) is True
    assert a.call("abort_for", ("stale", g, 0)) is True
    assert workers.all_reduce([a, b]) == [expect(2)] * 2
    assert a.call("state")["inits"] == second[0]["inits"]
    print(f"\njoin took {first[0]['init_s']:.3f}s (rank 0), {first[1]['init_s']:.3f}s (rank 1)")


@TIMEOUT
def test_regang_to_another_pair_and_generation(workers: Pool) -> None:
    a, b, c = workers.workers
    first = workers.form([a, b], gang_id=gid())
    assert workers.all_reduce([a, b]) == [expect(2)] * 2
    # b moves to a new gang with c (b is rank 0 now); a is left in its stale group
    g2 = gid()
    second = workers.form([b, c], gang_id=g2)
    assert second[0]["inits"] == first[1]["inits"] + 1 and second[0]["rank"] == 0
    assert workers.all_reduce([b, c]) == [expect(2)] * 2
    # same pair, new generation (what the scheduler hands out after a failure)
    third = workers.form([b, c], gang_id=g2, generation=2)
    assert [t["inits"] - s["inits"] for s, t in zip(second, third, strict=True)] == [1, 1]
    # each join used the connection to the store kept from the first (a connect costs a
    # reverse DNS lookup in torch, which can wait 5 s for a DNS server)
    assert first[1]["connects"] >= 1
    assert first[1]["connects"] == second[0]["connects"] == third[0]["connects"]
    assert second[1]["connects"] == third[1]["connects"]
    assert workers.all_reduce([b, c]) == [expect(2)] * 2
    # all three together; a leaves its stale group on the way
    workers.form([c, a, b], gang_id=gid())
    assert workers.all_reduce([c, a, b]) == [expect(3)] * 3


@TIMEOUT
def test_failed_rank_abort_unblocks_peer_and_gang_recovers(workers: Pool) -> None:
    a, b, _ = workers.workers
    g = gid()
    workers.form([a, b], gang_id=g, timeout_s=30.0)
    assert workers.all_reduce([a, b]) == [expect(2)] * 2
    before = a.call("keep")
    # both ranks hold the group through a DeviceMesh (as a cached TP model would)
    a.call("pin")
    b.call("pin")
    a.send("all_reduce", 1.0)  # rank 0 blocks: rank 1 never joins this collective
    assert not a.conn.poll(0.5), f"rank 0 did not block: {a.recv()}"
    t0 = time.perf_counter()
    assert b.call("abort", "test: rank 1 failed") is True
    status, value, seconds = a.recv(timeout=10.0)
    unblocked = time.perf_counter() - t0
    assert status == "err", value
    assert seconds >= 0.5, f"rank 0's collective ended after {seconds:.2f}s, before the abort"
    # rank 0 was not aborted itself: its collective ends when rank 1's hold does
    assert HOLD_SECONDS - 0.1 <= unblocked < HOLD_SECONDS + 2.5, (
        f"rank 0 stayed blocked {unblocked:.2f}s after rank 1 aborted")
    print(f"\nrank 0 unblocked {unblocked:.3f}s after rank 1's abort "
          f"(collective ran {seconds:.3f}s, timeout 30s): {value[:80]}")
    assert a.call("abort", "test: peer failed") is True
    # back in service without a restart: next generation, same processes
    reforms(workers, [a, b], g)
    assert a.call("keep") == before


@TIMEOUT
def test_abort_from_another_thread_while_blocked(workers: Pool) -> None:
    a, b, _ = workers.workers
    g = gid()
    workers.form([a, b], gang_id=g, timeout_s=30.0)
    a.call("pin")
    a.send("all_reduce_abort_self", 0.5)  # blocked; a thread in a aborts after 0.5 s
    status, value, seconds = a.recv(timeout=10.0)
    assert status == "err", value
    assert seconds >= 0.5, f"the collective ended after {seconds:.2f}s, before the abort"
    assert seconds < 3.0, f"blocked collective took {seconds:.2f}s to end after abort"
    print(f"\nself-abort ended the blocked collective after {seconds:.3f}s (abort at 0.5s)")
    # the peer's next collective fails fast too, instead of waiting 30 s
    fails_fast_then_aborts(b, 2.0)
    reforms(workers, [a, b], g)


@TIMEOUT
def test_hanging_collective_ends_at_timeout(workers: Pool) -> None:
    a, b, _ = workers.workers
    g = gid()
    workers.form([a, b], gang_id=g, timeout_s=3.0)
    a.send("all_reduce", 1.0)  # b never joins and never aborts: only the timeout helps
    status, value, seconds = a.recv(timeout=20.0)
    assert status == "err", value
    assert 2.5 <= seconds < 8.0, seconds
    print(f"\nhung collective ended after {seconds:.2f}s (timeout_s=3): {value[:80]}")
    a.call("abort", "test: timeout")
    b.call("abort", "test: timeout")
    reforms(workers, [a, b], g)


@TIMEOUT
def test_abort_while_joining(workers: Pool) -> None:
    a, b, _ = workers.workers
    g = gid()
    # a starts joining and is aborted while it waits; only then does b arrive
    a.send("ensure_abort_while_joining", workers.spec(0, 2, gang_id=g))
    assert a.recv()[:2] == ("event", "aborted while joining")
    b.send("ensure", workers.spec(1, 2, gang_id=g))
    status, value, _ = a.recv()
    assert status == "err" and value.startswith("GangAborted"), value
    assert a.call("state")["current"] is False
    # b's group is dead on arrival: its join fails as a tears the group down, or (when
    # the join completed first) its first collective does; either at once, not at the
    # 30 s timeout
    b_status, b_value, b_seconds = b.recv(timeout=40.0)
    print(f"\nb's join: {b_status} after {b_seconds:.2f}s {b_value if b_status == 'err' else ''}")
    if b_status == "ok":
        fails_fast_then_aborts(b, 1.0)
    else:
        assert b_seconds < 10.0, (b_value, b_seconds)
        b.call("abort", "test: peer aborted")
    reforms(workers, [a, b], g)


@TIMEOUT
def test_rank_that_never_joins_fails_join_at_timeout(workers: Pool) -> None:
    a, _, _ = workers.workers
    a.send("ensure", workers.spec(0, 2, gang_id=gid(), timeout_s=2.0))
    status, value, seconds = a.recv(timeout=20.0)
    assert status == "err", value
    assert seconds < 8.0, seconds
    assert a.call("state")["current"] is False


@TIMEOUT
def test_destroyed_behind_our_back_is_reported(workers: Pool) -> None:
    a, b, _ = workers.workers
    g = gid()
    workers.form([a, b], gang_id=g)
    a.call("user_destroy")  # user code called destroy_process_group()
    a.send("ensure", workers.spec(0, 2, gang_id=g))
    status, value, _ = a.recv()
    assert status == "err" and value.startswith("GangAborted"), value
    b.call("abort", "test: peer lost its group")
    reforms(workers, [a, b], g)


@TIMEOUT
def test_mesh_for_distributes_a_tensor(workers: Pool) -> None:
    a, b, _ = workers.workers
    workers.form([a, b], gang_id=gid())
    a.send("mesh")
    b.send("mesh")
    ra, rb = a.recv(), b.recv()
    assert ra[0] == "ok" and rb[0] == "ok", (ra, rb)
    assert ra[1]["shape"] == [2] and ra[1]["device_type"] == "cpu"
    assert ra[1]["local"] == [0.0, 1.0, 2.0, 3.0]
    assert rb[1]["local"] == [4.0, 5.0, 6.0, 7.0]
    assert ra[1]["full"] == rb[1]["full"] == [float(i) for i in range(8)]


def test_gang_aborted_is_a_gpufn_error() -> None:
    from gpufn.exceptions import GpufnError

    assert issubclass(GangAborted, GpufnError)
