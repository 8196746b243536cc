"""After a scheduler restart: which resubmitted calls already ran under the old one.

A client the scheduler does not know (it restarted) says so in its Hello and then
resubmits every call it still waits for; the new scheduler cannot tell a call that was
queued from one that was running. Workers that register again list the calls they ran
lately (still running, or finished with a result that may have died with the old
scheduler). A resubmitted call that a worker ran cannot be known to have completed, so
it counts as an attempt lost with its worker: retried when `retries` allows, else it
fails with `WorkerLost`. Calls resubmitted in the first `restart_grace_seconds` after the
scheduler started wait until then, so that the workers can register (and say what they
ran) first; a client forgotten later (it fell silent) resubmits with no wait.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpufn.wire import protocol as p

RAN_MEMORY_SECONDS = 300.0  # how long a worker's report waits for its call's resubmit


class Recovery:
    def __init__(self, grace: float, instance: str = "") -> None:
        self.grace = grace
        self.instance = instance  # this scheduler's id: a client that knew it was not restarted
        self.ran: dict[str, float] = {}  # invocation id -> when a worker said it ran
        self._resubmit_until: dict[bytes, float] = {}  # client -> end of its grace
        self.began: float | None = None  # when this scheduler handled its first event

    def client_hello(self, peer: bytes, info: p.HelloInfo, now: float) -> None:
        if self.began is None:
            self.began = now
        same = bool(self.instance) and info.instance == self.instance  # only forgotten
        if info.resubmit and not same and now < self.began + self.grace:  # restarted
            self._resubmit_until[peer] = self.began + self.grace

    def not_before(self, peer: bytes, now: float) -> float:
        """When a call this client submits may start (0: at once)."""
        until = self._resubmit_until.get(peer, 0.0)
        if until <= now:
            self._resubmit_until.pop(peer, None)
            return 0.0
        return until

    def worker_ran(self, ids: Iterable[Any], now: float) -> list[str]:
        """Remember what a registering worker ran; returns the ids."""
        if len(self.ran) > 100_000 or any(now - t > RAN_MEMORY_SECONDS for t in
                                          list(self.ran.values())[:1]):
            self.ran = {k: t for k, t in self.ran.items() if now - t <= RAN_MEMORY_SECONDS}
        out = [str(i) for i in ids]
        for inv_id in out:
            self.ran[inv_id] = now
        return out

    def ran_before(self, invocation_id: str) -> bool:
        return self.ran.pop(invocation_id, None) is not None
