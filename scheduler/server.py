"""The scheduler process: a ZeroMQ ROUTER shell around `SchedulerCore`.

It decodes frames into events, feeds the core in batches, and delivers the sends. With
ROUTER_MANDATORY a full peer raises EAGAIN (the message waits in that peer's outbox, in
order) and an unknown peer raises EHOSTUNREACH (reported to the core): nothing is dropped.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

import zmq

from gpufn.exceptions import ProtocolMismatch, kind_of
from gpufn.net import processes, sockets
from gpufn.net.curve import ServerSecurity
from gpufn.scheduler.books.users import UserStore
from gpufn.scheduler.calls.recovery import Restored
from gpufn.scheduler.core import (
    Event,
    Received,
    RendezvousFailed,
    RendezvousReady,
    SchedulerConfig,
    SchedulerCore,
    Send,
    Stalled,
    Tick,
    Unreachable,
)
from gpufn.scheduler.stores.deployments import DeploymentStore
from gpufn.scheduler.stores.kept_results import KeptResults
from gpufn.scheduler.stores.ops import OpsStore
from gpufn.wire import protocol as p
from gpufn.wire.config import join_address

log = logging.getLogger("gpufn.scheduler")

TICK_SECONDS = 0.05
STALL_SECONDS = 1.0  # a loop this much later than asked means the scheduler did not run
EXIT_RESTART = p.EXIT_RESTART
MAX_BATCH = 512
# Room for a header frame above the largest payload frame allowed (headers are small).
HEADER_SLACK = 64 * 1024


class SchedulerServer:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, config: SchedulerConfig | None = None,
        ipc_path: str | None = None, security: ServerSecurity | None = None,
        durable: bool = False,
    ) -> None:
        config = config or SchedulerConfig()
        # `durable` (gpufn serve): usage, logs and the devices seen are kept on disk too.
        ops = OpsStore.in_state_dir(config.state_dir if durable else "")
        results = KeptResults.in_state_dir(config.state_dir, config.result_retention_seconds,
                                           config.result_store_bytes)
        self.core = SchedulerCore(config, DeploymentStore.in_state_dir(config.state_dir),
                                  UserStore.in_state_dir(config.state_dir), results, ops)
        # What the stores say of the time before this scheduler, handed to the core once.
        # Dispatch tokens start above any an earlier scheduler gave (its workers may still
        # run those dispatches), so no late result matches a new dispatch by chance.
        self._restored = Restored.read(ops, results,
                                       wall_offset=time.time() - time.monotonic(),
                                       first_token=int(time.time() * 1_000_000))
        self.ctx = zmq.Context()
        # The ZAP allow-list must run before the first peer's handshake.
        self._auth = security.start_auth(self.ctx) if security is not None else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        sockets.configure(self.sock, router=True)
        # A peer that sends a frame over the payload limit is disconnected by ZeroMQ as
        # soon as the frame's declared size arrives, before it is buffered.
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.core.config.max_payload + HEADER_SLACK)
        self._undecodable = _RateLimitedLog(log)
        if security is not None:
            security.apply(self.sock)
        self.host = host
        if ipc_path:  # the embedded cluster: a Unix socket is cheaper than TCP loopback
            self.address = f"ipc://{ipc_path}"
            self.sock.bind(self.address)
        else:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
        # What peers connect with: with CURVE, the address carries our public key.
        self.public_address = join_address(
            self.address, security.keys.public.decode() if security is not None else None)
        self._outbox: dict[bytes, deque[list[Any]]] = {}
        self._pending_events: list[Event] = []
        self._running = True
        # Only an operator's explicit shutdown stops other hosts' supervisors and workers;
        # a head that dies or is restarted leaves them reconnecting.
        self.stop_hosts = False
        # A final stop (SIGINT, a drain) fails the clients' calls; any other (SIGTERM,
        # the parent gone) is a restart: clients wait for the next scheduler.
        self.final = False
        self._store: Any = None
        self._store_port: int | None = None
        self._store_error = ""
        self._store_error_sent = False
        self._store_thread: threading.Thread | None = None
        self.metrics: Any = None  # a metrics.Exporter with --metrics-port

    def start_metrics(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve Prometheus metrics on `port` (a missing prometheus-client is reported, not fatal)."""
        try:
            from gpufn.scheduler.metrics import Exporter

            self.metrics = Exporter(port, host)
            log.info("metrics on http://%s:%d/metrics", host, self.metrics.port)
        except ImportError:
            log.error("--metrics-port needs prometheus-client: pip install 'gpufn[metrics]'")
        except OSError as e:
            log.error("cannot serve metrics on port %d: %s", port, e)

    def stop(self, *_: object) -> None:
        """Stop to be restarted (clients and workers wait for the next scheduler)."""
        self._running = False

    def stop_final(self, *_: object) -> None:
        """Stop for good: clients' calls fail (workers of other hosts still wait)."""
        self.final = True
        self._running = False

    @property
    def exit_code(self) -> int:
        return 0 if self.final or self.core.ops.draining else EXIT_RESTART

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_SECONDS
        sock = self.sock
        self._deliver(self.core.start(self._restored, time.monotonic()))
        mark = time.monotonic()
        try:
            while self._running:
                now = time.monotonic()
                events: list[Event] = self._pending_events
                self._pending_events = []
                wake = self.core.next_wakeup()
                due = next_tick if wake is None else min(next_tick, wake)
                wait = 0 if (self._outbox or events) else max(0.0, due - now)
                timeout_ms = math.ceil(wait * 1000) if wait else (1 if self._outbox else 0)
                ready = dict(poller.poll(timeout_ms))
                if ready.get(sock):
                    self._receive(events)
                now = time.monotonic()
                # Time since the last round beyond the wait asked for is work, or not
                # running at all (SIGSTOP, a frozen VM, swap). Past a second the core is
                # told first, before it judges anyone's silence on this round's tick.
                late, mark = now - mark - wait, now
                if late > STALL_SECONDS:
                    events.insert(0, Stalled(late))
                if now >= next_tick or (wake is not None and now >= wake):
                    events.append(Tick())
                    next_tick = now + TICK_SECONDS
                if self._store_port is not None and self.core.rendezvous_port is None:
                    events.append(RendezvousReady(self._store_port))
                if self._store_error and not self._store_error_sent:
                    self._store_error_sent = True
                    events.append(RendezvousFailed(self._store_error))
                if events:
                    self._deliver(self.core.handle_many(events, now))
                if self.core.needs_rendezvous and self._store_thread is None:
                    self._start_store()
                if self._outbox:
                    self._flush_outboxes()
                if self.metrics is not None and self.metrics.wanted:
                    self.metrics.fill(self.core)  # a scrape waits for this
                if self.core.ops.stop_now(now):
                    log.info("drained; stopping (%s)", self.core.ops.drain_reason)
                    self._running = False
        finally:
            self._flush_outboxes()  # results of calls that finished while draining
            self._shutdown_peers()
            try:
                self.core.ops.tick(time.monotonic(), force=True)  # usage and logs to disk
            except Exception:
                log.exception("could not save usage and logs")

    def _receive(self, events: list[Event]) -> None:
        """Up to MAX_BATCH waiting messages, as events; an undecodable one is answered."""
        for _ in range(MAX_BATCH):
            try:
                frames = sockets.recv(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = frames[0].bytes
            try:
                msgs = p.decode_all(frames[1:])
            except p.DecodeError as e:
                self._undecodable.warning("undecodable message from %r: %s", peer, e)
                self._deliver([Send(peer, p.Error(kind_of(ProtocolMismatch), str(e)))])
                continue
            events.extend(Received(peer, m) for m in msgs)

    def _start_store(self) -> None:
        """Host the gang rendezvous TCPStore; importing torch takes a moment, so in a thread."""

        def run() -> None:
            from gpufn.wire.rendezvous import host_store

            try:
                self._store, self._store_port = host_store(self._store_host())
                log.info("gang rendezvous store on port %d", self._store_port)
            except Exception as e:
                log.exception("cannot start the gang rendezvous store")
                self._store_error = f"{type(e).__name__}: {e}"

        self._store_thread = threading.Thread(target=run, name="gpufn-rendezvous", daemon=True)
        self._store_thread.start()

    def _store_host(self) -> str:
        """The interface the gang store listens on: the scheduler's own (the one its
        workers reach it by), loopback for a Unix socket."""
        return "127.0.0.1" if self.address.startswith("ipc://") else self.host

    def _send_now(self, peer: bytes, frames: list[Any]) -> bool:
        """True if sent; False if the peer is full. Unknown peers become events."""
        try:
            sockets.send(self.sock, [peer, *frames], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                self._pending_events.append(Unreachable(peer))
                return True  # not deliverable: the core decides what it means
            raise

    def _deliver(self, sends: list[Send]) -> None:
        """Send, one batch per peer (in order); a full peer's messages wait in its outbox."""
        by_peer: dict[bytes, list[p.Message]] = {}
        for s in sends:
            by_peer.setdefault(s.peer, []).append(s.msg)
        # Everything is encoded before the first send: a gang's ranks then get their Runs
        # back to back (a woken worker does not wait while we encode the next one's).
        batches = [(peer, p.encode_batch(msgs[i:i + MAX_BATCH]))
                   for peer, msgs in by_peer.items() for i in range(0, len(msgs), MAX_BATCH)]
        for peer, frames in batches:
            q = self._outbox.get(peer)
            if q is not None:
                q.append(frames)
            elif not self._send_now(peer, frames) and peer in self.core.peers:
                # Only a known peer's messages wait; a refusal to a stranger that does
                # not read is dropped, so strangers cannot grow our memory.
                self._outbox[peer] = deque([frames])

    def _flush_outboxes(self) -> None:
        for peer in list(self._outbox):
            q = self._outbox[peer]
            while q and self._send_now(peer, q[0]):
                q.popleft()
            if not q:
                del self._outbox[peer]

    def _shutdown_peers(self) -> None:
        """Tell clients we stop: for good (their calls fail), or to be restarted (their
        calls wait). Workers and supervisors are told only after an explicit `gpufn
        shutdown` (a drain) or when `stop_hosts` is set: otherwise they wait for the
        scheduler to come back."""
        ops = self.core.ops
        everyone = ops.draining or self.stop_hosts
        final = self.final or ops.draining
        reason = (ops.drain_reason if ops.draining else "scheduler stopping" if final
                  else "stopped to be restarted")
        shutdown = p.encode(p.Shutdown(reason, final))
        for peer, info in list(self.core.peers.items()):
            if not everyone and info.role != p.Role.CLIENT:
                continue
            try:
                self.sock.send_multipart([peer, *shutdown], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        # Kept results queued for the disk are written; after a final stop the spawned
        # calls not ended fail like the clients' calls (no later scheduler runs them).
        self.core.streams.close(final=self.final or self.core.ops.draining)
        if self.metrics is not None:
            self.metrics.close()
        self.sock.close(1000)  # let the Shutdown messages out
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()


class _RateLimitedLog:
    """At most one line per `every` seconds; the lines held back are counted in the next
    (a peer sending garbage must not flood the log)."""

    def __init__(self, logger: logging.Logger, every: float = 5.0) -> None:
        self.logger, self.every = logger, every
        self.last = -math.inf
        self.held = 0

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            self.held += 1
            return
        if self.held:
            fmt += f" (and {self.held} more like it since the last such line)"
        self.last, self.held = now, 0
        self.logger.warning(fmt, *args)


def _announce(ready_fd: int, address: str) -> bool:
    """Write our address to the starter's ready pipe; False if nobody reads it any more
    (the starter exited meanwhile): then there is no one to serve."""
    try:
        os.write(ready_fd, address.encode() + b"\n")
        return True
    except BrokenPipeError:
        return False
    finally:
        os.close(ready_fd)


def _refuse(ready_fd: int | None, reason: str) -> None:
    """Tell the starter in one line why we cannot serve (on its ready pipe, else stderr)."""
    if ready_fd is not None:
        try:
            os.write(ready_fd, b"!" + reason.encode() + b"\n")  # embedded.START_FAILED
            return
        except OSError:
            pass
        finally:
            os.close(ready_fd)
    print(f"gpufn scheduler: {reason}", file=sys.stderr)


def run(
    host: str, port: int, config: SchedulerConfig, ready_fd: int | None = None,
    parent_pid: int = 0, ipc_path: str | None = None, security: ServerSecurity | None = None,
    metrics_port: int | None = None, durable: bool = False, final_on_sigterm: bool = False,
) -> int:
    """Serve until stopped; returns the exit status (`EXIT_RESTART` unless final)."""
    try:
        server = SchedulerServer(host, port, config, ipc_path, security, durable)
    except zmq.ZMQError as e:  # the port is taken, or the interface does not exist
        where = f"ipc://{ipc_path}" if ipc_path else f"tcp://{host}:{port}"
        _refuse(ready_fd, f"cannot listen on {where}: {e.strerror}")
        raise SystemExit(2) from None
    if metrics_port is not None:
        server.start_metrics(metrics_port)
    signal.signal(signal.SIGTERM, server.stop_final if final_on_sigterm else server.stop)
    signal.signal(signal.SIGINT, server.stop_final)
    processes.watch_parent(parent_pid, server.stop)
    log.info("scheduler listening on %s%s", server.address,
             " (CURVE)" if security is not None else "")
    try:
        if ready_fd is not None and not _announce(ready_fd, server.public_address):
            log.info("the process that started the scheduler is gone; stopping")
            return 0  # nobody to restart it for
        server.serve_forever()
        return server.exit_code
    finally:
        server.close()
        if ipc_path:
            try:
                os.unlink(ipc_path)
            except OSError:
                pass
