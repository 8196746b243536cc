"""The worker's sans-I/O core: scheduler messages in, actions out.

It holds the code cache and what runs; the process shell (`process.py`) performs the
actions (start a call in the executor, interrupt one, send a message, exit).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpufn import call_context as ctxmod
from gpufn import protocol as p
from gpufn import serialization as ser
from gpufn.exceptions import GpufnError, SerializationError, kind_of
from gpufn.worker.executor import Call

log = logging.getLogger("gpufn.worker")


@dataclass(frozen=True, slots=True)
class Execute:
    call: Call


@dataclass(frozen=True, slots=True)
class Interrupt:
    invocation_id: str
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class SendMsg:
    msg: p.Message


@dataclass(frozen=True, slots=True)
class Exit:
    reason: str


Action = Execute | Interrupt | SendMsg | Exit


@dataclass
class WorkerCore:
    device_key: str
    device: Any = "cpu"
    scheduler_host: str = "127.0.0.1"
    code: dict[str, Callable[..., Any]] = field(default_factory=dict)
    code_frames: dict[str, list[bytes]] = field(default_factory=dict)
    code_errors: dict[str, str] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    completed: int = 0
    groups: Any = None  # GroupManager, made on the first gang call (imports torch.distributed)
    helper: Any = None  # DeviceSetHelper of the last spmd=False call
    models: Any = None  # ModelManager (the process shell makes it)

    def handle(self, msg: p.Message) -> list[Action]:
        if isinstance(msg, p.LoadCode):
            return self._load_code(msg)
        if isinstance(msg, p.Run):
            return self._run(msg)
        if isinstance(msg, p.Cancel):
            return [Interrupt(msg.invocation_id, msg.attempt)]
        if isinstance(msg, p.Shutdown):
            return [Exit(msg.reason or "scheduler asked")]
        if isinstance(msg, (p.LoadModel, p.EvictModel)) and self.models is not None:
            self.models.handle(msg)
            return []
        if isinstance(msg, p.GroupOp) and msg.op == "abort" and self.groups is not None:
            self.groups.abort(str(msg.gang.get("reason", "aborted by the scheduler")),
                              gang_id=msg.gang.get("gang_id"), generation=msg.gang.get("generation"))
        return []

    def done(self, result: p.Result) -> list[Action]:
        self.running.discard(result.invocation_id)
        self.completed += 1
        return [SendMsg(result)]

    def _load_code(self, msg: p.LoadCode) -> list[Action]:
        try:
            self.code_frames[msg.code_id] = [bytes(memoryview(f.buffer if hasattr(f, "buffer") else f))
                                             for f in msg.frames]
            self.code[msg.code_id] = ser.load_code(msg.frames)
            self.code_errors.pop(msg.code_id, None)
        except Exception as e:
            self.code_errors[msg.code_id] = f"{type(e).__name__}: {e}"
            log.warning("could not unpickle %s: %s", msg.name, e)
        return []

    def _fail(self, inv: str, err: GpufnError, attempt: int) -> list[Action]:
        return [SendMsg(p.Result(inv, False, kind_of(err), str(err), {"attempt": attempt}))]

    def _run(self, msg: p.Run) -> list[Action]:
        fn = self.code.get(msg.code_id)
        if fn is None:
            why = self.code_errors.get(msg.code_id)
            if why is None:
                return self._fail(msg.invocation_id, GpufnError(
                    f"worker {self.device_key} has no code {msg.code_id} for {msg.name}"),
                    msg.attempt)
            return self._fail(msg.invocation_id, SerializationError(
                f"{msg.name} could not be unpickled on worker {self.device_key}: {why}. If it is "
                "defined in a module, that module must be importable on the worker (same code "
                "and PYTHONPATH), or define it in __main__ / a notebook cell"), msg.attempt)
        self.running.add(msg.invocation_id)
        context = ctxmod.CallContext(
            invocation_id=msg.invocation_id, function=msg.name, device=self.device,
            devices=[self.device], attempt=int(msg.meta.get("attempt_number", 1)),
        )
        call = Call(msg.invocation_id, msg.name, fn, msg.frames, context, msg.meta,
                    attempt=msg.attempt, batch=msg.meta.get("batch"))
        if self.models is not None:
            manager, needed = self.models, dict(msg.meta.get("models") or {})
            call.prepare = lambda: manager.prepare(needed)
        if "gang" in msg.meta:
            self._as_gang_rank(call, msg.meta)
        elif "multi" in msg.meta:
            self._in_device_set_helper(call, msg.code_id, msg.meta["multi"])
        return [Execute(call)]

    def _as_gang_rank(self, call: Call, meta: dict[str, Any]) -> None:
        """Join (or reuse) the gang's process group before the function runs."""
        from gpufn.rendezvous import GangSpec

        gang = GangSpec.from_wire(meta["gang"])
        if not gang.store_host:  # the store runs in the scheduler process
            gang = dataclasses.replace(gang, store_host=self.scheduler_host)
        if self.groups is None:
            from gpufn.worker.groups import GroupManager

            self.groups = GroupManager()
        groups, ctx = self.groups, call.context
        ctx.rank, ctx.world_size = gang.rank, gang.world_size

        first = call.prepare

        def prepare() -> None:
            if first is not None:
                first()
            ctx.group = groups.ensure(gang, self.device)
            call.meta["group_inits"] = groups.inits
            call.meta["group_init_s"] = groups.last_init_s

        def on_error(exc: BaseException) -> None:
            groups.abort(f"rank {gang.rank} raised {type(exc).__name__}",
                         gang_id=gang.gang_id, generation=gang.generation)

        gather = bool(meta.get("gather"))

        def finish(value: Any) -> Any:
            return value if gather or gang.rank == 0 else None  # only rank 0's value is used

        call.prepare, call.on_error, call.finish = prepare, on_error, finish

    def _in_device_set_helper(self, call: Call, code_id: str, devices: list[dict[str, Any]]) -> None:
        from gpufn.worker.multidevice import DeviceSetHelper

        keys = tuple(d["key"] for d in devices)
        if self.helper is not None and (self.helper.keys != keys or not self.helper.alive()):
            self.helper.close()
            self.helper = None
        if self.helper is None:
            self.helper = DeviceSetHelper(devices)
        helper, frames, inv, name = self.helper, self.code_frames[code_id], call.invocation_id, call.name

        def run_there(*args: Any, **kwargs: Any) -> Any:
            return helper.run(inv, name, code_id, frames, args, kwargs, call.attempt)

        call.fn = run_there
        call.context.devices = [self.device] * len(devices)
