"""Streamed values and attached callers: the scheduler's side of generator calls and of
`FunctionCall.from_id`.

It handles its own messages (`Item`, `Credit`, `Attach`); the core tells it of each call
it admits (`admitted`), and as a `RunObserver` it hears each call's final Result. `Item`s
from a call's rank-0 worker pass through to the caller, never unpickled, in order and
before the call's Result (one socket each way keeps the order); the caller's `Credit`s go
to that worker. A Submit with `keep` has its Result kept (a bounded book) for callers in
other processes; `Attach` adds such a caller to a live call's Result, or answers from
the book.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gpufn.exceptions import GpufnError, kind_of
from gpufn.scheduler.records import Invocation
from gpufn.scheduler.states import InvState
from gpufn.scheduler.surface import CoreView
from gpufn.scheduler.transitions import RunObserver
from gpufn.scheduler.users import sees
from gpufn.wire import protocol as p

KEEP_RESULTS = 4096  # kept Results of spawned calls, newest last
KEEP_BYTES = 256 * 2**20  # and their payload bytes at most


def _nbytes(frames: tuple[Any, ...]) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)


class StreamDesk(RunObserver):
    def __init__(self, core: CoreView) -> None:
        self.core = core
        self.keep: set[str] = set()  # live calls whose Result is kept
        self.kept: OrderedDict[str, p.Result] = OrderedDict()
        self.kept_user: dict[str, str] = {}  # whose each kept Result is (users.sees)
        self.kept_bytes = 0
        self.watchers: dict[str, set[bytes]] = {}  # call id -> attached peers

    def handlers(self) -> dict[type, Any]:
        return {p.Item: self._on_item, p.Credit: self._on_credit, p.Attach: self._on_attach}

    # ------------------------------------------------------------------ streams

    def _on_item(self, peer: bytes, msg: p.Item, now: float) -> None:
        core = self.core
        inv = core.invocations.get(msg.invocation_id)
        d = core.device_of(peer)
        if (inv is None or d is None or inv.state is not InvState.RUNNING or not inv.devices
                or msg.dispatch_token != inv.dispatch_token or inv.devices[0] != d.key):
            return  # a stopped run's late value, or not rank 0's
        inv.items += 1
        if inv.client in core.peers:
            core.send(inv.client, msg)

    def _on_credit(self, peer: bytes, msg: p.Credit, now: float) -> None:
        core = self.core
        inv = core.invocations.get(msg.invocation_id)
        if inv is None or inv.client != peer or inv.state is not InvState.RUNNING or not inv.devices:
            return
        d = core.devices.get(inv.devices[0])
        target = (d.control or d.worker) if d is not None else None
        if target is not None:
            core.send(target, p.Credit(inv.id, inv.dispatch_token, msg.allowed))

    # ------------------------------------------------------------------ attached callers

    def admitted(self, inv: Invocation, keep: bool) -> None:
        """A call was admitted; with `keep` its Result is kept for `FunctionCall.from_id`."""
        if keep:
            self.keep.add(inv.id)

    def _on_attach(self, peer: bytes, msg: p.Attach, now: float) -> None:
        core = self.core
        viewer = core.peers.get(peer)  # another user's call is answered as an unknown one
        inv_id = msg.invocation_id
        inv = core.invocations.get(inv_id)
        if inv is not None and sees(viewer, inv.user):
            self.watchers.setdefault(inv_id, set()).add(peer)
            return
        kept = self.kept.get(inv_id)
        if inv is None and kept is not None and sees(viewer, self.kept_user.get(inv_id, "")):
            core.send(peer, kept)
            return
        core.send(peer, p.Result(msg.invocation_id, False, kind_of(GpufnError), (
            f"the scheduler knows no call {msg.invocation_id}: it never existed, or it ended "
            f"and its result is no longer kept (the last {KEEP_RESULTS} spawned calls' "
            "results are)")))

    def call_ended(self, inv: Invocation, result: p.Result) -> None:
        """A call ended: attached callers get its Result; a spawned call's is kept."""
        for peer in self.watchers.pop(inv.id, ()):
            if peer != inv.client and peer in self.core.peers:
                self.core.send(peer, result)
        if inv.id not in self.keep:
            return
        self.keep.discard(inv.id)
        self.kept[inv.id] = result
        self.kept_user[inv.id] = inv.user
        self.kept_bytes += _nbytes(result.frames)
        while self.kept and (len(self.kept) > KEEP_RESULTS or self.kept_bytes > KEEP_BYTES):
            old_id, old = self.kept.popitem(last=False)
            self.kept_user.pop(old_id, None)
            self.kept_bytes -= _nbytes(old.frames)
