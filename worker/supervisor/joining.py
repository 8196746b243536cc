"""A worker host's attempts to join (and rejoin) its scheduler: the reason each attempt
failed, the bounded backoff between attempts, and one log line per attempt."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpufn.exceptions import (
    AuthenticationError,
    ConnectionLost,
    GpufnError,
    ProtocolMismatch,
    from_wire,
)
from gpufn.net.connection import Backoff
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.supervisor")

JOIN_BACKOFF_MAX = 30.0
SILENT_AFTER = 6.0  # three supervisor pings unanswered: the scheduler is unreachable


def refusal_reason(e: GpufnError | p.Welcome) -> str:
    """A short reason for a failed join: unreachable, wrong token, version mismatch, ..."""
    if isinstance(e, p.Welcome):
        e = from_wire(e.error_kind, e.message)
    if isinstance(e, ConnectionLost):
        return "unreachable (no answer)"
    if isinstance(e, AuthenticationError):  # e.g. the head came back with a new token
        return (f"wrong token ({e}); this host keeps trying: restart `gpufn worker` with the "
                "cluster's current token (GPUFN_TOKEN), or the head with the previous one "
                "(`gpufn serve --token ...`)")
    if isinstance(e, ProtocolMismatch):
        return f"version mismatch ({e})"
    return f"refused ({type(e).__name__}: {e})"


@dataclass
class JoinLog:
    """What the supervisor knows about its link to the scheduler, and when to try again."""

    address: str
    backoff: Backoff = field(default_factory=lambda: Backoff(
        initial=0.5, maximum=JOIN_BACKOFF_MAX, jitter=0.2))
    last_heard: float | None = None
    silent_logged: float = 0.0  # when silence was last logged
    next_hello: float | None = None  # a refused re-hello is retried then
    attempts: int = 0

    def failed(self, reason: str) -> float:
        """An attempt failed: log it, return the wait before the next one."""
        self.attempts += 1
        wait = self.backoff.next()
        log.warning("cannot join the scheduler at %s (attempt %d): %s; retrying in %.1fs",
                    self.address, self.attempts, reason, wait)
        return wait

    def joined(self) -> None:
        if self.attempts or self.next_hello is not None:
            log.warning("joined the scheduler at %s after %d failed attempt(s)",
                        self.address, self.attempts)
        else:
            log.info("joined the scheduler at %s", self.address)
        self.attempts = 0
        self.backoff.reset()
        self.next_hello = None

    def heard(self, now: float) -> None:
        if self.last_heard is not None and self.silent_logged:
            log.warning("the scheduler at %s answers again", self.address)
            if self.next_hello is None:
                self.attempts = 0
                self.backoff.reset()
        self.last_heard, self.silent_logged = now, 0.0

    def rejoining(self) -> None:
        log.warning("the scheduler at %s does not know this host (it restarted?); "
                    "registering again", self.address)

    def refused_again(self, reason: str, now: float) -> None:
        self.next_hello = now + self.failed(reason)

    def hello_due(self, now: float) -> bool:
        if self.next_hello is None or now < self.next_hello:
            return False
        self.next_hello = None
        return True

    def check_silence(self, now: float) -> None:
        """Log (with backoff between lines) while the scheduler does not answer."""
        if self.last_heard is None:
            self.last_heard = now
            return
        silent = now - self.last_heard
        if silent < SILENT_AFTER:
            return
        if not self.silent_logged or now - self.silent_logged >= self.backoff.delay(self.attempts):
            self.attempts += 1
            self.silent_logged = now
            log.warning("the scheduler at %s is unreachable (silent for %.0fs, attempt %d); "
                        "still retrying", self.address, silent, self.attempts)
