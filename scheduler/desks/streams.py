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

With a durable scheduler (`gpufn serve`), the calls that outlive their spawner are noted
on disk too, once a second (`tick`, never on the call path; a call that ends sooner is
never written), as `DetachedCall`s: after a restart nobody may resubmit them, so the new
scheduler admits them again itself (`restored`, SchedulerCore._readmit) and takes them
over from their workers like any resubmitted call. Their row leaves with their Result.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from gpufn.exceptions import ConnectionLost, GpufnError, kind_of
from gpufn.scheduler.books.users import sees
from gpufn.scheduler.calls.transitions import RunObserver
from gpufn.scheduler.desks.surface import CoreView
from gpufn.scheduler.nouns.records import Invocation
from gpufn.scheduler.nouns.states import InvState
from gpufn.scheduler.stores.kept_results import DetachedCall, KeptResult, KeptResults
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")

KEEP_RESULTS = 4096  # kept Results of spawned calls (in memory), newest last
KEEP_BYTES = 256 * 2**20  # and their payload bytes at most
EXPIRE_EVERY_S = 60.0  # how often results past their retention leave the disk book
SAVE_CALLS_S = 1.0  # how often the calls that outlive their spawner are noted on disk
NO_CLIENT = b""  # the client of a call admitted again after a restart (none yet)


def _nbytes(frames: tuple[Any, ...]) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)


class StreamDesk(RunObserver):
    def __init__(self, core: CoreView, results: KeptResults | None = None,
                 durable: bool = False) -> None:
        self.core = core
        self.durable = durable  # its outliving calls are admitted again after a restart
        self.keep: set[str] = set()  # live calls whose Result is kept
        self.kept: OrderedDict[str, KeptResult] = OrderedDict()  # ad-hoc functions' calls
        self.kept_bytes = 0
        self.results = results if results is not None else KeptResults(None)  # (on disk)
        self.watchers: dict[str, set[bytes]] = {}  # call id -> attached peers
        self._next_expiry = 0.0
        self._unsaved: dict[str, Invocation] = {}  # outliving calls not noted on disk yet
        self._saved: set[str] = set()  # and those noted
        self._forget: list[str] = []  # noted, ended without a kept Result
        self._next_save = 0.0

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
        inv.items += msg.values()  # a burst's values come (and are relayed) as one Item
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
            if self.durable and inv.function.app:
                self._unsaved[inv.id] = inv  # noted on disk at the next save

    def outlives(self, inv: Invocation) -> bool:
        """Whether the call goes on when its spawner leaves: spawned, of a deployed function."""
        return bool(inv.function.app) and inv.id in self.keep

    def resubmitted(self, peer: bytes, inv: Invocation) -> None:
        """A Submit of a call the scheduler has: ignored (never run twice), but a call
        whose client is gone (admitted again after a restart, or its spawner was
        forgotten) is answered to this one, its user's."""
        if inv.client != peer and inv.client not in self.core.peers and self.readable(
                peer, inv.user):
            inv.client = peer

    def adopt(self, calls: Iterable[DetachedCall]) -> None:
        """At start: the noted calls being admitted again are noted already."""
        self._saved.update(c.invocation_id for c in calls)

    def unadmittable(self, call: DetachedCall, error: GpufnError, now: float) -> None:
        """A noted call that cannot be admitted again (its version is gone): that error
        is kept as its Result."""
        log.warning("[%s] cannot admit again after the restart: %s", call.invocation_id, error)
        self._saved.discard(call.invocation_id)
        rec = KeptResult(p.Result(call.invocation_id, False, kind_of(error), str(error)),
                         call.owner, call.function_id, self.core.wall(now))
        if not self.results.put(rec):
            self.results.save_calls([], [call.invocation_id])

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
            self._unsaved.pop(inv.id, None)
            noted = inv.id in self._saved
            self._saved.discard(inv.id)
            # Storing the Result removes the call's row (one transaction); else forget it.
            if not self.results.put(rec) and noted:
                self._forget.append(inv.id)
            return
        self.kept[inv.id] = rec
        self.kept_bytes += _nbytes(result.frames)
        while self.kept and (len(self.kept) > KEEP_RESULTS or self.kept_bytes > KEEP_BYTES):
            _, old = self.kept.popitem(last=False)
            self.kept_bytes -= _nbytes(old.result.frames)

    def tick(self, now: float) -> None:
        """Now and then, kept results past their retention leave; once a second the
        outliving calls admitted since are noted on disk (one transaction)."""
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRE_EVERY_S
            self.results.expire(self.core.wall(now))
        if now >= self._next_save and (self._unsaved or self._forget):
            self._next_save = now + SAVE_CALLS_S
            self._save_calls()

    def _save_calls(self) -> None:
        wall = self.core.wall
        add = [DetachedCall(i.id, i.function.function_id, i.user, wall(i.submitted),
                            i.spec.to_wire(), tuple(i.frames))  # copied by the writer thread
               for i in self._unsaved.values()]
        self.results.save_calls(add, self._forget)
        self._saved.update(self._unsaved)
        self._unsaved, self._forget = {}, []

    def close(self, final: bool = False) -> None:
        """The scheduler stops: the outliving calls are noted (a restart admits them
        again); if it stops for good (`gpufn shutdown`, Ctrl-C), the ones not ended end
        with ConnectionLost as their kept Result instead, as its clients' calls fail."""
        if final:
            for inv_id in [*self._saved, *self._unsaved]:
                inv = self.core.invocations.get(inv_id)
                if inv is not None and inv.id in self.keep:
                    self.call_ended(inv, p.Result(inv.id, False, kind_of(ConnectionLost), (
                        f"{inv.function.name} call {inv.id} did not end before the scheduler "
                        "stopped for good (gpufn shutdown, or Ctrl-C of gpufn serve); call "
                        "it again")))
        if self._unsaved or self._forget:
            self._save_calls()
        self.results.close()
