"""Who is connected: hellos, heartbeats, unreachable and silent peers, lost and exited
workers, kills. `Membership` keeps the peers and devices and yields what it decided about
calls (`WorkerGone`, `ClientGone`, `Reported`, ...); the core applies each decision as it is
yielded, so a device is reset only after the calls it ran were dealt with.

It also tells the scheduler's own stall from its workers' silence: a `Stalled` event from
the shell (its loop woke far later than it asked to: SIGSTOP, a frozen VM, swap) forgives
that much silence, so a paused head does not kill healthy workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from gpufn.exceptions import GpufnError, kind_of
from gpufn.memory_pool.eviction import EvictionPolicy
from gpufn.memory_pool.ledger import DeviceLedger, HostLedger
from gpufn.memory_pool.probe import DeviceInfo
from gpufn.scheduler.books.users import Identity
from gpufn.scheduler.calls.recovery import Recovery
from gpufn.scheduler.nouns.events import Send
from gpufn.scheduler.nouns.records import Device, Journal, Peer, journal_of
from gpufn.scheduler.nouns.settings import Counters, SchedulerConfig
from gpufn.scheduler.nouns.states import DeviceState
from gpufn.scheduler.peers import fencing, handshake
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")


@dataclass(frozen=True, slots=True)
class WorkerGone:
    """The device's worker is gone: retry or fail what ran there (with `oom`, its
    supervisor's words: it was stopped over its host-memory limit)."""

    device: Device
    reason: str
    oom: str = ""
    # The calls its process started, from its journal (its exit notice), when whole: the
    # worker's own word, truer than the scheduler's clocks (None: not known).
    started: Journal | None = None


@dataclass(frozen=True, slots=True)
class ClientGone:
    """A client left: its calls are cancelled, except those that outlive it."""

    peer: bytes
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reported:
    """A worker (`device`) or a supervisor (None) named calls after a restart."""

    ids: tuple[str, ...]
    device: Device | None


@dataclass(frozen=True, slots=True)
class DevicesChanged:
    """The set of usable devices changed: feasibility is judged again."""


@dataclass(frozen=True, slots=True)
class AllBack:
    """Every device seen before the restart has its worker back: the hold ends."""


Decision = WorkerGone | ClientGone | Reported | DevicesChanged | AllBack


class Membership:
    def __init__(self, config: SchedulerConfig, counters: Counters, recovery: Recovery,
                 policy: EvictionPolicy, out: list[Send]) -> None:
        self.config = config
        self.counters = counters
        self.recovery = recovery
        self.policy = policy
        self.out = out
        self.peers: dict[bytes, Peer] = {}
        self.devices: dict[str, Device] = {}
        self.worker_device: dict[bytes, str] = {}
        self.hosts: dict[str, HostLedger] = {}

    def send(self, peer: bytes, msg: p.Message) -> None:
        self.out.append(Send(peer, msg))

    def device_of(self, peer: bytes) -> Device | None:
        """The device whose worker (or its control channel) is `peer`."""
        key = self.worker_device.get(peer)
        return self.devices.get(key) if key else None

    def cluster_info(self, who: Identity | None = None) -> p.WelcomeInfo:
        """What a Welcome tells a peer of the cluster (and a client of who it is)."""
        return p.WelcomeInfo(p.PROTOCOL_VERSION, len(self.devices), self.config.client_timeout,
                             self.recovery.instance, handshake.runtimes(self.peers.values()),
                             who.user if who else "", who.admin if who else False,
                             sorted({i.info.host for i in self.peers.values()
                                     if i.role == p.Role.SUPERVISOR}))

    # ------------------------------------------------------------------ hellos

    def hello(self, peer: bytes, msg: p.Hello, who: Identity | None,
              now: float) -> Iterator[Decision]:
        refused = handshake.refusal(msg, who)
        if refused is not None:
            self.send(peer, refused)
        elif msg.role == p.Role.CLIENT:
            assert who is not None
            self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now, who.user, who.admin)
            self.recovery.client_hello(peer, msg.info, now)
            self.send(peer, p.Welcome(True, info=self.cluster_info(who)))
        elif msg.role == p.Role.SUPERVISOR:
            yield from self._hello_supervisor(peer, msg, now)
        else:
            yield from self._hello_worker(peer, msg, now)

    def _hello_supervisor(self, peer: bytes, msg: p.Hello, now: float) -> Iterator[Decision]:
        infos = [DeviceInfo.from_wire(d) for d in msg.info.devices]
        # The calls of its workers that died while no scheduler was there (their journals).
        yield Reported(tuple(self.recovery.worker_report("", peer, msg.info, now)), None)
        if peer in self.peers and all(
                (d := self.devices.get(i.key)) is not None and d.supervisor == peer
                and d.state is not DeviceState.GONE for i in infos):
            # A second Hello of a supervisor we know (it said Hello again before our
            # Welcome arrived): its devices and their workers stay as they are.
            self.peers[peer].last_seen = now
            self.send(peer, p.Welcome(True, info=self.cluster_info(None)))
            return
        self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now)
        for info in infos:
            d = self.devices.get(info.key)
            if d is not None:
                if d.state is not DeviceState.GONE and d.supervisor != peer and d.supervisor in self.peers:
                    log.warning("device %s re-announced by a new supervisor; replacing", info.key)
                yield from self.lose_worker(d, now, "its supervisor re-registered", restart=False)
                d.info, d.supervisor = info, peer
                d.incarnation = d.fenced = 0  # generations are counted per supervisor
                d.ledger = self._ledger(info, msg.info)
                if d.state is not DeviceState.STARTING:
                    d.to(DeviceState.STARTING, now)
            else:
                d = Device(info=info, supervisor=peer, ledger=self._ledger(info, msg.info))
                d.history.append(("starting", now))
                self.devices[info.key] = d
        yield DevicesChanged()
        self.send(peer, p.Welcome(True, info=self.cluster_info(None)))
        log.info("supervisor %s registered %d device(s)", msg.info.node, len(infos))

    def _ledger(self, info: DeviceInfo, node_info: p.HelloInfo) -> DeviceLedger:
        """A device's ledger, sharing its node's host-memory budget for offloaded models."""
        host = self.hosts.get(info.node)
        if host is None:
            budget = self.config.host_offload_bytes or node_info.host_memory // 2
            host = self.hosts[info.node] = HostLedger(budget or 16 * 2**30)
        return DeviceLedger(info.memory_total, host=host, key=info.key, policy=self.policy)

    def _hello_worker(self, peer: bytes, msg: p.Hello, now: float) -> Iterator[Decision]:
        key = msg.info.device
        d = self.devices.get(key)
        if d is None or d.state is DeviceState.GONE:
            self.send(peer, p.Welcome(False, kind_of(GpufnError), (
                f"device {key!r} was not announced by a supervisor; start workers with "
                "`gpufn serve` or `gpufn worker`, not by hand")))
            return
        incarnation = msg.info.incarnation
        if fencing.fenced(d, incarnation):  # a worker that was replaced (e.g. frozen)
            self.send(peer, fencing.refusal(d, incarnation))
            if d.supervisor in self.peers:
                self.send(d.supervisor, p.KillWorker(key, msg.pid, "a fenced worker came back"))
            return
        if msg.info.channel == "control":
            if d.control is not None and d.control != peer:
                self.peers.pop(d.control, None)
                self.worker_device.pop(d.control, None)
            self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now)
            self.worker_device[peer] = key
            d.control, d.last_seen = peer, now
            self.send(peer, p.Welcome(True, info=self.cluster_info(None)))
            return
        if d.worker == peer and peer in self.peers:  # a second Hello of a worker we know
            d.last_seen = self.peers[peer].last_seen = now
            self.send(peer, p.Welcome(True, info=self.cluster_info(None)))
            return
        if d.worker is not None and d.worker != peer:
            yield from self.lose_worker(d, now, "a new worker process registered for the device")
        self._serving(d, peer, msg, now)
        yield DevicesChanged()
        yield Reported(tuple(self.recovery.worker_report(key, peer, msg.info, now)), d)
        if self.recovery.device_ready(key):  # every device seen before the restart is back
            yield AllBack()
        self.send(peer, p.Welcome(True, info=self.cluster_info(None)))
        if d.supervisor in self.peers:  # it started fine: not part of a crash loop
            self.send(d.supervisor, p.WorkerServing(key, msg.pid, d.incarnation))
        log.info("worker for %s ready (pid %d)", key, msg.pid)

    def _serving(self, d: Device, peer: bytes, msg: p.Hello, now: float) -> None:
        """`peer` is the device's worker now, with the models it says it holds."""
        self.peers[peer] = Peer(peer, msg.role, msg.pid, msg.info, now)
        self.worker_device[peer] = d.key
        d.last_seen = now
        d.worker, d.worker_pid = peer, msg.pid
        d.incarnation = msg.info.incarnation or d.incarnation + 1
        d.code.clear()
        d.ledger.reset()
        for model, nbytes in msg.info.models:  # they outlived the previous scheduler
            d.ledger.adopt(str(model), int(nbytes), now)
        if d.state is not DeviceState.READY:
            d.to(DeviceState.READY, now)
        d.last_error = ""

    # ------------------------------------------------------------------ leaving

    def drop(self, peer: bytes, now: float, reason: str) -> Iterator[Decision]:
        """`peer` left (goodbye, unreachable, silent, its token revoked)."""
        info = self.peers.pop(peer, None)
        if info is None:
            return
        if info.role == p.Role.CLIENT:
            yield ClientGone(peer, reason)
        elif info.role == p.Role.WORKER:
            key = self.worker_device.pop(peer, None)
            d = self.devices.get(key) if key else None
            if d is not None and peer in (d.worker, d.control):
                yield from self.lose_worker(d, now, f"worker {reason}")
        elif info.role == p.Role.SUPERVISOR:
            for d in self.devices.values():
                if d.supervisor == peer and d.state is not DeviceState.GONE:
                    yield from self.lose_worker(d, now, f"its supervisor {reason}", restart=False)
                    d.to(DeviceState.GONE, now)
            yield DevicesChanged()

    def unreachable(self, peer: bytes, now: float) -> Iterator[Decision]:
        info = self.peers.get(peer)
        if info is None:
            return
        if info.role == p.Role.WORKER:  # it may still be running calls that get retried
            d = self.device_of(peer)
            if d is not None and d.supervisor in self.peers:
                self.send(d.supervisor, p.KillWorker(d.key, d.worker_pid, "unreachable"))
        yield from self.drop(peer, now, "unreachable")

    def worker_exited(self, peer: bytes, msg: p.WorkerExited, now: float) -> Iterator[Decision]:
        d = self.devices.get(msg.device)
        if d is None or d.supervisor != peer or fencing.stale_exit(d, msg):
            return  # not its device, or about an older generation: never applied to it
        d.last_error = msg.reason
        started = journal_of(msg)
        if msg.returncode == p.OUT_OF_HOST_MEMORY:  # its calls fail: a retry would grow again
            yield from self.lose_worker(d, now, "worker over its host-memory limit", oom=msg.reason,
                                        started=started)
            return
        yield from self.lose_worker(d, now, f"worker process exited ({msg.reason})",
                                    started=started)
        if msg.returncode == p.GAVE_UP:  # the supervisor retries it after a longer wait
            if d.state is not DeviceState.FAILED:
                d.to(DeviceState.FAILED, now)
            yield DevicesChanged()

    def kill(self, d: Device, now: float, reason: str) -> Iterator[Decision]:
        """Have the device's supervisor kill its worker; what ran there is lost now."""
        if d.supervisor in self.peers:
            self.send(d.supervisor, p.KillWorker(d.key, d.worker_pid, reason))
        log.warning("killing worker of %s: %s", d.key, reason)
        yield from self.lose_worker(d, now, reason)

    def lose_worker(self, d: Device, now: float, reason: str, restart: bool = True,
                    oom: str = "", started: Journal | None = None) -> Iterator[Decision]:
        """The device's worker is gone: its calls first (the core), then the device is
        reset. Never READY without a worker: placement would choose it."""
        yield WorkerGone(d, reason, oom, started)
        for peer in (d.worker, d.control):
            if peer is not None:
                self.worker_device.pop(peer, None)
                self.peers.pop(peer, None)
        if d.worker is not None:
            d.fenced = max(d.fenced, d.incarnation)  # its late messages are ignored
        d.worker, d.control, d.worker_pid = None, None, 0
        d.running.clear()
        d.running_by_fn.clear()
        d.code.clear()
        d.ledger.reset(now)
        if d.state in (DeviceState.READY, DeviceState.STARTING):
            d.to(DeviceState.RESTARTING, now)
            if restart:
                d.restarts += 1
                self.counters.restarts += 1

    # ------------------------------------------------------------------ silence

    def stalled(self, seconds: float) -> None:
        """The scheduler itself did not run for `seconds`: nobody was heard in that time
        through no fault of theirs, so that much silence is forgiven."""
        if seconds <= 0:
            return
        self.counters.stalls += 1
        log.warning("the scheduler did not run for %.1fs (paused, frozen or starved); its "
                    "workers' and clients' silence in that time is not held against them",
                    seconds)
        for d in self.devices.values():
            d.last_seen += seconds
        for peer in self.peers.values():
            peer.last_seen += seconds

    def silent_workers(self, now: float) -> Iterator[Decision]:
        """Workers not heard from within the heartbeat timeout are killed."""
        for d in list(self.devices.values()):
            if d.state is DeviceState.READY and now - d.last_seen > self.config.heartbeat_timeout:
                yield from self.kill(d, now, f"no heartbeat for {now - d.last_seen:.0f}s")

    def silent_clients(self, now: float) -> Iterator[Decision]:
        for peer in [k for k, v in self.peers.items()
                     if v.role == p.Role.CLIENT and now - v.last_seen > self.config.client_timeout]:
            yield from self.drop(peer, now, "timed out")
