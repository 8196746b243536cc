"""The operator's desk in the scheduler: function logs, the usage meter and a clean drain.

It answers `Query` and `Drain` (its own messages), and the core calls it where its steps
belong: `refusal` before a Submit is admitted (nothing is admitted while draining),
`output` for each line a call prints, `tick` to save the books. As a `RunObserver` it
meters every run that ends. Logs and usage are kept in wall-clock time and, with a
durable `OpsStore`, saved once a second (and on a clean stop) and read back at start.
When the disk cannot take them (full), they stay in memory (usage whole, the newest
`logs.MAX_UNSAVED` lines) and are written once it can; the log says so once.
"""

from __future__ import annotations

import logging
from typing import Any

from gpufn.exceptions import Cancelled, ConnectionLost, kind_of
from gpufn.scheduler.books import logs as logbook
from gpufn.scheduler.books import usage as meter
from gpufn.scheduler.books.logs import LogStore, matches
from gpufn.scheduler.books.usage import Key as UsageKey
from gpufn.scheduler.books.usage import UsageMeter
from gpufn.scheduler.calls.transitions import RunObserver
from gpufn.scheduler.desks.surface import CoreView
from gpufn.scheduler.nouns.records import Invocation
from gpufn.scheduler.nouns.states import InvState
from gpufn.scheduler.stores.disk import OnceLog, StateWriteError
from gpufn.scheduler.stores.ops import OpsStore
from gpufn.wire import protocol as p

log = logging.getLogger("gpufn.scheduler")


SAVE_SECONDS = 1.0  # usage and logs reach the disk this often at most
PRUNE_SECONDS = 3600.0  # and their retention is applied this often
DEVICES_SECONDS = 30.0  # the devices seen are noted this often (and when they change)


class OpsDesk(RunObserver):
    def __init__(self, core: CoreView, store: OpsStore | None = None) -> None:
        self.core = core
        self.store = store or OpsStore(":memory:")
        self.logs = LogStore()
        self.usage = UsageMeter()
        self._saved_at: float | None = None
        self._pruned_at = -PRUNE_SECONDS
        self._devices_at = -DEVICES_SECONDS
        self._devices_saved: set[str] = set()
        self._unsaved = OnceLog(f"usage and logs ({self.store.path})")
        if self.store.durable:
            self.logs.track = self.usage.track = True
            self.usage.load(self.store.usage(0))  # what is on disk is within retention
            self.logs.load(self.store.logs(0))
        self.draining = False
        self.drain_deadline: float | None = None
        self.drain_reason = ""

    def handlers(self) -> dict[type, Any]:
        return {p.Query: self._on_query, p.Drain: self._on_drain}

    # ------------------------------------------------------------------ steps of the core

    def refusal(self, msg: p.Submit) -> p.Result | None:
        """The Result refusing a new call while the scheduler drains, else None."""
        if not self.draining:
            return None
        return p.Result(msg.invocation_id, False, kind_of(ConnectionLost),
                        f"the scheduler is shutting down ({self.drain_reason})")

    def output(self, inv: Invocation, msg: p.Output, now: float) -> None:
        """A line the call printed: kept for `gpufn logs`, as its user's (a batch's lines
        are its users' if they are one, else only an admin reads them)."""
        owners = {m.user for m in inv.members}
        user = inv.user or (owners.pop() if len(owners) == 1 else "")
        self.logs.add(inv.function.app, inv.function.name, msg.invocation_id, msg.stream,
                      msg.text, self.core.wall(now), user=user)

    def tick(self, now: float, force: bool = False) -> None:
        """Save what changed (once a second at most; `force`: now, a clean stop)."""
        if not self.store.durable:
            return
        if not force and self._saved_at is not None and now - self._saved_at < SAVE_SECONDS:
            return
        self._saved_at = now
        try:
            self._save(now)
        except StateWriteError as e:
            self._unsaved.failed(e, "usage is kept in memory until it can be (log lines: the "
                                f"newest {logbook.MAX_UNSAVED:,})")
        else:
            self._unsaved.worked()

    def _save(self, now: float) -> None:
        """Write what changed; what a failed write held is given back to its book."""
        wall = self.core.wall(now)
        prune = now - self._pruned_at >= PRUNE_SECONDS
        rows = self.usage.take_dirty()
        if rows or prune:
            try:
                self.store.save_usage(rows, (self.usage.oldest_minute(wall), meter.MAX_ROWS)
                                      if prune else None)
            except StateWriteError:
                self.usage.give_back(rows)
                raise
        lines, oldest, dropped = self.logs.take_new()
        if lines or dropped or prune:
            try:
                self.store.save_logs(lines, oldest, dropped,
                                     wall - logbook.RETENTION_S if prune else None)
            except StateWriteError:
                self.logs.give_back(lines, oldest, dropped)
                raise
        if prune:
            self._pruned_at = now
        live = {k for k, d in self.core.devices.items() if d.state.schedulable_later}
        if live != self._devices_saved or now - self._devices_at >= DEVICES_SECONDS:
            # A device that left (its supervisor went, or it cannot start) is not waited for.
            self.store.saw_devices(sorted(live), sorted(self._devices_saved - live), wall)
            self._devices_saved, self._devices_at = live, now

    def run_ended(self, inv: Invocation, state: InvState, now: float) -> None:
        """A run ended (`state` QUEUED: it was requeued). Meter the devices it held and,
        for a caller's call that reached its end, the call itself."""
        offset = self.core.wall(0.0)  # wall-clock time is `now` plus this
        started = inv.started + offset if inv.started is not None else None
        now += offset
        if inv.lease is not None:  # its calls are metered from its Result (lease_desk.py)
            if started is not None and inv.devices:
                self.usage.record_devices(self._key(inv), started, now, len(inv.devices))
            return
        if started is not None and inv.devices:
            held = len(inv.devices)
            if inv.members:  # a batch: its device time is shared by its calls
                share = held / len(inv.members)
                for m in inv.members:
                    self.usage.record_devices(self._key(m), started, now, share)
                return
            if inv.carrier is None:
                key = self._key(inv)
                self.usage.record_devices(key, started, now, held)
                if state is not InvState.QUEUED:
                    self.usage.record_call(key, state.value, inv.submitted + offset, started, now)
                return
        if state is not InvState.QUEUED and not inv.members:
            self.usage.record_call(self._key(inv), state.value, inv.submitted + offset,
                                   started, now)

    @staticmethod
    def _key(inv: Invocation) -> UsageKey:
        fn = inv.function
        return UsageKey(fn.app, fn.name, fn.version, inv.user)

    # ------------------------------------------------------------------ requests

    def _on_query(self, peer: bytes, msg: p.Query, now: float) -> None:
        viewer = self.core.peers[peer]
        try:  # a user reads their own calls' output and usage; an admin reads everyone's
            data = self.answer(msg.kind, msg.args, now, None if viewer.admin else viewer.user)
        except (ValueError, TypeError, KeyError) as e:
            self.core.send(peer, p.QueryReply(msg.request_id, False, error=str(e)))
            return
        self.core.send(peer, p.QueryReply(msg.request_id, True, data))

    def answer(self, kind: str, args: dict[str, Any], now: float,
               user: str | None = None) -> dict[str, Any]:
        """The answer to a Query; with `user`, only that user's lines and usage."""
        now = self.core.wall(now)  # the books are kept in wall-clock time
        since = args.get("since")
        since = float(since) if since is not None else None
        if kind == p.QueryKind.LOGS:
            target = str(args.get("target", ""))
            out = self.logs.query(target, now, since, int(args.get("after", 0)),
                                  int(args.get("limit", 10_000)), user=user)
            fns = self.core.functions.values()
            out["found"] = out["found"] or any(matches(target, f.app, f.name) for f in fns)
            if not out["found"]:
                names = sorted({f.app or f.name for f in fns} | set(self.logs.known()))
                out["known"] = names
            return out
        if kind == p.QueryKind.USAGE:
            return {"rows": self.usage.report(now, since, str(args.get("by", "function")),
                                              user=user)}
        raise ValueError(f"unknown query {kind!r}")

    def _on_drain(self, peer: bytes, msg: p.Drain, now: float) -> None:
        core = self.core
        log.warning("drain requested by %r (grace %.0fs): %s", peer, msg.grace,
                    msg.reason or "gpufn shutdown")
        first = not self.draining
        self.draining = True
        self.drain_reason = msg.reason or "gpufn shutdown"
        deadline = now + max(0.0, msg.grace)
        self.drain_deadline = deadline if self.drain_deadline is None else min(deadline, self.drain_deadline)
        failed = 0
        for inv in [i for i in core.invocations.values() if i.state is InvState.QUEUED]:
            core.tx.finish(inv, now, InvState.CANCELLED, Cancelled(
                f"{inv.function.name} call {inv.id} was dropped before it started: "
                f"the scheduler is shutting down ({self.drain_reason})"))
            failed += 1
        core.tx.dirty = True
        core.send(peer, p.QueryReply(msg.request_id, True, {
            "running": self.running(), "dropped_queued": failed, "grace": msg.grace,
            "already_draining": not first}))

    def running(self) -> int:
        return sum(1 for i in self.core.invocations.values() if i.state is InvState.RUNNING)

    def stop_now(self, now: float) -> bool:
        """Draining, and nothing runs any more (or the grace is over): the shell exits."""
        if not self.draining:
            return False
        assert self.drain_deadline is not None
        return now >= self.drain_deadline or self.running() == 0
