"""`gpufn serve`'s processes: a scheduler it restarts when it dies, and a supervisor of
this host's workers that outlives `gpufn serve` itself, for the next one to adopt.

A head restart is something no caller notices (DESIGN principle 13). So the supervisor
is not tied to this process: when `gpufn serve` dies (SIGKILL) or is stopped to be
restarted (SIGTERM), the scheduler stops (it follows its parent) but the supervisor and
its workers keep running their calls, reconnecting, for the grace (`GPUFN_HEAD_GRACE`,
60 s); a new `gpufn serve` on the same state directory and address adopts them from
the record it finds there (`head.json`, 0600: pids, start times, address, a hash of the
token). A scheduler that dies under a running `gpufn serve` is started again at once.
Only a final stop stops everything: `gpufn shutdown` (the scheduler drains and tells
every host to stop), or Ctrl-C / SIGINT of `gpufn serve`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from gpufn.cluster.embedded import LocalCluster
from gpufn.exceptions import GpufnError
from gpufn.net import processes
from gpufn.wire import protocol

log = logging.getLogger("gpufn.head")

RECORD = "head.json"
EXIT_RESTART = protocol.EXIT_RESTART
RESTARTS = 5  # scheduler restarts within RESTART_WINDOW_S before `gpufn serve` gives up
RESTART_WINDOW_S = 60.0
OLD_SCHEDULER_WAIT_S = 10.0  # for the scheduler of a dead `gpufn serve` to notice and go


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def read_record(state_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((state_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stop_pid(pid: int, started: int | None, sig: int, grace: float) -> None:
    """Signal a process that is not our child and wait until it is gone (then SIGKILL)."""
    if not processes.same(pid, started):
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while processes.same(pid, started):
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace
        time.sleep(0.05)


def stop_recorded(state_dir: Path) -> bool:
    """Stop, for good, the head recorded in `state_dir` when its scheduler does not
    answer (`gpufn shutdown --force`): its `gpufn serve` (SIGINT: it stops the rest), or
    the supervisor a dead one left waiting. True if there was one to stop."""
    rec = read_record(state_dir)
    if rec is None:
        return False
    found = False
    for key, sig, grace in (("serve", signal.SIGINT, 30.0), ("supervisor", signal.SIGTERM, 10.0)):
        if key == "serve":
            pid, started = int(rec.get("serve") or 0), rec.get("serve_started")
        else:
            pid, started = (int(rec[key][0]), rec[key][1]) if rec.get(key) else (0, None)
        if processes.same(pid, started):
            found = True
            _stop_pid(pid, started, sig, grace)
    (state_dir / RECORD).unlink(missing_ok=True)
    return found


class Head:
    def __init__(self, cluster: LocalCluster, state_dir: Path) -> None:
        self.cluster = cluster
        self.state_dir = state_dir
        self.supervisor: tuple[int, int | None] | None = None  # (pid, start time)
        self.adopted = False
        self._leaving = False  # SIGTERM: stop to be restarted, leave the workers running
        self._restarts: list[float] = []

    # ------------------------------------------------------------------ start

    def start(self) -> tuple[str, str]:
        """Start the scheduler; adopt the supervisor a previous `gpufn serve` left (same
        address and token), else start one. Returns (address, token)."""
        old = read_record(self.state_dir)
        if old is not None:
            serve = int(old.get("serve", 0))
            if serve != os.getpid() and processes.alive(serve) and \
                    processes.same(serve, old.get("serve_started")):
                raise GpufnError(f"another gpufn serve (pid {serve}) uses the state directory "
                                 f"{self.state_dir}; stop it first (gpufn shutdown)")
            sched = old.get("scheduler") or [0, None]
            # Its parent died: it notices within a second and goes; make sure it has.
            _stop_pid(int(sched[0]), sched[1], 0, OLD_SCHEDULER_WAIT_S)
        address, token = self.cluster.start(supervise=False)
        sup = (old or {}).get("supervisor")
        if sup and processes.same(int(sup[0]), sup[1]):
            assert old is not None
            if (self.cluster.workers and old.get("address") == address
                    and old.get("token") == _token_hash(token)
                    and old.get("workers") == self._worker_options()):
                self.supervisor, self.adopted = (int(sup[0]), sup[1]), True
                log.warning("adopted the workers of the previous gpufn serve (supervisor "
                            "pid %d)", sup[0])
            else:  # another address, token or device options: replaced (their calls are lost)
                log.warning("the previous gpufn serve's workers (supervisor pid %d) are "
                            "replaced: %s changed", sup[0], self._what_changed(old, address, token))
                _stop_pid(int(sup[0]), sup[1], signal.SIGTERM, 10.0)
        if self.supervisor is None and self.cluster.workers:
            self.cluster.start_supervisor()
            assert self.cluster.supervisor is not None
            pid = self.cluster.supervisor.pid
            self.supervisor = (pid, processes.start_time(pid))
        try:
            self._write(address, token)
        except OSError as e:  # a full state disk: nothing is left running
            self.stop()
            raise GpufnError(f"cannot write {self.state_dir / RECORD} ({e.strerror}): free "
                             "space on the state directory and start again") from None
        return address, token

    def _worker_options(self) -> dict[str, Any]:
        """What this host's workers were started with: a supervisor started otherwise
        is replaced, not adopted (its devices would not be the ones asked for)."""
        from gpufn.wire import config

        c = self.cluster
        return {"cpu_devices": c.cpu_devices, "device_memory": c.device_memory,
                "islands": c.islands, "host_memory": config.worker_host_memory(),
                "workers": c.workers}

    def _what_changed(self, old: dict[str, Any], address: str, token: str) -> str:
        if not self.cluster.workers:
            return "--no-workers"
        if old.get("address") != address:
            return f"the address ({old.get('address')} -> {address})"
        if old.get("token") != _token_hash(token):
            return "the token"
        before = old.get("workers") or {}
        now = self._worker_options()
        return ", ".join(f"{k} ({before.get(k)} -> {v})" for k, v in now.items()
                         if before.get(k) != v) or "the device options"

    def _write(self, address: str, token: str) -> None:
        sched = self.cluster.scheduler
        record = {"address": address, "token": _token_hash(token), "serve": os.getpid(),
                  "serve_started": processes.start_time(os.getpid()),
                  "scheduler": [sched.pid, processes.start_time(sched.pid)] if sched else None,
                  "supervisor": list(self.supervisor) if self.supervisor else None,
                  "workers": self._worker_options()}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / RECORD
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Until a final stop: start the scheduler again each time it dies (at most
        `RESTARTS` times a minute). Returns the exit code for `gpufn serve`."""
        while True:
            sched = self.cluster.scheduler
            assert sched is not None
            if self._leaving:  # SIGTERM while it was started again: `leave` saw the dead one
                self.leave()
            code = sched.wait()
            if self._leaving:
                return 0
            if code == 0:  # drained (gpufn shutdown) or stopped for good
                self.stop()
                return 0
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
            if len(self._restarts) >= RESTARTS:
                log.error("the scheduler died %d times within %.0fs; stopping", RESTARTS,
                          RESTART_WINDOW_S)
                self.stop()
                return 1
            self._restarts.append(now)
            why = "was restarted" if code == EXIT_RESTART else f"died (exit status {code})"
            log.warning("the scheduler %s; starting it again on %s", why, self.cluster.address)
            try:
                address = self.cluster.restart_scheduler()
            except GpufnError as e:
                log.error("the scheduler did not start again: %s", e)
                continue  # counted: a few more tries, then give up
            try:
                self._write(address, self.cluster.token)
            except OSError as e:  # a full state disk must not stop the head
                log.error("could not write %s (%s): a gpufn serve started after this one "
                          "cannot adopt this host's workers", self.state_dir / RECORD, e)

    # ------------------------------------------------------------------ stop

    @property
    def leaving(self) -> bool:
        return self._leaving

    def leave(self) -> None:
        """SIGTERM: stop to be restarted. The scheduler tells clients to wait; the
        workers keep running for the next `gpufn serve` (within the grace)."""
        self._leaving = True
        sched = self.cluster.scheduler
        if sched is not None and sched.poll() is None:
            sched.terminate()

    def stop(self) -> None:
        """For good: the scheduler's clients' calls fail, this host's workers stop."""
        sched = self.cluster.scheduler
        if sched is not None and sched.poll() is None:
            sched.send_signal(signal.SIGINT)
        if self.supervisor is not None:
            own = self.cluster.supervisor
            if own is not None and own.pid == self.supervisor[0]:
                self.cluster.stop()
            else:
                _stop_pid(*self.supervisor, signal.SIGTERM, 10.0)
                self.cluster.stop()
        else:
            self.cluster.stop()
        self.supervisor = None
        (self.state_dir / RECORD).unlink(missing_ok=True)

    def wait_left(self, grace: float = 10.0) -> None:
        """After `leave`: wait for the scheduler to be gone (the supervisor stays)."""
        sched = self.cluster.scheduler
        if sched is None:
            return
        try:
            sched.wait(grace)
        except Exception:
            sched.kill()
            sched.wait()
