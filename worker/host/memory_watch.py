"""The supervisor's host-memory watch: each worker's resident memory, its children's
included, against a budget; over it, the worker is stopped (and replaced) from outside.

As Dask's nanny watches its worker's RSS and restarts it past a fraction of its memory
limit, the supervisor samples every worker every `SAMPLE_S`: the resident bytes of the
worker and of every process in its session (a worker leads its own session, and what
its calls start stays in it unless it calls setsid). A worker over its limit is measured
again by PSS (pages a forked child shares with its parent counted once), and if that is
over too, its whole session is killed; the supervisor reports it, and the scheduler fails
the calls it was running with `HostOutOfMemory`. Nothing outside that session is touched.

A worker's limit is the host's per-worker budget (`gpufn serve/worker
--worker-host-memory`, GPUFN_WORKER_HOST_MEMORY; by default `DEFAULT_SHARE` of the host's
memory split between its workers), or while calls that declare `@gpu(host_memory=...)`
run, the largest of those; plus the bytes of models the worker keeps in host memory
(offloaded, or resident on a simulated CPU device), which the scheduler's host ledger
bounds. No limit exceeds `HOST_CEILING` of the host's memory, and when the workers
together pass it, the one using the most beside its models is stopped.

The worker tells its supervisor what it declares over a pipe (`Reports`): a line
"declared models\n" whenever either changes, which happens only around calls that declare
`host_memory` and model loads and offloads.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from gpufn.worker.host import proc_table

log = logging.getLogger("gpufn.supervisor")

SAMPLE_S = 0.2  # how often each worker's resident bytes are read
SCAN_S = 2.0  # how often the processes in each worker's session are found again...
DEFAULT_SHARE = 0.8  # of the host's memory, split between its workers by default
HOST_CEILING = 0.95  # of the host's memory: no worker's limit, nor all of them together
HOW_TO_RAISE = ("declare more with @gpu(host_memory=...), or give this host's workers more "
                "with `gpufn worker --worker-host-memory SIZE` (or `gpufn serve "
                "--worker-host-memory`; GPUFN_WORKER_HOST_MEMORY)")


def format_bytes(n: int) -> str:
    """GiB with two decimals (a limit and a use just over it must read differently)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def default_budget(host_limit: int, workers: int) -> int:
    return int(host_limit * DEFAULT_SHARE / max(1, workers))


@dataclass
class Budget:
    """What one worker may use."""

    default: int  # the host's per-worker budget (0: not watched)
    declared: int = 0  # the largest @gpu(host_memory=) of the calls running (0: none)
    models: int = 0  # bytes of models the worker keeps in host memory

    def limit(self, ceiling: int) -> int:
        """Its limit in bytes (0: none)."""
        base = self.declared or self.default
        if not base:
            return 0
        return min(ceiling, base + self.models) if ceiling else base + self.models

    def source(self) -> str:
        if self.declared:
            return f"the {format_bytes(self.declared)} its call declared with @gpu(host_memory=)"
        return f"this host's budget of {format_bytes(self.default)} per worker"


@dataclass(frozen=True, slots=True)
class Stop:
    """A worker to stop, and why (the text the caller's error carries)."""

    key: str
    used: int
    limit: int
    reason: str


def over_budget(used: dict[str, int], budgets: dict[str, Budget], ceiling: int,
                node: str) -> list[Stop]:
    """The workers to stop: each one over its own limit, then, if all of them together
    are over the host's ceiling, the one using the most beside its models."""
    stops = []
    for key, n in used.items():
        b = budgets.get(key)
        limit = b.limit(ceiling) if b is not None else 0
        if b is not None and limit and n > limit:
            models = f" (with {format_bytes(b.models)} of models in host memory)" if b.models else ""
            stops.append(Stop(key, n, limit, (
                f"its worker on host {node} used {format_bytes(n)} of host memory, over its "
                f"limit of {format_bytes(limit)}: {b.source()}{models}. The worker was stopped "
                f"and replaced. To raise the limit, {HOW_TO_RAISE}")))
    total = sum(used.values())
    if ceiling and total > ceiling and not stops:
        key = max(used, key=lambda k: used[k] - (budgets[k].models if k in budgets else 0))
        stops.append(Stop(key, used[key], ceiling, (
            f"the workers on host {node} together used {format_bytes(total)} of host memory, "
            f"over {HOST_CEILING:.0%} of its {format_bytes(int(ceiling / HOST_CEILING))}; this "
            f"worker used the most ({format_bytes(used[key])}) and was stopped and replaced. "
            f"Run fewer such calls at once on this host, or {HOW_TO_RAISE.split(', or ')[0]} "
            "so that the scheduler knows")))
    return stops


@dataclass
class _Watched:
    pid: int
    reports: int  # read end of the worker's pipe (-1: none)
    budget: Budget
    resident: dict[int, proc_table.Resident] = field(default_factory=dict)  # pid -> reader
    buffer: bytes = b""

    def close(self) -> None:
        for r in self.resident.values():
            r.close()
        self.resident.clear()
        if self.reports >= 0:
            try:
                os.close(self.reports)
            except OSError:
                pass
            self.reports = -1


class MemoryWatch:
    """Samples the supervisor's workers; `tick` returns the ones to stop."""

    def __init__(self, budget: int, host_limit: int, node: str) -> None:
        self.budget = budget
        self.host_limit = host_limit
        self.ceiling = int(host_limit * HOST_CEILING)
        self.node = node
        self.enabled = proc_table.HAS_PROC and budget > 0
        self._workers: dict[str, _Watched] = {}
        self._next_sample = 0.0
        self._next_scan = 0.0
        self._available_at_scan: int | None = None

    def pipe(self) -> tuple[int, int]:
        """A (read, write) pair for a worker about to start: it writes its reports."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        return r, w

    def watch(self, key: str, pid: int, reports: int = -1) -> None:
        self.forget(key)
        if not self.enabled:
            if reports >= 0:
                os.close(reports)
            return
        w = self._workers[key] = _Watched(pid, reports, Budget(self.budget))
        try:
            w.resident[pid] = proc_table.Resident(pid)
        except OSError:
            pass
        self._next_scan = 0.0  # find its session's members at the next tick

    def forget(self, key: str) -> None:
        w = self._workers.pop(key, None)
        if w is not None:
            w.close()

    def close(self) -> None:
        for key in list(self._workers):
            self.forget(key)

    def limits(self) -> dict[str, int]:
        return {k: w.budget.limit(self.ceiling) for k, w in self._workers.items()}

    # ------------------------------------------------------------------ sampling

    def tick(self, now: float) -> list[Stop]:
        if not self._workers or now < self._next_sample:
            return []
        self._next_sample = now + SAMPLE_S
        for w in self._workers.values():
            self._read_reports(w)
        if now >= self._next_scan or self._memory_fell():
            self._scan()
            self._next_scan = now + SCAN_S
        used = {k: sum(r.bytes() for r in w.resident.values()) for k, w in self._workers.items()}
        budgets = {k: w.budget for k, w in self._workers.items()}
        stops = over_budget(used, budgets, self.ceiling, self.node)
        if not stops:
            return []
        # Over by resident bytes: measure again by PSS (a fork's shared pages once) first.
        self._scan()
        used = {k: self._proportional(w) for k, w in self._workers.items()}
        stops = over_budget(used, budgets, self.ceiling, self.node)
        for s in stops:
            self.forget(s.key)  # stopped now; a new worker is watched when it starts
        return stops

    def _memory_fell(self) -> bool:
        """...and at once when the host's available memory fell by a quarter of a worker's
        budget (or a twentieth of the host) since the last scan: something allocates fast,
        perhaps a child not found yet."""
        if self._available_at_scan is None or not self.host_limit:
            return False
        now = proc_table.available_memory()
        drop = min(self.host_limit / 20, self.budget / 4)
        return now is not None and self._available_at_scan - now > drop

    def _scan(self) -> None:
        """Find every worker's session members again (a new child, one that ended)."""
        self._available_at_scan = proc_table.available_memory()
        by_session: dict[int, list[int]] = {}
        for proc in proc_table.snapshot():
            by_session.setdefault(proc.session, []).append(proc.pid)
        for w in self._workers.values():
            members = set(by_session.get(w.pid, [])) | {w.pid}
            for pid in [p for p in w.resident if p not in members]:
                w.resident.pop(pid).close()
            for pid in members - set(w.resident):
                try:
                    w.resident[pid] = proc_table.Resident(pid)
                except OSError:
                    pass

    @staticmethod
    def _proportional(w: _Watched) -> int:
        total = 0
        for pid, r in w.resident.items():
            n = proc_table.pss(pid)
            total += r.bytes() if n is None else n
        return total

    def _read_reports(self, w: _Watched) -> None:
        if w.reports < 0:
            return
        try:
            while True:
                chunk = os.read(w.reports, 4096)
                if not chunk:  # the worker closed it (it exited)
                    os.close(w.reports)
                    w.reports = -1
                    break
                w.buffer += chunk
        except BlockingIOError:
            pass
        except OSError:
            return
        *lines, w.buffer = w.buffer.split(b"\n")
        for line in lines[-1:]:  # only the latest state matters
            try:
                declared, models = (int(x) for x in line.split())
            except ValueError:
                log.warning("unreadable memory report from worker %d: %r", w.pid, line[:80])
                continue
            w.budget.declared, w.budget.models = max(0, declared), max(0, models)


class Reports:
    """The worker's end: what it declares (calls' host_memory, models' host bytes), sent to
    its supervisor when it changes. Thread-safe enough: one small write per change."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._declared: dict[str, int] = {}  # running call -> its host_memory
        self._models = 0
        self._sent: tuple[int, int] = (0, 0)
        self._lock = threading.Lock()
        if fd >= 0:
            os.set_blocking(fd, False)

    def call_started(self, invocation_id: str, host_memory: int) -> None:
        with self._lock:
            self._declared[invocation_id] = host_memory
            self._send()

    def call_ended(self, invocation_id: str) -> None:
        with self._lock:
            if self._declared.pop(invocation_id, None) is not None:
                self._send()

    def models(self, nbytes: int) -> None:
        with self._lock:
            self._models = nbytes
            self._send()

    def _send(self) -> None:
        state = (max(self._declared.values(), default=0), self._models)
        if self.fd < 0 or state == self._sent:
            return
        try:
            os.write(self.fd, f"{state[0]} {state[1]}\n".encode())
            self._sent = state
        except BlockingIOError:  # the supervisor is behind: the next change sends it
            pass
        except OSError:
            self.fd = -1  # the supervisor is gone

