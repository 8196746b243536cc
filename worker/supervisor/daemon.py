"""The per-host supervisor: probes devices, starts one worker per device, restarts a
worker that dies, and kills one when the scheduler says so (hard timeouts, hung ranks)
or when it goes over its host-memory limit (worker/host/memory_watch.py).

Each worker's environment pins its device (`CUDA_VISIBLE_DEVICES` by UUID) before
torch is imported; its stderr goes to a per-device log whose tail explains a crash.
Each worker leads a session of its own: what its calls start stays in it, and is
stopped with it when the worker ends.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from gpufn.exceptions import GpufnError
from gpufn.memory_pool.probe import DeviceInfo
from gpufn.net import interfaces as netif
from gpufn.net import processes
from gpufn.net.connection import Backoff, Connection, ConnectionConfig
from gpufn.net.private_files import open_private_append, private_dir
from gpufn.wire import config, shm
from gpufn.wire import protocol as p
from gpufn.worker.host import proc_table
from gpufn.worker.host.held import RunJournal
from gpufn.worker.host.memory_watch import MemoryWatch, default_budget
from gpufn.worker.supervisor.joining import JoinLog, refusal_reason

log = logging.getLogger("gpufn.supervisor")

PING_SECONDS = 2.0
SHM_SWEEP_SECONDS = 10.0  # how often this host's orphaned shared-memory payloads go
GIVE_UP_AFTER = 5  # failures to start in a row; then wait `config.give_up_retry_seconds()`
GAVE_UP = p.GAVE_UP
RESTART_BACKOFF = Backoff(initial=0.1, maximum=10.0)  # after a worker that failed to start
DEAD_RAN = 20_000  # ids of calls that workers which died had started, for a restarted scheduler


def _host_memory() -> int:
    """This node's RAM in bytes (the budget for offloaded models is a share of it)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def log_dir() -> Path:
    """The workers' log folder, owner-only (0700; each log is 0600)."""
    return private_dir(config.log_dir())


@dataclass
class _Slot:
    device: DeviceInfo
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    incarnation: int = 0
    # Failures to start in a row: deaths before the scheduler said the worker serves.
    # A worker that served and was then killed (from outside, or by the scheduler) is
    # restarted at once and resets the count.
    fast_failures: int = 0
    served: bool = False
    restart_at: float = 0.0
    kill_reason: str = ""
    log_path: Path = field(default_factory=Path)
    log_offset: int = 0  # where this incarnation's output starts in the log
    memory_kill: str = ""  # why the memory watch stopped this incarnation ("" if it did not)

    @property
    def journal_path(self) -> Path:
        """The calls the worker started (worker/host/held.py), read if it dies: this
        supervisor's own (several clusters on one host share the log folder)."""
        return self.log_path.with_name(f"{self.log_path.stem}-{os.getpid()}.ran")


class Supervisor:
    def __init__(
        self, address: str, token: str, devices: list[DeviceInfo], node: str,
        threads_per_worker: int | None = None, host_budget: int | None = None,
        head_grace: float = 0.0,
    ) -> None:
        self.address = address
        self.token = token
        self.node = node
        log_dir()
        self.slots = {d.key: _Slot(d, log_path=config.worker_log_file(node, d.index))
                      for d in devices}
        self.threads_per_worker = threads_per_worker
        # Gang ranks on this host talk over the interface that reaches the scheduler.
        self.net_env = netif.socket_ifname_env(address, os.environ)
        self.ctx = zmq.Context()
        self.conn = self._connect()
        self.sock = self.conn.sock
        self._running = True
        self._early: list[p.Message] = []
        self.join_log = JoinLog(address)
        self.memory = self._memory_watch(host_budget)
        # On the head's own host (`gpufn serve`): how long to keep the workers without a
        # scheduler, for the next `gpufn serve` to adopt (0: forever, as worker hosts do).
        self.head_grace = head_grace
        # Calls started by workers that died, (ping seq sent after their exit notice, id):
        # a restarted scheduler is told (it may not have heard of the deaths); dropped once
        # a Pong shows the scheduler read the notice.
        self._dead_ran: deque[tuple[int, str]] = deque(maxlen=DEAD_RAN)
        self._ping_seq = 0

    def _connect(self) -> Connection:
        return Connection(self.ctx, ConnectionConfig(self.address, self.token),
                          f"s/{self.node}/{os.getpid()}", p.Role.SUPERVISOR, p.HelloInfo(
                              node=self.node,
                              devices=[s.device.to_wire() for s in self.slots.values()],
                              host_memory=_host_memory(), host=shm.host_id()))

    # ------------------------------------------------------------------ messages

    def _send(self, msg: p.Message) -> None:
        self.sock.send_multipart(p.encode(msg))

    def handshake(self, timeout: float = 30.0) -> None:
        self._early = self.conn.handshake_or_exit(timeout, "supervisor")

    def join(self, attempt_timeout: float = 10.0, give_up_after: float = 0.0) -> bool:
        """Handshake until the scheduler welcomes us, retrying with bounded backoff and
        logging each failed attempt with its reason (unreachable, wrong token, version
        mismatch). False if stopped first, or if `give_up_after` seconds (>0) passed."""
        start = time.monotonic()
        while self._running:
            try:
                self._early = self.conn.handshake(attempt_timeout)
                self.join_log.joined()
                return True
            except GpufnError as e:
                wait = self.join_log.failed(refusal_reason(e))
            if give_up_after and time.monotonic() - start + wait > give_up_after:
                return False
            # A fresh socket: hellos queued on the old one must not all arrive at once
            # when the scheduler appears (each re-registers the devices).
            self.conn.close()
            self.conn = self._connect()
            self.sock = self.conn.sock
            deadline = time.monotonic() + wait
            while self._running and time.monotonic() < deadline:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return False

    # ------------------------------------------------------------------ workers

    def _env(self, d: DeviceInfo) -> dict[str, str]:
        env = dict(os.environ)
        env["GPUFN_TOKEN"] = self.token
        env["GPUFN_ADDRESS"] = self.address  # nested .remote() calls reach the same cluster
        env["CUDA_VISIBLE_DEVICES"] = d.uuid if d.kind == "cuda" else ""
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["GPUFN_NODE_ID"] = self.node
        env.update(self.net_env)
        if self.threads_per_worker:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env[var] = str(self.threads_per_worker)
        return env

    def _spawn(self, slot: _Slot) -> None:
        slot.incarnation += 1
        d = slot.device
        RunJournal.clear(slot.journal_path)  # its predecessor's was read when it ended
        cmd = [sys.executable, "-m", "gpufn.worker", "--address", self.address, "--device", d.key,
               "--incarnation", str(slot.incarnation), "--kind", d.kind,
               "--memory", str(d.memory_total), "--journal", str(slot.journal_path)]
        reports, pipe = self.memory.pipe() if self.memory.enabled else (-1, -1)
        if pipe >= 0:
            cmd += ["--memory-fd", str(pipe)]
        with os.fdopen(open_private_append(slot.log_path), "ab") as logf:
            slot.log_offset = logf.tell()
            slot.proc = subprocess.Popen(
                cmd, env=self._env(d), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                preexec_fn=processes.set_pdeathsig, start_new_session=True,
                pass_fds=(pipe,) if pipe >= 0 else (),
            )
        if pipe >= 0:
            os.close(pipe)
        self.memory.watch(d.key, slot.proc.pid, reports)
        slot.started = time.monotonic()
        log.info("started worker for %s (pid %d)", d.key, slot.proc.pid)

    def _tail(self, slot: _Slot, nbytes: int = 1500) -> str:
        try:
            with open(slot.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(slot.log_offset, f.tell() - nbytes))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def _reap(self, now: float) -> None:
        for key, slot in self.slots.items():
            proc = slot.proc
            if proc is None:
                if now >= slot.restart_at:
                    self._spawn(slot)
                continue
            rc = proc.poll()
            if rc is None:
                continue
            slot.proc = None
            self._stop_leftovers(key, proc.pid)
            seq = self._ping_seq + 1  # the next Ping follows the exit notice sent below
            whole = RunJournal.read_whole(slot.journal_path)
            started = whole if whole is not None else RunJournal.read(slot.journal_path)
            self._dead_ran.extend((seq, inv) for inv in started)
            if slot.memory_kill:
                reason, rc = slot.memory_kill, p.OUT_OF_HOST_MEMORY
            elif slot.kill_reason:
                reason = f"killed by the scheduler: {slot.kill_reason}"
            else:
                reason = f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"
                tail = self._tail(slot)
                if tail:
                    reason += f"; last output: {tail[-600:]}"
            if slot.kill_reason or slot.served or slot.memory_kill:  # started fine: no crash loop
                slot.fast_failures = 0
                slot.restart_at = now
            else:
                slot.fast_failures += 1
                slot.restart_at = now + RESTART_BACKOFF.delay(slot.fast_failures - 1)
            # A kill the scheduler ordered it has reported already (the caller got the
            # Timeout or the cancel): INFO, so it does not trail a script's own last line.
            level = logging.INFO if slot.kill_reason else logging.WARNING
            slot.kill_reason, slot.served, slot.memory_kill = "", False, ""
            log.log(level, "worker for %s (pid %d) ended: %s", key, proc.pid, reason)
            if slot.fast_failures >= GIVE_UP_AFTER:
                wait = config.give_up_retry_seconds()
                slot.restart_at = now + wait
                slot.fast_failures = GIVE_UP_AFTER - 1  # one more failure gives up again
                self._send(p.WorkerExited(key, proc.pid, GAVE_UP, (
                    f"the worker failed to start {GIVE_UP_AFTER} times in a row; trying again "
                    f"in {wait:g}s. Log: {slot.log_path}. {reason}"), slot.incarnation,
                    started, whole is not None))
            else:
                self._send(p.WorkerExited(key, proc.pid, rc, reason, slot.incarnation,
                                          started, whole is not None))

    def _serving(self, msg: p.WorkerServing) -> None:
        slot = self.slots.get(msg.device)
        if slot is not None and slot.proc is not None and slot.proc.pid == msg.pid:
            slot.served = True
            slot.fast_failures = 0

    def _kill(self, msg: p.KillWorker) -> None:
        slot = self.slots.get(msg.device)
        if slot is None or slot.proc is None:
            return
        if msg.pid and slot.proc.pid != msg.pid:
            return  # that process is already gone and replaced
        slot.kill_reason = msg.reason
        try:
            slot.proc.kill()
        except ProcessLookupError:
            pass

    def _on_other(self, msg: p.Message) -> None:
        self.join_log.heard(time.monotonic())
        if isinstance(msg, p.Welcome):
            self.conn.welcomed()
            if msg.ok:
                self.join_log.joined()
            else:  # refused on a re-hello (e.g. restarted with another token): retry later
                self.join_log.refused_again(refusal_reason(msg), time.monotonic())
        elif isinstance(msg, p.Pong):
            while self._dead_ran and self._dead_ran[0][0] <= msg.seq:
                self._dead_ran.popleft()  # the scheduler read the exit notices before it
        elif self.join_log.next_hello is None and self.conn.wants_hello(msg):
            # Forgotten (the scheduler restarted): Hello again, unless refused lately (then
            # the next Hello waits for its backoff), with the calls dead workers ran.
            self.join_log.rejoining()
            self.conn.info.ran = [inv for _, inv in self._dead_ran]
            self.conn.hello()

    def _watch_scheduler(self, now: float) -> None:
        """Log while the scheduler is silent, and say Hello again when a refusal's backoff
        is over; ZeroMQ itself reconnects (with bounded backoff, see `_sockets`). On the
        head's host, stop once the scheduler was away longer than the grace."""
        if self.join_log.hello_due(now):
            self.conn.hello()
        self.join_log.check_silence(now)
        heard = self.join_log.last_heard
        if self.head_grace and heard is not None and now - heard > self.head_grace:
            log.warning("no scheduler at %s for %.0fs (the grace, GPUFN_HEAD_GRACE): "
                        "stopping this host's workers", self.address, now - heard)
            self._running = False

    def stop(self, *_: object) -> None:
        self._running = False

    # ------------------------------------------------------------------ memory and leftovers

    def _memory_watch(self, host_budget: int | None) -> MemoryWatch:
        """The watch over this host's workers: `host_budget` bytes each (0: not watched;
        None: the default share of the host's memory)."""
        limit = proc_table.host_memory_limit()
        budget = default_budget(limit, len(self.slots)) if host_budget is None else host_budget
        watch = MemoryWatch(budget, limit, self.node)
        if watch.enabled:
            log.info("host memory: %.1f GiB; each worker may use %.1f GiB", limit / 2**30,
                     budget / 2**30)
        return watch

    def _watch_memory(self, now: float) -> None:
        """Stop the workers over their host-memory limit, with all they started."""
        for stop in self.memory.tick(now):
            slot = self.slots.get(stop.key)
            if slot is None or slot.proc is None:
                continue
            slot.memory_kill = stop.reason
            log.warning("worker for %s (pid %d) is over its host-memory limit: %s", stop.key,
                        slot.proc.pid, stop.reason)
            self._kill_session(slot.proc.pid)

    @staticmethod
    def _kill_session(pid: int) -> None:
        """SIGKILL a worker's session: its process group, and the members that left it."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc_table.signal_all([pid, *proc_table.in_session(pid)])

    def _stop_leftovers(self, key: str, pid: int) -> None:
        """A worker ended (and was reaped): what it, or its calls, started and left running
        in its session ends too."""
        self.memory.forget(key)
        if proc_table.read(pid) is not None:
            return  # the number is another process's now: its session is not the worker's
        left = proc_table.in_session(pid)
        if left:
            log.warning("stopping %d process(es) the worker for %s left running: %s",
                        len(left), key, left)
            self._kill_session(pid)

    def shutdown_workers(self, grace: float = 2.0) -> None:
        procs = [s.proc for s in self.slots.values() if s.proc is not None]
        for proc in procs:
            try:
                proc.terminate()
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for key, s in self.slots.items():
            if s.proc is not None:
                self._stop_leftovers(key, s.proc.pid)
            s.proc = None
            s.journal_path.unlink(missing_ok=True)
        self.memory.close()

    def serve(self) -> None:
        for slot in self.slots.values():
            self._spawn(slot)
        next_ping = next_sweep = 0.0
        try:
            while self._running:
                if self._early or self.sock.poll(100):
                    while True:
                        if self._early:
                            msgs, self._early = self._early, []
                        else:
                            try:
                                msgs = p.decode_all(self.sock.recv_multipart(zmq.NOBLOCK))
                            except zmq.Again:
                                break
                        for msg in msgs:
                            if isinstance(msg, p.KillWorker):
                                self._kill(msg)
                            elif isinstance(msg, p.WorkerServing):
                                self._serving(msg)
                            elif isinstance(msg, p.Shutdown):
                                log.info("the scheduler asked this host to stop: %s", msg.reason)
                                self._running = False
                            else:
                                self._on_other(msg)
                now = time.monotonic()
                self._watch_scheduler(now)
                self._reap(now)
                self._watch_memory(now)
                if now >= next_ping:
                    self._ping_seq += 1
                    self._send(p.Ping(self._ping_seq))
                    next_ping = now + PING_SECONDS
                if now >= next_sweep:  # big payloads whose caller died (gpufn/wire/shm.py)
                    shm.sweep()
                    next_sweep = now + SHM_SWEEP_SECONDS
        finally:
            self.shutdown_workers()
            try:
                self._send(p.Goodbye("supervisor stopping"))
            except zmq.ZMQError:
                pass
            self.conn.close(200)
            self.ctx.term()


def main(argv: list[str] | None = None) -> None:
    import argparse

    from gpufn.memory_pool.probe import probe_devices
    from gpufn.wire.units import parse_memory

    ap = argparse.ArgumentParser(prog="python -m gpufn.worker.supervisor")
    ap.add_argument("--address", required=True)
    ap.add_argument("--cpu-devices", type=int, default=None)
    ap.add_argument("--device-memory", default=None)
    ap.add_argument("--islands", type=int, default=None)
    ap.add_argument("--force-cpu", action="store_true")
    ap.add_argument("--node", default=None)
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--worker-host-memory", default=None,
                    help="host memory each worker may use, e.g. 32GiB (0: unwatched)")
    ap.add_argument("--head-grace", type=float, default=0.0,
                    help="the head's own host: stop when no scheduler answered this long")
    a = ap.parse_args(argv)
    logging.basicConfig(level=config.log_level(),
                        format="%(asctime)s gpufn-supervisor %(levelname)s %(message)s")
    node = a.node or config.node_id()
    n = a.cpu_devices or config.cpu_devices()
    mem = parse_memory(a.device_memory, "--device-memory") if a.device_memory else config.device_memory()
    islands = a.islands or config.cpu_islands()
    force_cpu = a.force_cpu or config.force_cpu()
    devices = probe_devices(node, cpu_devices=n, device_memory=mem, islands=islands,
                            force_cpu=force_cpu)
    threads = None
    if devices and devices[0].kind == "cpu":
        threads = max(1, (os.cpu_count() or 1) // len(devices))
    host_budget = (parse_memory(a.worker_host_memory, "--worker-host-memory")
                   if a.worker_host_memory is not None else config.worker_host_memory())
    sup = Supervisor(a.address, config.token() or "", devices, node, threads, host_budget,
                     a.head_grace)
    signal.signal(signal.SIGTERM, sup.stop)
    signal.signal(signal.SIGINT, sup.stop)
    processes.watch_parent(a.parent_pid, sup.stop)
    if a.parent_pid:  # started with a local scheduler: it must answer, or we fail
        sup.handshake()
    elif not sup.join(give_up_after=a.head_grace):  # joining: wait as long as it takes
        sup.conn.close()
        sup.ctx.term()
        return
    sup.serve()


if __name__ == "__main__":
    main()
