"""Streamed values and attached callers: the scheduler's side of generator calls and of
`FunctionCall.from_id`.

It handles its own messages (`Item`, `Credit`, `Attach`); the core tells it of each call
it admits (`admitted`), and as a `RunObserver` it hears each call's final Result. `Item`s
from a call's rank-0 worker pass through to the caller, never unpickled, in order and
before the call's Result (one socket each way keeps the order); the caller's `Credit`s go
to that worker. A Submit with `keep` (a spawned call) has its Result kept for callers in
other processes; `Attach` adds such a caller to a live call's Result, or answers from
the books. Spawned calls of deployed functions outlive their spawner (`outlives`): their
Results are kept on disk (`KeptResults`, retained for a day by default); those of
functions defined in the caller's process are kept in memory (the last `KEEP_RESULTS`)
and are cancelled with their spawner. A kept Result names its owner, the caller's user:
only the same user reads it (`readable`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gpufn.exceptions import GpufnError, kind_of
from gpufn.scheduler.kept_results import KeptResult, KeptResults
from gpufn.scheduler.records import Invocation
from gpufn.scheduler.states import InvState
from gpufn.scheduler.surface import CoreView
from gpufn.scheduler.transitions import RunObserver
from gpufn.scheduler.users import sees
from gpufn.wire import protocol as p

KEEP_RESULTS = 4096  # kept Results of spawned calls (in memory), newest last
KEEP_BYTES = 256 * 2**20  # and their payload bytes at most
EXPIRE_EVERY_S = 60.0  # how often results past their retention leave the disk book


def _nbytes(frames: tuple[Any, ...]) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)


class StreamDesk(RunObserver):
    def __init__(self, core: CoreView, results: KeptResults | None = None) -> None:
        self.core = core
        self.keep: set[str] = set()  # live calls whose Result is kept
        self.kept: OrderedDict[str, KeptResult] = OrderedDict()  # ad-hoc functions' calls
        self.kept_bytes = 0
        self.results = results if results is not None else KeptResults(None)  # (on disk)
        self.watchers: dict[str, set[bytes]] = {}  # call id -> attached peers
        self._next_expiry = 0.0

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

    def outlives(self, inv: Invocation) -> bool:
        """Whether the call goes on when its spawner leaves: spawned, of a deployed function."""
        return bool(inv.function.app) and inv.id in self.keep

    def readable(self, peer: bytes, owner: str) -> bool:
        """Whether `peer` may read a call owned by `owner`: the same user, or an admin
        (`users.sees`); another user's call is answered exactly like an unknown one."""
        return sees(self.core.peers.get(peer), owner)

    def _kept(self, invocation_id: str) -> KeptResult | None:
        rec = self.kept.get(invocation_id)
        return rec if rec is not None else self.results.get(invocation_id)

    def answer_again(self, peer: bytes, invocation_id: str) -> bool:
        """A Submit of a call that ended already (a client sending its calls again after
        it was forgotten, or after a restart): answered with the kept Result, never run
        twice. False if no Result of it is kept."""
        if invocation_id not in self.kept and invocation_id not in self.results:
            return False
        rec = self._kept(invocation_id)
        if rec is None:
            return False
        if self.readable(peer, rec.owner):
            self.core.send(peer, rec.result)
        else:  # another user's id: neither its Result nor a second run under its name
            self.core.send(peer, p.Result(invocation_id, False, kind_of(GpufnError), (
                f"call id {invocation_id} is taken by another user's call; submit with a new id")))
        return True

    def _on_attach(self, peer: bytes, msg: p.Attach, now: float) -> None:
        core = self.core
        inv = core.invocations.get(msg.invocation_id)
        if inv is not None and self.readable(peer, inv.user):
            self.watchers.setdefault(msg.invocation_id, set()).add(peer)
            return
        rec = self._kept(msg.invocation_id) if inv is None else None
        if rec is not None and self.readable(peer, rec.owner):
            core.send(peer, rec.result)
            return
        hours = self.results.retention / 3600
        core.send(peer, p.Result(msg.invocation_id, False, kind_of(GpufnError), (
            f"the scheduler knows no call {msg.invocation_id} of yours: it never existed, or "
            "it ended and its result is no longer kept (spawned calls of deployed functions "
            f"are kept {hours:g} h, others while they are among the last {KEEP_RESULTS} "
            "spawned), or another user made it")))

    def call_ended(self, inv: Invocation, result: p.Result) -> None:
        """A call ended: attached callers get its Result; a spawned call's is kept."""
        for peer in self.watchers.pop(inv.id, ()):
            if peer != inv.client and peer in self.core.peers:
                self.core.send(peer, result)
        if inv.id not in self.keep:
            return
        self.keep.discard(inv.id)
        rec = KeptResult(result, inv.user, inv.function.name, self.core.wall(self.core.tx.now))
        if inv.function.app:  # on disk: found after its spawner left, and after a restart
            self.results.put(rec)
            return
        self.kept[inv.id] = rec
        self.kept_bytes += _nbytes(result.frames)
        while self.kept and (len(self.kept) > KEEP_RESULTS or self.kept_bytes > KEEP_BYTES):
            _, old = self.kept.popitem(last=False)
            self.kept_bytes -= _nbytes(old.result.frames)

    def tick(self, now: float) -> None:
        """Now and then, kept results past their retention leave."""
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRE_EVERY_S
            self.results.expire(self.core.wall(now))

    def close(self) -> None:
        self.results.close()
