"""What the scheduler remembers: functions, invocations, devices and peers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpufn.memory_pool.ledger import DeviceLedger
from gpufn.memory_pool.probe import DeviceInfo
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import (
    DEVICE_TRANSITIONS,
    INV_TRANSITIONS,
    DeviceState,
    InvState,
    check,
)
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec


@dataclass(slots=True, eq=False)
class FunctionRecord:
    """A registered function: code id, spec and the run-time the scheduler measured."""

    function_id: str
    code_id: str
    name: str
    spec: GpuSpec
    code_frames: tuple[Any, ...]
    runtime_ewma: float | None = None
    calls: int = 0
    runtime_by_device: dict[str, float] = field(default_factory=dict)
    warm_gang: tuple[str, ...] = ()  # the devices of its last gang, preferred again
    app: str = ""  # the deployed app it belongs to ("" for an ad-hoc function)
    version: int = 0  # the app version it belongs to (0: ad-hoc)
    model_keys: tuple[str, ...] = ()  # the shared models it uses (see scheduler/models.py)

    def is_short(self, threshold: float) -> bool:
        """Measured to run in under `threshold` seconds: worth pipelining and inlining."""
        return self.runtime_ewma is not None and self.runtime_ewma <= threshold

    def estimate(self, device: str) -> float | None:
        """Expected run time on a device: measured there, else anywhere, else unknown."""
        return self.runtime_by_device.get(device, self.runtime_ewma)

    def observe_runtime(self, seconds: float, device: str = "", alpha: float = 0.2) -> None:
        """Exponentially weighted run time, overall and per device (devices differ)."""
        self.calls += 1
        if self.runtime_ewma is None:
            self.runtime_ewma = seconds
        else:
            self.runtime_ewma += alpha * (seconds - self.runtime_ewma)
        if device:
            old = self.runtime_by_device.get(device)
            self.runtime_by_device[device] = seconds if old is None else old + alpha * (seconds - old)


@dataclass(slots=True, eq=False)
class Invocation:
    """One call, from submit to result."""

    id: str
    function: FunctionRecord
    client: bytes
    spec: GpuSpec
    frames: tuple[Any, ...]
    submitted: float
    seq: int
    state: InvState = InvState.QUEUED
    history: list[tuple[str, float]] = field(default_factory=list)
    devices: tuple[str, ...] = ()
    started: float | None = None
    deadline: float | None = None  # latest start (per-call deadline)
    attempts: int = 0  # times dispatched (the attempt number of the latest run)
    # Unique per dispatch, scheduler-wide: what workers echo and cancels name, so a
    # late result or a remembered cancel never matches a later run of the same id.
    dispatch_token: int = 0
    shape: Shape = Shape.SINGLE
    preemptions: int = 0
    gang: tuple[str, int] | None = None  # (gang id, generation) of a multi-device call
    rank_results: dict[int, Any] = field(default_factory=dict)
    lost_ranks: dict[int, str] = field(default_factory=dict)
    failing_since: float | None = None  # a rank failed: waiting for the others to settle
    cold: str = ""  # "loaded" / "restored" / "waited" when its models were not resident
    replans: int = 0  # re-queued because a model turned out larger than declared
    members: list[Invocation] = field(default_factory=list)  # a batch carrier's calls
    carrier: Invocation | None = None  # the batch this call runs in
    preempt_asked: float | None = None  # when this call last preempted another
    # When its code can really run: not while pipelined behind another call on the worker
    # or waiting for its models to load. Timeouts count from here.
    run_started: float | None = None
    unstarted_losses: int = 0  # lost with its worker before it ever started (no retry used)
    user: str = ""  # whose call it is: the user its client's token belongs to (users.py)
    items: int = 0  # values a generator call has streamed to its caller (no retry after one)
    # A retried call waits until `not_before` (backoff; placement skips it until then) and
    # prefers devices other than the ones its last attempt was lost on.
    not_before: float = 0.0
    lost_on: tuple[str, ...] = ()
    shm: bool = False  # its caller takes big values through shared memory (Submit.shm)
    # Not a call but a lease (scheduler/desks/lease_desk.py): [secret, seconds, max calls];
    # it holds one slot while its client sends calls straight to the worker.
    lease: list[Any] | None = None
    wants_lease: bool = False  # its client takes a lease after it (Submit.lease)

    @property
    def reporters(self) -> int:
        """How many of its processes report a result (see `Shape`)."""
        return self.shape.reporters(self.devices)

    @property
    def counted_attempts(self) -> int:
        """Attempts that count against `retries`: not preemptions, not runs lost before
        they started."""
        return self.attempts - self.preemptions - self.unstarted_losses

    def to(self, new: InvState, now: float) -> None:
        check(f"invocation {self.id} ({self.function.name})", INV_TRANSITIONS, self.state, new,
              self.history)
        self.state = new
        self.history.append((new.value, now))

    # Each transition's effects on the record itself live in exactly one method; what it
    # means for queues and devices is done by the one core method that calls it.

    def start(self, now: float, devices: tuple[str, ...], token: int, shape: Shape) -> None:
        """QUEUED -> RUNNING on these devices, as dispatch `token`."""
        self.to(InvState.RUNNING, now)
        self.deadline = None  # it started in time; a retry or preemption never drops it
        self.devices = devices
        self.started = now
        self.run_started = None  # its clock starts once its models are resident
        self.attempts += 1
        self.dispatch_token = token
        self.shape = shape
        self._clear_run()

    def requeue(self, now: float) -> None:
        """RUNNING -> QUEUED: forget everything about the run that ended."""
        self.to(InvState.QUEUED, now)
        self.devices, self.started, self.run_started = (), None, None
        self.cold, self.carrier = "", None
        self._clear_run()

    def _clear_run(self) -> None:
        self.rank_results, self.lost_ranks, self.failing_since, self.gang = {}, {}, None, None


@dataclass(slots=True, eq=False)
class Device:
    """A device and its worker."""

    info: DeviceInfo
    supervisor: bytes
    ledger: DeviceLedger
    state: DeviceState = DeviceState.STARTING
    history: list[tuple[str, float]] = field(default_factory=list)
    worker: bytes | None = None
    control: bytes | None = None  # the worker's control socket (heartbeats, cancels)
    worker_pid: int = 0
    incarnation: int = 0  # generation of the current (or last) worker process
    fenced: int = 0  # highest generation that was lost: its messages are ignored
    last_seen: float = 0.0
    running: dict[str, Invocation] = field(default_factory=dict)
    running_by_fn: Counter[str] = field(default_factory=Counter)  # by code id
    code: set[str] = field(default_factory=set)
    last_error: str = ""
    restarts: int = 0
    completed: int = 0
    # invocation id -> when it was told to stop (cancelled, or its gang failed)
    stopping: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.info.key

    def slots_held(self, slots: int) -> int:
        """Calls holding a slot here: one each, but the calls of a function declared with a
        concurrency above `slots` hold one together (a stepped engine's calls share its
        steps, one driver thread: its batch, not a thread each, is their bound)."""
        held = len(self.running)
        if held < slots:
            return held  # at most this many: below the bound either way
        stepped = {i.function.code_id for i in self.running.values() if i.spec.concurrency > slots}
        return held - sum(self.running_by_fn[c] for c in stepped) + len(stepped)

    def steps_batch(self, slots: int) -> bool:
        """Whether a function declared with a concurrency above `slots` runs calls here."""
        return len(self.running) >= slots and any(
            i.spec.concurrency > slots for i in self.running.values())

    @property
    def takes_work(self) -> bool:
        """READY with a connected worker: the only devices placement may choose."""
        return self.state is DeviceState.READY and self.worker is not None

    def to(self, new: DeviceState, now: float) -> None:
        check(f"device {self.key}", DEVICE_TRANSITIONS, self.state, new, self.history)
        self.state = new
        self.history.append((new.value, now))


@dataclass(slots=True, eq=False)
class Peer:
    """A connected client, worker or supervisor (by ZeroMQ identity)."""

    identity: bytes
    role: str
    pid: int
    info: p.HelloInfo
    last_seen: float
    user: str = ""  # who its token belongs to (decided at Hello, never the peer's claim)
    admin: bool = False  # the cluster's (admin) token: sees every call


def drain_seconds(d: Device, now: float) -> float:
    """Expected seconds until the work on a device finishes (unknown run times count 0)."""
    total = 0.0
    for other in d.running.values():
        est = other.function.estimate(d.key)
        if est is None:
            continue
        started = other.started if other.started is not None else now
        total += max(0.0, est - (now - started))
    return total


Journal = frozenset[str]  # the calls a dead worker's process started (WorkerExited.started)


def journal_of(msg: p.WorkerExited) -> Journal | None:
    """The dead worker's journal when it is whole (every call it started), else None."""
    return frozenset(msg.started) if msg.journaled else None


def may_have_started(journal: Journal, invocation_id: str) -> bool:
    """By a whole journal: the call is in it, or its id is too long to be journaled."""
    return invocation_id in journal or len(invocation_id.encode()) > p.JOURNAL_ID_MAX
