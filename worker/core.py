"""The worker's sans-I/O core: scheduler messages in, actions out.

It holds the code cache and the calls it handed out, and decides what each message
means; it starts no thread or process and touches no device. The process shell
(`process.py`) owns the executor, the model cache, the gang's process group and the
spmd=False helper, and carries the actions out. Only the shell's main thread calls it.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gpufn.exceptions import GpufnError, SerializationError, kind_of
from gpufn.runtime import context as ctxmod
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.wire.rendezvous import GangSpec
from gpufn.worker.streaming import is_special

log = logging.getLogger("gpufn.worker")


class Unused(Enum):
    """What a call's `finish` returns when nobody reads this process's value (a gang's
    ranks other than 0 without gather): its Result carries no frames, nothing is pickled."""

    VALUE = "unused"


UNUSED = Unused.VALUE


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class JoinGroup:
    """A step of a gang rank, in its thread after its models are resident: join or reuse
    the gang's process group; if the call raises, abort the group. Only rank 0's value is
    read unless `gather`."""

    gang: GangSpec
    gather: bool = False

    def finish(self, value: Any) -> Any:
        """The rank's value as its Result carries it: only rank 0's is read (unless
        gather), so the others send none and pickle nothing."""
        return value if self.gather or self.gang.rank == 0 else UNUSED


@dataclass(frozen=True, slots=True)
class RunInHelper:
    """A step of a device-set call (spmd=False): it runs in a helper process that sees
    every device of the set, started or replaced unless the warm one serves this set."""

    devices: list[dict[str, Any]]
    code_id: str
    code_frames: list[bytes]


Step = JoinGroup | RunInHelper


@dataclass(frozen=True, slots=True)
class Execute:
    """Start a call (refused if a cancel for it came first): its models resident, then its
    `steps` in order, then the function; `inline`: on the main thread, else in an executor
    thread. The shell builds its own call from this and changes nothing here."""

    invocation_id: str
    name: str
    fn: Callable[..., Any]
    frames: tuple[Any, ...]
    dispatch_token: int
    meta: p.RunMeta
    steps: tuple[Step, ...] = ()
    inline: bool = False

    def context(self, device: Any) -> ctxmod.CallContext:
        """What `gpufn.context()` says inside this call on `device`."""
        rank, world_size, devices = 0, 1, 1
        for step in self.steps:
            if isinstance(step, JoinGroup):
                rank, world_size = step.gang.rank, step.gang.world_size
            else:
                devices = len(step.devices)
        meta = self.meta
        return ctxmod.CallContext(
            invocation_id=self.invocation_id, function=self.name, device=device,
            devices=[device] * devices, attempt=meta.attempt_number, app=meta.app,
            version=meta.version, rank=rank, world_size=world_size, priority=meta.priority)


@dataclass(frozen=True, slots=True)
class Interrupt:
    invocation_id: str
    dispatch_token: int = 0  # the dispatch meant (0: any)
    include_running: bool = True  # for a lease: False ends it only once idle


@dataclass(frozen=True, slots=True)
class Grant:
    """A stream's consumer read more: its producer may send `allowed` items in all."""

    invocation_id: str
    dispatch_token: int
    allowed: int


@dataclass(frozen=True, slots=True)
class AbortGroup:
    reason: str
    gang_id: str | None
    generation: int | None


@dataclass(frozen=True, slots=True)
class StartLoad:
    """Make a model resident (its loader in `frames`, or restored from host memory)."""

    model: str
    spec: dict[str, Any]
    frames: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Evict:
    model: str
    offload: bool


@dataclass(frozen=True, slots=True)
class Emit:
    msg: p.Message
    run: RunRecord | None = None  # with a call's Result: what ran (kept for a restart)


@dataclass(frozen=True, slots=True)
class ResendHeld:
    """Send again the Result of a call that this worker holds (after a restart)."""

    invocation_id: str
    dispatch_token: int


@dataclass(slots=True)
class RunRecord:
    """A call this worker runs, as a restarted scheduler needs to know it: a single-device
    call can be taken over by the next scheduler (`adoptable`); a batch (its `members`),
    a gang rank, a device-set call or a generator cannot, and counts as run."""

    dispatch_token: int
    attempt: int
    members: tuple[str, ...] = ()
    adoptable: bool = True
    started: float = 0.0  # time.monotonic() when it arrived here (a taken-over call is billed from it)


@dataclass(frozen=True, slots=True)
class Exit:
    reason: str


Action = (Execute | Interrupt | Grant | AbortGroup | StartLoad | Evict
          | Emit | Exit | ResendHeld)


def control_actions(msg: p.Message) -> list[Action]:
    """Cancel, Credit and GroupOp: pure and stateless, so the control thread uses it too (it
    must act while the main thread runs user code); the shell carries these out thread-safely."""
    if isinstance(msg, p.Cancel):
        return [Interrupt(msg.invocation_id, msg.dispatch_token, msg.include_running)]
    if isinstance(msg, p.Credit):
        return [Grant(msg.invocation_id, msg.dispatch_token, msg.allowed)]
    if isinstance(msg, p.GroupOp) and msg.op is p.GroupOpKind.ABORT:
        gang = msg.gang
        return [AbortGroup(str(gang.get("reason", "aborted by the scheduler")),
                           gang.get("gang_id"), gang.get("generation"))]
    return []


def _streams(fn: Any) -> bool:
    f = getattr(fn, "__wrapped__", fn)
    return inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f)


# --------------------------------------------------------------------------- core


@dataclass
class WorkerCore:
    device_key: str
    device: Any = "cpu"
    scheduler_host: str = "127.0.0.1"
    code: dict[str, Callable[..., Any]] = field(default_factory=dict)
    code_frames: dict[str, list[bytes]] = field(default_factory=dict)
    code_errors: dict[str, str] = field(default_factory=dict)
    streaming: set[str] = field(default_factory=set)  # code ids of generator functions
    running: dict[str, RunRecord] = field(default_factory=dict)
    completed: int = 0
    _last_gang: tuple[dict[str, Any], GangSpec] | None = None  # (wire form, spec) of the last gang rank

    def handle(self, msg: p.Message) -> list[Action]:
        if isinstance(msg, p.LoadCode):
            self._load_code(msg)
            return []
        if isinstance(msg, p.Run):
            return self._run(msg)
        if isinstance(msg, p.Shutdown):
            return [Exit(msg.reason or "scheduler asked")]
        if isinstance(msg, p.LoadModel):
            return [StartLoad(msg.model, msg.spec, tuple(msg.frames))]
        if isinstance(msg, p.EvictModel):
            return [Evict(msg.model, msg.offload)]
        if isinstance(msg, p.Resend):
            return [ResendHeld(msg.invocation_id, msg.dispatch_token)]
        return control_actions(msg)

    def done(self, result: p.Result) -> list[Action]:
        """A call ended (or was refused at its start)."""
        run = self.running.pop(result.invocation_id, None)
        self.completed += 1
        return [Emit(result, run)]

    def failed(self, msg: p.Message, exc: Exception) -> list[Action]:
        """Carrying out `msg` raised in the shell: a Run fails alone, the worker lives on."""
        if not isinstance(msg, p.Run):
            return []
        run = self.running.pop(msg.invocation_id, None)
        actions = self._fail(msg.invocation_id, GpufnError(
            f"worker {self.device_key} failed: {exc}"), msg.dispatch_token)
        return [Emit(a.msg, run) if isinstance(a, Emit) else a for a in actions]

    def restart_report(self) -> tuple[dict[str, list[int]], list[str], list[str]]:
        """For a Hello to a restarted scheduler: (running: id -> [dispatch token,
        attempt, milliseconds it has run] of the calls it can take over, ran: ids of the
        others, which count as run, stop: those of them to interrupt here, since no
        scheduler waits for them)."""
        running: dict[str, list[int]] = {}
        ran: list[str] = []
        stop: list[str] = []
        now = time.monotonic()
        for inv, run in self.running.items():
            if run.adoptable:
                running[inv] = [run.dispatch_token, run.attempt,
                                int(max(0.0, now - run.started) * 1000)]
            else:
                ran += run.members or [inv]
                stop.append(inv)
        return running, ran, stop

    def _load_code(self, msg: p.LoadCode) -> None:
        try:
            self.code_frames[msg.code_id] = [bytes(memoryview(f.buffer if hasattr(f, "buffer") else f))
                                             for f in msg.frames]
            fn = self.code[msg.code_id] = ser.load_code(msg.frames)
            self.code_errors.pop(msg.code_id, None)
            if _streams(fn):
                self.streaming.add(msg.code_id)
        except Exception as e:
            self.code_errors[msg.code_id] = f"{type(e).__name__}: {e}"
            log.warning("could not unpickle %s: %s", msg.name, e)

    def _fail(self, inv: str, err: GpufnError, dispatch_token: int) -> list[Action]:
        meta = p.ResultMeta(dispatch_token=dispatch_token)
        return [Emit(p.Result(inv, False, kind_of(err), str(err), meta))]

    def _run(self, msg: p.Run) -> list[Action]:
        fn = self.code.get(msg.code_id)
        if fn is None:
            why = self.code_errors.get(msg.code_id)
            if why is None:
                return self._fail(msg.invocation_id, GpufnError(
                    f"worker {self.device_key} has no code {msg.code_id} for {msg.name}"),
                    msg.dispatch_token)
            return self._fail(msg.invocation_id, SerializationError(
                f"{msg.name} could not be unpickled on worker {self.device_key}: {why}. If it is "
                "defined in a module, that module must be importable on the worker (same code "
                "and PYTHONPATH), or define it in __main__ / a notebook cell"), msg.dispatch_token)
        meta = msg.meta
        # A streamed call cannot be taken over (the values sent meanwhile are gone).
        single = (meta.gang is None and meta.multi is None and not meta.members
                  and msg.code_id not in self.streaming)
        self.running[msg.invocation_id] = RunRecord(
            msg.dispatch_token, meta.attempt_number, tuple(meta.members or ()), single,
            time.monotonic())
        steps: tuple[Step, ...] = ()
        if meta.gang is not None:
            steps = (JoinGroup(self._gang_spec(meta.gang), meta.gather),)
        elif meta.multi is not None:
            steps = (RunInHelper(meta.multi, msg.code_id, self.code_frames[msg.code_id]),)
        return [Execute(msg.invocation_id, msg.name, fn, tuple(msg.frames), msg.dispatch_token,
                        meta, steps, meta.inline and not is_special(fn))]

    def _gang_spec(self, wire: dict[str, Any]) -> GangSpec:
        """The rank's GangSpec; a warm gang's calls all bring the same one, read once."""
        last = self._last_gang
        if last is not None and last[0] == wire:
            return last[1]
        gang = GangSpec.from_wire(wire)
        if not gang.store_host:  # the store runs in the scheduler process
            gang = dataclasses.replace(gang, store_host=self.scheduler_host)
        self._last_gang = (wire, gang)
        return gang
