"""Deployed apps in the scheduler: deploy, look up, roll over, roll back and stop.

The core routes `Deploy`, `Lookup` and `AppCommand` here, and asks `resolve` about a
submitted function id it does not know: an app alias (`app:APP/FN`, `app:APP/FN@N`),
which binds the call to the version current when it is admitted, or the id of a
deployed function (after a restart). Versions live in the `DeploymentStore`.

A call keeps its version across a scheduler restart (its client resubmits the alias).
The binding only needs the disk when the app's version changes (or it stops) while
calls are in flight: then those calls' bindings are saved (`pins`), in the moment of the
change, so nothing is written per call.
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from typing import Any

from gpufn.exceptions import AppStopped, GpufnError, InvalidSpec, NotFound, kind_of
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.desks.surface import CoreView
from gpufn.scheduler.nouns.records import FunctionRecord, Invocation
from gpufn.scheduler.nouns.states import DeviceState, InvState
from gpufn.scheduler.stores.deployments import (
    DeploymentStore,
    StoredFunction,
    Version,
    deployed_function_id,
)
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec, make_spec

log = logging.getLogger("gpufn.scheduler")

ALIAS = p.APP_ALIAS
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


def _parse_alias(fid: str) -> tuple[str, str, int]:
    app, _, rest = fid[len(ALIAS):].partition("/")
    fn, _, ver = rest.partition("@")
    return app, fn, int(ver) if ver.isdigit() else 0


def _interface(value: Any) -> dict[str, Any]:
    """A function's recorded interface (gpufn/wire/interface.py): kept as the JSON it is."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSpec("a function's interface must be a map")
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as e:
        raise InvalidSpec(f"a function's interface is not JSON: {e}") from None
    if len(text) > 64 * 1024:
        raise InvalidSpec("a function's interface is larger than 64 KiB")
    return value


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class AppBook:
    MESSAGES = (p.Deploy, p.Lookup, p.AppCommand)  # what the core routes here (clients only)

    def __init__(self, core: CoreView, store: DeploymentStore) -> None:
        self.core = core
        self.store = store
        self._records: dict[str, FunctionRecord] = {}  # deployed function id -> record
        # admitted calls per (app, function): [minute, count] for the last hour
        self._calls: dict[tuple[str, str], deque[list[int]]] = {}
        # (app, function, version) -> record: a submit by name costs no database read
        self._resolved: dict[tuple[str, str, int], FunctionRecord] = {}
        self._release: set[str] = set()  # model keys of stopped apps, evicted once idle
        self._evicting: set[tuple[str, str]] = set()  # (device, key) told to evict
        self._interfaces: dict[str, dict[str, Any]] = {}  # deployed function id -> interface
        # invocation id -> (app, deployed function id): calls admitted before a version
        # change under a previous scheduler, bound to the version that admitted them.
        self._pins: dict[str, tuple[str, str]] = store.pins()

    def handlers(self) -> dict[type, Any]:
        return {p.Deploy: self.on_deploy, p.Lookup: self.on_lookup, p.AppCommand: self.on_command}

    def _reply(self, peer: bytes, rid: int, data: dict[str, Any] | None = None,
               error: GpufnError | None = None) -> None:
        if error is not None:
            self.core.send(peer, p.AppReply(rid, False, kind_of(error), str(error)))
        else:
            self.core.send(peer, p.AppReply(rid, True, data=data or {}))

    # ------------------------------------------------------------------ deploy

    def on_deploy(self, peer: bytes, msg: p.Deploy, now: float) -> None:
        try:
            self._reply(peer, msg.request_id, self._deploy(msg, now))
        except GpufnError as e:
            self._reply(peer, msg.request_id, error=e)

    def _deploy(self, msg: p.Deploy, now: float) -> dict[str, Any]:
        if not _NAME.match(msg.app):
            raise InvalidSpec(f"app name {msg.app!r}: use letters, digits, '_', '-' and '.'")
        if not msg.functions:
            raise InvalidSpec(f"app {msg.app!r} has no @gpu functions to deploy")
        meta = msg.meta
        strategy = str(meta.get("strategy", "rolling"))
        if strategy not in ("rolling", "recreate"):
            raise InvalidSpec(f"strategy {strategy!r}: use rolling or recreate")
        code_hash = str(meta.get("code_hash", ""))
        current = self.store.app(msg.app)
        if current is not None:
            cur = self.store.version(msg.app, current.current)
            if cur is not None and cur.code_hash == code_hash:
                restarted = current.state != "active"
                if restarted:
                    self.store.set_state(msg.app, "active")
                    self._resolved.clear()
                    self._keep_models(self.store.functions(msg.app, current.current))
                return self._deployed(msg.app, current.current, unchanged=True,
                                      notes=["unchanged code: the version stays"]
                                      + (["the stopped app was started again"] if restarted else []))
        version = self.store.next_version(msg.app)
        functions = []
        i = 0
        for d in msg.functions:
            ncode = int(d["ncode"])
            nmodel = sum(int(m.get("nframes", 0)) for m in d.get("models", []))
            frames = tuple(msg.frames[i:i + ncode + nmodel])
            i += ncode + nmodel
            make_spec(GpuSpec.from_wire(d["spec"]))  # a bad spec fails the deploy, not a call
            functions.append(StoredFunction(
                msg.app, version, str(d["name"]), deployed_function_id(msg.app, version, str(d["function_id"])),
                str(d["code_id"]), dict(d["spec"]), list(d.get("models", [])), ncode, frames,
                _interface(d.get("interface"))))
        v = Version(msg.app, version, self.core.wall(now), code_hash, str(meta.get("who", "")),
                    str(meta.get("tag", "")), str(meta.get("git_commit", "")),
                    bool(meta.get("git_dirty")), meta.get("rollback_of"), strategy,
                    str(meta.get("source", "")))
        return self._switch(v, functions, current.current if current else None, now)

    def _pin_in_flight(self, app: str) -> None:
        """Save the version binding of the app's calls in flight (see the module doc)."""
        pins = {i: f for i, (a, f) in self._pins.items() if a == app}  # not resubmitted yet
        pins.update({i.id: i.function.function_id for i in self.core.invocations.values()
                     if i.function.app == app and not i.members})
        self.store.set_pins(app, pins)

    def _switch(self, v: Version, functions: list[StoredFunction], old: int | None,
                now: float) -> dict[str, Any]:
        notes = []
        if old is not None:
            notes += self._fit_note(v.app, old, functions)
            self._pin_in_flight(v.app)
        self.store.add_version(v, functions)
        self._resolved.clear()
        self._keep_models(functions)
        if old is not None and v.strategy == "recreate":
            n = self._stop_calls(v.app, now, f"app {v.app} was redeployed as v{v.version} with "
                                 "--strategy recreate", keep=v.version, cancel_running=True)
            notes.append(f"recreate: {n} call(s) of older versions were stopped")
        elif old is not None:
            notes.append(f"rolling: calls admitted on v{old} finish there; new calls run v{v.version}")
        log.info("app %s deployed as v%d (%s)", v.app, v.version, v.strategy)
        return self._deployed(v.app, v.version, unchanged=False, notes=notes, previous=old)

    def _keep_models(self, functions: list[StoredFunction]) -> None:
        """The models of a version that serves again are no longer released (a stop
        releases them once idle)."""
        for sf in functions:
            self._release -= set(self._record(sf).model_keys)

    def _fit_note(self, app: str, old: int, new: list[StoredFunction]) -> list[str]:
        """Whether the new version's models fit beside the old one's on some device; if
        not, its calls wait for the old calls to drain (the pool then evicts)."""
        old_keys = {k for fid in self._ids(app, old) for k in self._record_by_id(fid).model_keys}
        models = self.core.models.models
        new_keys: set[str] = set()
        for sf in new:
            new_keys.update(f"{m['name']}@{str(m.get('code_id', ''))[:10]}" for m in sf.models)
        sizes = {m["name"] + "@" + str(m.get("code_id", ""))[:10]: int(m.get("memory") or 0)
                 for sf in new for m in sf.models}
        added = sum(models[k].size if k in models else sizes.get(k, 0) for k in new_keys - old_keys)
        kept = sum(models[k].size for k in old_keys if k in models)
        caps = [d.ledger.capacity for d in self.core.devices.values()
                if d.state is not DeviceState.GONE]
        if not added or not caps or any(c >= kept + added for c in caps):
            return []
        return [f"drain first: the new version's models ({_gib(added)}) do not fit beside "
                f"v{old}'s ({_gib(kept)}) on any device; v{old}'s calls finish, its models "
                "leave, then the new version's load"]

    def _deployed(self, app: str, version: int, unchanged: bool, notes: list[str],
                  previous: int | None = None) -> dict[str, Any]:
        fns = [{"name": sf.name, "spec": sf.spec, "models": [m["name"] for m in sf.models],
                "describe": GpuSpec.from_wire(sf.spec).describe(), "interface": sf.interface}
               for sf in self.store.functions(app, version)]
        return {"app": app, "version": version, "unchanged": unchanged, "notes": notes,
                "previous": previous, "functions": fns}

    # ------------------------------------------------------------------ records

    def _record(self, sf: StoredFunction) -> FunctionRecord:
        rec = self.core.functions.get(sf.function_id)
        if rec is None:
            if not sf.frames:
                full = self.store.function_by_id(sf.function_id)
                assert full is not None
                sf = full
            rec = FunctionRecord(sf.function_id, sf.code_id, sf.name,
                                 make_spec(GpuSpec.from_wire(sf.spec)), tuple(sf.frames[:sf.ncode]),
                                 app=sf.app, version=sf.version)
            rec.model_keys = self.core.models.register(sf.models, tuple(sf.frames[sf.ncode:]))
            self.core.functions[sf.function_id] = rec
        self._records[sf.function_id] = rec
        self._interfaces[sf.function_id] = sf.interface
        return rec

    def _record_by_id(self, fid: str) -> FunctionRecord:
        rec = self._records.get(fid) or self.core.functions.get(fid)
        if rec is not None:
            return rec
        sf = self.store.function_by_id(fid)
        if sf is None:
            raise NotFound(f"no deployed function {fid}")
        return self._record(sf)

    def _ids(self, app: str, version: int) -> list[str]:
        return [sf.function_id for sf in self.store.functions(app, version)]

    def _find(self, app: str, fn: str, version: int) -> FunctionRecord:
        """The record of app/fn at `version` (0: current), or NotFound / AppStopped."""
        a = self.store.app(app)
        if a is None:
            raise NotFound(f"no app {app!r} is deployed; {self._deployed_list()}")
        if a.state != "active":
            raise AppStopped(f"app {app!r} was stopped (`gpufn app stop`); deploy it again "
                             f"or `gpufn app rollback {app}` to start it")
        v = version or a.current
        sfs = self.store.functions(app, v)
        if not sfs:
            known = ", ".join(f"v{x.version}" for x in self.store.versions(app))
            raise NotFound(f"app {app!r} has no version {v}; its versions: {known}")
        sf = next((s for s in sfs if s.name == fn), None)
        if sf is None:
            raise NotFound(f"app {app!r} v{v} has no function {fn!r}; its functions: "
                           f"{', '.join(s.name for s in sfs)}")
        return self._record(sf)

    def _deployed_list(self) -> str:
        apps = self.store.apps()
        if not apps:
            return "nothing is deployed yet (gpufn deploy app.py)"
        parts = []
        for a in apps:
            names = ", ".join(sf.name for sf in self.store.functions(a.name, a.current))
            parts.append(f"{a.name} v{a.current} ({names})" + ("" if a.state == "active" else " stopped"))
        return "deployed: " + "; ".join(parts)

    def resolve(self, function_id: str, now: float,
                invocation_id: str = "") -> FunctionRecord | GpufnError:
        """A submitted function id the core does not know: an app alias or a deployed
        function's id; else the error the call fails with. A call resubmitted after a
        restart keeps the version that admitted it (`pins`)."""
        if function_id.startswith(ALIAS):
            pinned = self._pins.pop(invocation_id, None) if self._pins else None
            if pinned is not None:
                self.store.unpin(invocation_id)
                try:
                    return self._record_by_id(pinned[1])
                except NotFound:
                    pass  # its version is gone: bound as a new call
            app, fn, version = _parse_alias(function_id)
            rec = self._resolved.get((app, fn, version))
            if rec is None:
                try:
                    rec = self._resolved[(app, fn, version)] = self._find(app, fn, version)
                except GpufnError as e:
                    return e
            self._count(app, fn, now)
            return rec
        unknown = GpufnError("the scheduler does not know this function (it may have restarted); "
                             "reconnect with gpufn.connect() and call again")
        if not function_id.startswith("d") or not self.store.exists():
            return unknown
        try:
            return self._record_by_id(function_id)
        except NotFound:
            return unknown
        except GpufnError as e:  # the store cannot be read (StateWriteError): the call fails
            return e

    def noted_function(self, function_id: str, invocation_id: str) -> FunctionRecord:
        """The deployed function (its own id: its version) of a call admitted again after a
        restart without a resubmit (SchedulerCore._readmit); a binding saved for the call
        is done. NotFound if that version is gone."""
        if self._pins.pop(invocation_id, None) is not None:
            self.store.unpin(invocation_id)
        return self._record_by_id(function_id)

    def _count(self, app: str, fn: str, now: float) -> None:
        minute = int(now // 60)
        calls = self._calls.setdefault((app, fn), deque())
        if calls and calls[-1][0] == minute:
            calls[-1][1] += 1
        else:
            calls.append([minute, 1])
        while calls and calls[0][0] <= minute - 60:
            calls.popleft()

    def _calls_1h(self, app: str, fn: str, now: float) -> int:
        first = int(now // 60) - 59
        return sum(n for m, n in self._calls.get((app, fn), ()) if m >= first)

    def on_lookup(self, peer: bytes, msg: p.Lookup, now: float) -> None:
        try:
            rec = self._find(msg.app, msg.function, msg.version)
        except GpufnError as e:
            self._reply(peer, msg.request_id, error=e)
            return
        self._reply(peer, msg.request_id, {"app": msg.app, "function": rec.name,
                                           "version": rec.version, "function_id": rec.function_id,
                                           "spec": rec.spec.to_wire(),
                                           "interface": self._interfaces.get(rec.function_id, {})})

    # ------------------------------------------------------------------ commands

    def on_command(self, peer: bytes, msg: p.AppCommand, now: float) -> None:
        handler = {"list": self._list, "history": self._history, "rollback": self._rollback,
                   "stop": self._stop}.get(msg.command)
        try:
            if handler is None:
                raise InvalidSpec(f"unknown app command {msg.command!r}")
            self._reply(peer, msg.request_id, handler(msg.args, now))
        except GpufnError as e:
            self._reply(peer, msg.request_id, error=e)

    def _app(self, args: dict[str, Any]) -> str:
        name = str(args.get("app", ""))
        if self.store.app(name) is None:
            raise NotFound(f"no app {name!r} is deployed; {self._deployed_list()}")
        return name

    def _list(self, args: dict[str, Any], now: float) -> dict[str, Any]:
        out = []
        queued: dict[tuple[str, str], int] = {}
        running: dict[tuple[str, str], int] = {}
        for i in self.core.invocations.values():
            if i.function.app:
                into = queued if i.state is InvState.QUEUED else running
                key = (i.function.app, i.function.name)
                into[key] = into.get(key, 0) + 1
        for a in self.store.apps():
            v = self.store.version(a.name, a.current)
            fns = []
            for sf in self.store.functions(a.name, a.current):
                rec = self._record(sf)
                key = (a.name, sf.name)
                fns.append({
                    "name": sf.name, "spec": sf.spec,
                    "describe": GpuSpec.from_wire(sf.spec).describe(),
                    "models": [m["name"] for m in sf.models],
                    "calls_1h": self._calls_1h(a.name, sf.name, now),
                    "queued": queued.get(key, 0), "running": running.get(key, 0),
                    "errors": self._model_errors(rec), "interface": sf.interface,
                })
            out.append({"name": a.name, "version": a.current, "state": a.state,
                        "tag": v.tag if v else "", "created": v.created if v else a.created,
                        "who": v.who if v else "", "git_commit": v.git_commit if v else "",
                        "functions": fns,
                        "broken": any(f["errors"] for f in fns)})
        return {"apps": out}

    def _model_errors(self, rec: FunctionRecord) -> list[str]:
        """Loader failures of the function's models: a broken version is shown, not hidden."""
        out = []
        for key in rec.model_keys:
            m = self.core.models.models.get(key)
            if m is not None and m.failing:  # a load since the last failure heals it
                out.append(f"model {m.name} failed to load ({m.failing}x): "
                           f"{getattr(m, 'last_error', '')}".rstrip(": "))
        return out

    def _history(self, args: dict[str, Any], now: float) -> dict[str, Any]:
        app = self._app(args)
        a = self.store.app(app)
        return {"app": app, "current": a.current if a else 0, "state": a.state if a else "",
                "versions": [v.to_dict() for v in self.store.versions(app)]}

    def _rollback(self, args: dict[str, Any], now: float) -> dict[str, Any]:
        app = self._app(args)
        a = self.store.app(app)
        assert a is not None
        versions = self.store.versions(app)
        target_n = int(args.get("version") or 0)
        if not target_n:
            older = [v for v in versions if v.version < a.current]
            if not older:
                raise NotFound(f"app {app!r} has no version before v{a.current} to roll back to")
            target_n = older[-1].version
        target = next((v for v in versions if v.version == target_n), None)
        if target is None:
            raise NotFound(f"app {app!r} has no version {target_n}; its versions: "
                           f"{', '.join(f'v{v.version}' for v in versions)}")
        version = self.store.next_version(app)
        functions = []
        for sf in self.store.functions(app, target_n, with_frames=True):
            base = sf.function_id
            sf.version, sf.function_id = version, deployed_function_id(app, version, base)
            functions.append(sf)
        v = Version(app, version, self.core.wall(now), target.code_hash, str(args.get("who", "")),
                    target.tag, target.git_commit, target.git_dirty, target_n,
                    str(args.get("strategy") or "rolling"), target.source)
        return self._switch(v, functions, a.current if a.state == "active" else None, now)

    def _stop(self, args: dict[str, Any], now: float) -> dict[str, Any]:
        app = self._app(args)
        self._pin_in_flight(app)  # its running calls finish, after a restart too
        self.store.set_state(app, "stopped")
        self._resolved.clear()
        n = self._stop_calls(app, now, f"app {app} was stopped", keep=None, cancel_running=False)
        keys = {k for r in self.core.functions.values() if r.app == app for k in r.model_keys}
        used_elsewhere = {k for r in self.core.functions.values() if r.app != app
                          for k in r.model_keys}
        self._release |= keys - used_elsewhere
        self.tick(now)
        return {"app": app, "failed_queued": n, "state": "stopped"}

    def _stop_calls(self, app: str, now: float, why: str, keep: int | None,
                    cancel_running: bool) -> int:
        """Fail the app's queued calls (all versions but `keep`) with AppStopped, and
        cancel its running ones if asked. Returns how many calls were stopped."""
        n = 0
        for inv in list(self.core.invocations.values()):
            if inv.function.app != app or inv.function.version == keep or inv.members:
                continue
            if inv.state is InvState.QUEUED:
                self.core.tx.finish(inv, now, InvState.FAILED, AppStopped(
                    f"{inv.function.name} call {inv.id} did not run: {why}"))
                n += 1
            elif inv.state is InvState.RUNNING and cancel_running:
                self._cancel(inv, now, why)
                n += 1
        return n

    def _cancel(self, inv: Invocation, now: float, why: str) -> None:
        self.core.tx.cancel_running(inv, now, why)

    # ------------------------------------------------------------------ models

    def tick(self, now: float) -> None:
        """Evict the stopped apps' models from the devices once no call holds them."""
        if not self._release:
            return
        for d in self.core.devices.values():
            if d.worker is None:
                continue
            for key in list(self._release):
                e = d.ledger.models.get(key)
                if e is None or e.pinned or e.in_use or (d.key, key) in self._evicting:
                    continue
                if e.state is Residency.RESIDENT:
                    d.ledger.evict_started(key, now)
                    self.core.models.models[key].evictions += 1
                elif e.state is not Residency.OFFLOADED:
                    continue
                self._evicting.add((d.key, key))
                self.core.send(d.worker, p.EvictModel(key, False))
        present = {(d.key, k) for d in self.core.devices.values()
                   for k, e in d.ledger.models.items() if e.state is not Residency.ABSENT}
        self._evicting &= present
        self._release &= {k for _, k in present}
