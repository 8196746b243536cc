"""The worker's sans-I/O core: scheduler messages in, actions out.

It holds the code cache and what runs; the process shell (`process.py`) performs the
actions (start a call in the executor, interrupt one, send a message, exit).
"""

from __future__ import annotations

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
    code: dict[str, Callable[..., Any]] = field(default_factory=dict)
    code_errors: dict[str, str] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    completed: int = 0

    def handle(self, msg: p.Message) -> list[Action]:
        if isinstance(msg, p.LoadCode):
            return self._load_code(msg)
        if isinstance(msg, p.Run):
            return self._run(msg)
        if isinstance(msg, p.Cancel):
            return [Interrupt(msg.invocation_id)] if msg.invocation_id in self.running else []
        if isinstance(msg, p.Shutdown):
            return [Exit(msg.reason or "scheduler asked")]
        return []

    def done(self, result: p.Result) -> list[Action]:
        self.running.discard(result.invocation_id)
        self.completed += 1
        return [SendMsg(result)]

    def _load_code(self, msg: p.LoadCode) -> list[Action]:
        try:
            self.code[msg.code_id] = ser.load_code(msg.frames)
            self.code_errors.pop(msg.code_id, None)
        except Exception as e:
            self.code_errors[msg.code_id] = f"{type(e).__name__}: {e}"
            log.warning("could not unpickle %s: %s", msg.name, e)
        return []

    def _fail(self, inv: str, err: GpufnError) -> list[Action]:
        return [SendMsg(p.Result(inv, False, kind_of(err), str(err), {}))]

    def _run(self, msg: p.Run) -> list[Action]:
        fn = self.code.get(msg.code_id)
        if fn is None:
            why = self.code_errors.get(msg.code_id)
            if why is None:
                return self._fail(msg.invocation_id, GpufnError(
                    f"worker {self.device_key} has no code {msg.code_id} for {msg.name}"))
            return self._fail(msg.invocation_id, SerializationError(
                f"{msg.name} could not be unpickled on worker {self.device_key}: {why}. If it is "
                "defined in a module, that module must be importable on the worker (same code "
                "and PYTHONPATH), or define it in __main__ / a notebook cell"))
        self.running.add(msg.invocation_id)
        context = ctxmod.CallContext(
            invocation_id=msg.invocation_id, function=msg.name, device=self.device,
            devices=[self.device], attempt=msg.attempt,
        )
        return [Execute(Call(msg.invocation_id, msg.name, fn, msg.frames, context, msg.meta))]
