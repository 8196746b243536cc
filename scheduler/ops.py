"""The operator's desk in the scheduler: function logs, the usage meter and a clean drain.

It plugs into the core without growing it: it answers `Query` and `Drain`, watches `Output`
and `Submit` on their way to the core's own handlers (to keep a line of output, to refuse
calls while draining and to note the caller's user), and is told by `Transitions` whenever
a run ends (the usage hook).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpufn.exceptions import Cancelled, ConnectionLost, kind_of
from gpufn.scheduler.logs import LogStore
from gpufn.scheduler.states import InvState
from gpufn.scheduler.usage import Key as UsageKey
from gpufn.scheduler.usage import UsageMeter
from gpufn.wire import protocol as p

if TYPE_CHECKING:
    from gpufn.scheduler.core import SchedulerCore
    from gpufn.scheduler.records import Invocation

Handler = Callable[[bytes, Any, float], None]


class OpsDesk:
    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.logs = LogStore()
        self.usage = UsageMeter()
        self.draining = False
        self.drain_deadline: float | None = None
        self.drain_reason = ""
        inner_output = core._handlers[p.Output]
        inner_submit = core._handlers[p.Submit]
        core._handlers.update({
            p.Query: self._on_query, p.Drain: self._on_drain,
            p.Output: lambda peer, msg, now: self._on_output(inner_output, peer, msg, now),
            p.Submit: lambda peer, msg, now: self._on_submit(inner_submit, peer, msg, now),
        })
        core.tx.on_run_end = self.on_run_end

    # ------------------------------------------------------------------ hooks

    def on_run_end(self, inv: Invocation, state: InvState, now: float) -> None:
        """A run ended (`state` QUEUED: it was requeued). Meter the devices it held and,
        for a caller's call that reached its end, the call itself."""
        if inv.started is not None and inv.devices:
            held = len(inv.devices)
            if inv.members:  # a batch: its device time is shared by its calls
                share = held / len(inv.members)
                for m in inv.members:
                    self.usage.record_devices(self._key(m), inv.started, now, share)
            elif inv.carrier is None:
                self.usage.record_devices(self._key(inv), inv.started, now, held)
        if state is not InvState.QUEUED and not inv.members:
            self.usage.record_call(self._key(inv), state.value, inv.submitted, inv.started, now)

    @staticmethod
    def _key(inv: Invocation) -> UsageKey:
        fn = inv.function
        return UsageKey(fn.app, fn.name, fn.version, inv.user)

    def _on_output(self, inner: Handler, peer: bytes, msg: p.Output, now: float) -> None:
        core = self.core
        inv = core.invocations.get(msg.invocation_id)
        if inv is None:
            d = core._device_of(peer)
            inv = d.running.get(msg.invocation_id) if d is not None else None
        if inv is not None:
            self.logs.add(inv.function.app, inv.function.name, msg.invocation_id, msg.stream,
                          msg.text, now)
        inner(peer, msg, now)

    def _on_submit(self, inner: Handler, peer: bytes, msg: p.Submit, now: float) -> None:
        if self.draining:
            self.core._send(peer, p.Result(msg.invocation_id, False, kind_of(ConnectionLost),
                                           f"the scheduler is shutting down ({self.drain_reason})"))
            return
        inner(peer, msg, now)
        inv = self.core.invocations.get(msg.invocation_id)
        who = self.core.peers.get(peer)
        if inv is not None and who is not None and inv.client == peer:
            inv.user = str(who.info.get("user", ""))

    # ------------------------------------------------------------------ requests

    def _client(self, peer: bytes, request_id: int) -> bool:
        who = self.core.peers.get(peer)
        if who is not None and who.role == p.Role.CLIENT:
            return True
        self.core._send(peer, p.QueryReply(request_id, False, error="only clients may ask this"))
        return False

    def _on_query(self, peer: bytes, msg: p.Query, now: float) -> None:
        if not self._client(peer, msg.request_id):
            return
        try:
            data = self.answer(msg.kind, msg.args, now)
        except (ValueError, TypeError, KeyError) as e:
            self.core._send(peer, p.QueryReply(msg.request_id, False, error=str(e)))
            return
        self.core._send(peer, p.QueryReply(msg.request_id, True, data))

    def answer(self, kind: str, args: dict[str, Any], now: float) -> dict[str, Any]:
        since = args.get("since")
        since = float(since) if since is not None else None
        if kind == p.QueryKind.LOGS:
            target = str(args.get("target", ""))
            out = self.logs.query(target, now, since, int(args.get("after", 0)),
                                  int(args.get("limit", 10_000)))
            fns = self.core.functions.values()
            from gpufn.scheduler.logs import matches

            out["found"] = out["found"] or any(matches(target, f.app, f.name) for f in fns)
            if not out["found"]:
                names = sorted({f.app or f.name for f in fns} | set(self.logs.known()))
                out["known"] = names
            return out
        if kind == p.QueryKind.USAGE:
            return {"rows": self.usage.report(now, since, str(args.get("by", "function")))}
        raise ValueError(f"unknown query {kind!r}")

    def _on_drain(self, peer: bytes, msg: p.Drain, now: float) -> None:
        if not self._client(peer, msg.request_id):
            return
        core = self.core
        first = not self.draining
        self.draining = True
        self.drain_reason = msg.reason or "gpufn shutdown"
        deadline = now + max(0.0, msg.grace)
        self.drain_deadline = deadline if self.drain_deadline is None else min(deadline, self.drain_deadline)
        failed = 0
        for inv in [i for i in core.invocations.values() if i.state is InvState.QUEUED]:
            core.queue.discard(inv)
            core.tx.finish(inv, now, InvState.CANCELLED, Cancelled(
                f"{inv.function.name} call {inv.id} was dropped before it started: "
                f"the scheduler is shutting down ({self.drain_reason})"))
            failed += 1
        core.tx.dirty = True
        core._send(peer, p.QueryReply(msg.request_id, True, {
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
