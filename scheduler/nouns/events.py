"""What the scheduler core consumes and produces: events from its shell, sends to peers."""

from __future__ import annotations

from dataclasses import dataclass

from gpufn.wire import protocol as p


@dataclass(frozen=True, slots=True)
class Received:
    """A message from a peer (by ZeroMQ identity)."""

    peer: bytes
    msg: p.Message


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: timeouts, heartbeats, deadlines and batch waits are checked."""


@dataclass(frozen=True, slots=True)
class Unreachable:
    """The shell could not deliver to this peer: it is gone."""

    peer: bytes


@dataclass(frozen=True, slots=True)
class RendezvousReady:
    """The shell's gang rendezvous store listens on this port."""

    port: int


@dataclass(frozen=True, slots=True)
class RendezvousFailed:
    """The shell could not start the gang rendezvous store."""

    error: str


@dataclass(frozen=True, slots=True)
class Stalled:
    """The shell's loop woke `seconds` later than it asked to: the scheduler itself was
    stopped (SIGSTOP, a frozen VM, swap), so peers' silence in that time is not theirs."""

    seconds: float


Event = Received | Tick | Unreachable | RendezvousReady | RendezvousFailed | Stalled


@dataclass(frozen=True, slots=True)
class Send:
    """A message for the shell to deliver."""

    peer: bytes
    msg: p.Message
