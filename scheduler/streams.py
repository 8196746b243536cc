"""Streamed values and attached callers: the scheduler's side of generator calls and of
`FunctionCall.from_id`.

It plugs into the core like the ops desk, without growing it. `Item`s from a call's
rank-0 worker pass through to the caller, never unpickled, in order and before the
call's Result (one socket each way keeps the order); the caller's `Credit`s go to that
worker. A Submit with the option `keep` has its Result kept (a bounded book) for
callers in other processes; `Attach` adds such a caller to a live call's Result, or
answers from the book.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from gpufn.exceptions import GpufnError, kind_of
from gpufn.scheduler.states import InvState
from gpufn.wire import protocol as p

if TYPE_CHECKING:
    from gpufn.scheduler.core import SchedulerCore
    from gpufn.scheduler.records import Invocation

KEEP_RESULTS = 4096  # kept Results of spawned calls, newest last
KEEP_BYTES = 256 * 2**20  # and their payload bytes at most


def _nbytes(frames: tuple[Any, ...]) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)


class StreamDesk:
    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.keep: set[str] = set()  # live calls whose Result is kept
        self.kept: OrderedDict[str, p.Result] = OrderedDict()
        self.kept_bytes = 0
        self.watchers: dict[str, set[bytes]] = {}  # call id -> attached peers
        inner_submit = core._handlers[p.Submit]
        core._handlers.update({
            p.Item: self._on_item, p.Credit: self._on_credit, p.Attach: self._on_attach,
            p.Submit: lambda peer, msg, now: self._on_submit(inner_submit, peer, msg, now),
        })
        core.tx.on_result = self.on_result

    def _allowed(self, peer: bytes, msg: p.Message, role: str) -> bool:
        """Only `role` may send `msg` (the core has checked that the peer said Hello)."""
        known = self.core.peers.get(peer)
        if known is not None and known.role == role:
            return True
        self.core._send(peer, p.Error(kind_of(GpufnError), (
            f"a {known.role if known else 'stranger'} may not send {type(msg).__name__}")))
        return False

    # ------------------------------------------------------------------ streams

    def _on_item(self, peer: bytes, msg: p.Item, now: float) -> None:
        core = self.core
        if not self._allowed(peer, msg, p.Role.WORKER):
            return
        inv = core.invocations.get(msg.invocation_id)
        d = core._device_of(peer)
        if (inv is None or d is None or inv.state is not InvState.RUNNING or not inv.devices
                or msg.dispatch_token != inv.dispatch_token or inv.devices[0] != d.key):
            return  # a stopped run's late value, or not rank 0's
        inv.items += 1
        if inv.client in core.peers:
            core._send(inv.client, msg)

    def _on_credit(self, peer: bytes, msg: p.Credit, now: float) -> None:
        core = self.core
        if not self._allowed(peer, msg, p.Role.CLIENT):
            return
        inv = core.invocations.get(msg.invocation_id)
        if inv is None or inv.client != peer or inv.state is not InvState.RUNNING or not inv.devices:
            return
        d = core.devices.get(inv.devices[0])
        target = (d.control or d.worker) if d is not None else None
        if target is not None:
            core._send(target, p.Credit(inv.id, inv.dispatch_token, msg.allowed))

    # ------------------------------------------------------------------ attached callers

    def _on_submit(self, inner: Any, peer: bytes, msg: p.Submit, now: float) -> None:
        keep = isinstance(msg.options, dict) and bool(msg.options.get("keep"))
        if isinstance(msg.options, dict) and "keep" in msg.options:
            msg = p.Submit(msg.invocation_id, msg.function_id,
                           {k: v for k, v in msg.options.items() if k != "keep"}, msg.frames)
        inner(peer, msg, now)
        if keep and msg.invocation_id in self.core.invocations:
            self.keep.add(msg.invocation_id)

    def _on_attach(self, peer: bytes, msg: p.Attach, now: float) -> None:
        if not self._allowed(peer, msg, p.Role.CLIENT):
            return
        core = self.core
        if msg.invocation_id in core.invocations:
            self.watchers.setdefault(msg.invocation_id, set()).add(peer)
            return
        kept = self.kept.get(msg.invocation_id)
        if kept is not None:
            core._send(peer, kept)
            return
        core._send(peer, p.Result(msg.invocation_id, False, kind_of(GpufnError), (
            f"the scheduler knows no call {msg.invocation_id}: it never existed, or it ended "
            f"and its result is no longer kept (the last {KEEP_RESULTS} spawned calls' "
            "results are)")))

    def on_result(self, inv: Invocation, result: p.Result) -> None:
        """A call ended: attached callers get its Result; a spawned call's is kept."""
        for peer in self.watchers.pop(inv.id, ()):
            if peer != inv.client and peer in self.core.peers:
                self.core._send(peer, result)
        if inv.id not in self.keep:
            return
        self.keep.discard(inv.id)
        self.kept[inv.id] = result
        self.kept_bytes += _nbytes(result.frames)
        while self.kept and (len(self.kept) > KEEP_RESULTS or self.kept_bytes > KEEP_BYTES):
            _, old = self.kept.popitem(last=False)
            self.kept_bytes -= _nbytes(old.frames)
