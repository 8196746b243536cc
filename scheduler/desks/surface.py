"""What the core's desks may use of it: a small, typed surface instead of its privates.

The desks (operations, streams, apps) and the status report are handed the core as a
`CoreView`; they read its books and send through `send`, and never import the core, so
the core depends on them and not the other way round.
"""

from __future__ import annotations

from typing import Protocol

from gpufn.scheduler.books.model_book import ModelBook
from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.calls.transitions import Transitions
from gpufn.scheduler.nouns.records import Device, FunctionRecord, Invocation, Peer
from gpufn.scheduler.nouns.settings import SchedulerConfig
from gpufn.wire import protocol as p


class CoreView(Protocol):
    """The books a desk reads, and how it sends (see `SchedulerCore`)."""

    config: SchedulerConfig
    peers: dict[bytes, Peer]
    devices: dict[str, Device]
    functions: dict[str, FunctionRecord]
    invocations: dict[str, Invocation]
    queue: ReadyQueue
    models: ModelBook
    tx: Transitions

    def send(self, peer: bytes, msg: p.Message) -> None: ...

    def device_of(self, peer: bytes) -> Device | None: ...

    def wall(self, now: float) -> float: ...

    def kill_worker(self, d: Device, now: float, reason: str) -> None: ...

