"""The one wire module: every message that crosses a process boundary.

A message travels as frames `[tag, header, *payload]`: a one-byte type tag, a msgpack
header holding the message's fields in order, and the opaque user payload frames (a
pickle stream plus its out-of-band buffers). The machinery (`encode`/`decode`, the only
msgpack calls, and the field checks) is in `codec`, re-exported here; the scheduler never
looks inside payload frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from gpufn.wire.codec import (
    BATCH_TAG,
    PACKED_TAG,
    DecodeError,
    Frame,
    Message,
    as_bytes,
    batch_frames,
    decode,
    decode_all,
    encode,
    encode_batch,
    message,
    message_types,
    struct,
)

__all__ = ["BATCH_TAG", "PACKED_TAG", "PROTOCOL_VERSION", "DecodeError", "Frame", "Message", "Role",
           "as_bytes", "batch_frames", "decode", "decode_all", "encode", "encode_batch",
           "message", "message_types", "struct"]

PROTOCOL_VERSION = 7  # 7: the retry fields of Submit, LeaseOverrun, WorkerExited.started; 6: leases (direct calls); 5: a Run's meta carries the call's priority

class Role:
    CLIENT = "client"
    WORKER = "worker"
    SUPERVISOR = "supervisor"


# --------------------------------------------------------------------------- handshake


@struct
@dataclass(slots=True)
class HelloInfo:
    """What a peer says of itself in its Hello; the fields of other roles stay empty."""

    python: str = ""  # every peer: a client compares the workers' versions with its own
    cloudpickle: str = ""
    node: str = ""  # supervisor: its host
    user: str = ""  # client: its OS user, as a label (the token decides who calls)
    resubmit: int = 0  # client: how many calls it sends again after this Hello
    instance: str = ""  # client: the scheduler instance it knew before ("": none)
    devices: list[dict[str, Any]] = field(default_factory=list)  # supervisor: DeviceInfo wire
    host_memory: int = 0  # supervisor: its host's RAM, bytes
    device: str = ""  # worker: the device key it serves
    incarnation: int = 0  # worker: its generation (counted by its supervisor)
    channel: str = ""  # worker: "work" or "control"
    # After a scheduler restart (see scheduler/calls/recovery.py). Worker or supervisor: calls
    # that ran there lately and may have completed, with no Result left to hand over.
    ran: list[str] = field(default_factory=list)
    # Worker: calls running now, id -> [dispatch token, attempt, ms run so far]; their
    # Results follow.
    running: dict[str, list[int]] = field(default_factory=dict)
    # Worker: finished calls whose Result it still holds, id -> [dispatch token, attempt,
    # ms the run took];
    # each is sent again when the scheduler asks (`Resend`).
    held: dict[str, list[int]] = field(default_factory=dict)
    # Worker: the models resident on its device, [[key, bytes], ...]; they stay.
    models: list[list[Any]] = field(default_factory=list)
    host: str = ""  # client, supervisor: who shares its /dev/shm (gpufn.wire.shm.host_id)
    # Worker: where clients holding a lease send calls straight to it ("tcp://ip:port",
    # with "?key=" its CURVE public key off loopback).
    direct: str = ""


@message(1, structs={"info": HelloInfo})
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First message of every peer."""

    role: str
    version: int
    token: str
    pid: int
    info: HelloInfo = field(default_factory=HelloInfo)


@struct
@dataclass(slots=True)
class WelcomeInfo:
    """What an accepted peer learns of the cluster."""

    protocol: int = PROTOCOL_VERSION
    devices: int = 0
    client_timeout: float = 120.0  # a client silent this long is forgotten
    instance: str = ""  # this scheduler's id: a client tells a restart from being forgotten
    runtimes: list[dict[str, Any]] = field(default_factory=list)  # the workers' versions
    user: str = ""  # a client: the user its token belongs to (the scheduler decides)
    admin: bool = False  # a client: whether that is the cluster's (admin) token
    hosts: list[str] = field(default_factory=list)  # the device hosts' shm ids (HelloInfo.host)


@message(2, structs={"info": WelcomeInfo})
@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """The scheduler's answer to Hello; on refusal `error_kind` names a gpufn error."""

    ok: bool
    error_kind: str = ""
    message: str = ""
    info: WelcomeInfo = field(default_factory=WelcomeInfo)


@message(3)
@dataclass(frozen=True, slots=True)
class Ping(Message):
    seq: int


@message(4)
@dataclass(frozen=True, slots=True)
class Pong(Message):
    seq: int


@message(5)
@dataclass(frozen=True, slots=True)
class Goodbye(Message):
    """A peer leaving on purpose."""

    reason: str = ""


@message(6)
@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Scheduler -> peers: stop now (supervisors, workers), or the scheduler stops.
    To a client, `final` False says the scheduler is restarting: its calls wait for the
    next one (up to the grace, `GPUFN_HEAD_GRACE`); True (a `gpufn shutdown`, Ctrl-C)
    fails them."""

    reason: str = ""
    final: bool = True


@message(7)
@dataclass(frozen=True, slots=True)
class Error(Message):
    """A refusal that belongs to no invocation (bad message, unknown peer)."""

    error_kind: str
    message: str


# --------------------------------------------------------------------------- calls


@message(10)
@dataclass(frozen=True, slots=True)
class Register(Message):
    """Client -> scheduler: a function's code and spec, sent once per function id."""

    function_id: str
    code_id: str
    name: str
    spec: dict[str, Any]
    models: list[dict[str, Any]]
    frames: tuple[Frame, ...] = ()


@message(11)
@dataclass(frozen=True, slots=True)
class Submit(Message):
    """Client -> scheduler: one invocation; frames hold the pickled (args, kwargs)."""

    invocation_id: str
    function_id: str
    options: dict[str, Any]
    keep: bool = False  # keep the Result a while after the call ends (`FunctionCall.from_id`)
    shm: bool = False  # big values may travel through shared memory (gpufn.wire.shm) both ways
    lease: bool = False  # its client takes a lease for the calls after it (LeaseGrant)
    # Attempts it used under a lease before this Submit (its worker was lost, or it raised
    # an exception its Retries(on=...) matches): they count against `retries`, and it
    # waits its backoff, preferring a device other than `prior_device` (the lease's).
    prior_attempts: int = 0
    prior_raised: bool = False
    prior_device: str = ""
    # The lease whose worker was lost with the last of those attempts: the scheduler reads
    # the dead worker's journal, and an attempt that never started there is not counted.
    prior_lease: str = ""
    frames: tuple[Frame, ...] = ()


@message(12)
@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Client -> scheduler -> worker: stop this invocation."""

    invocation_id: str
    reason: str = ""
    include_running: bool = True
    dispatch_token: int = 0  # scheduler -> worker: the dispatch meant (0: any)
    # client -> scheduler: when not 0, answer with QueryReply(request_id, True,
    # {"cancelled": bool}); another user's call is answered like an unknown one
    request_id: int = 0


@struct
@dataclass(slots=True)
class ResultMeta:
    """What a run measured and how it ended (`Result.meta`). The worker fills the first
    group, the scheduler the second; the caller sees it as `FunctionCall.result_meta()`."""

    dispatch_token: int = 0  # the dispatch this reports on (see Run.dispatch_token)
    duration: float | None = None  # seconds the function ran
    rank: int | None = None  # which rank of a multi-device call reported (or failed)
    error_type: str = ""  # a user exception's type name
    traceback: str = ""  # a user exception's formatted remote traceback
    comm_error: bool = False  # the failure came from a peer rank going away
    group_inits: int | None = None  # process-group inits this worker has done
    group_init_s: float | None = None  # the last init's seconds
    batch_items: list[dict[str, Any]] | None = None  # per input of a batch: ok, n, error...
    devices: list[str] = field(default_factory=list)  # where it ran
    attempts: int = 0  # times dispatched
    queued_s: float = 0.0  # from submit to dispatch
    cold_start: str = ""  # "loaded" / "restored" / "waited"; "" when warm (or no model)
    batch_size: int | None = None  # calls in the batch it ran in
    gather: list[int] | None = None  # payload frames per rank, with gather=True
    items: int | None = None  # a generator: values it yielded (rank 0's, from a gang)
    first_item_s: float | None = None  # a generator: seconds from its start to its first value
    items_per_s: float | None = None  # a generator: values per second over its run
    retryable: bool = False  # the raised exception matches the call's Retries(on=...)
    shm: list[str] | None = None  # shared-memory files the value's frames name
    shm_freed: list[str] | None = None  # pooled argument files the worker no longer maps

    _PRIVATE = ("dispatch_token", "batch_items", "retryable", "shm", "shm_freed")

    def to_dict(self) -> dict[str, Any]:
        """What the caller sees: every field that is set, less the wire-only ones."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in self._PRIVATE and getattr(self, f.name) is not None}


@message(13, structs={"meta": ResultMeta})
@dataclass(frozen=True, slots=True)
class Result(Message):
    """The end of an invocation. ok: frames hold the pickled value. Not ok: with
    error_kind "" the frames hold the user's pickled exception; else a gpufn error."""

    invocation_id: str
    ok: bool
    error_kind: str
    message: str
    meta: ResultMeta = field(default_factory=ResultMeta)
    frames: tuple[Frame, ...] = ()


@message(14)
@dataclass(frozen=True, slots=True)
class Output(Message):
    """Text a function printed or logged, for the caller's terminal."""

    invocation_id: str
    stream: str
    text: str


@message(15)
@dataclass(frozen=True, slots=True)
class StatusRequest(Message):
    request_id: int


@message(16)
@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    request_id: int
    status: dict[str, Any]


# --------------------------------------------------------------------------- workers


@message(20)
@dataclass(frozen=True, slots=True)
class LoadCode(Message):
    """Scheduler -> worker: the pickled callable for a code id, sent once per worker."""

    code_id: str
    name: str
    frames: tuple[Frame, ...] = ()


@struct
@dataclass(slots=True)
class RunMeta:
    """How to run one dispatch (`Run.meta`)."""

    attempt_number: int = 1  # 1 for the first run, 2 for the first retry, ...
    timeout: float | None = None
    concurrency: int = 1
    inline: bool = False  # short: run on the worker's main thread
    models: dict[str, str] = field(default_factory=dict)  # model name -> key, for Model.get()
    gang: dict[str, Any] | None = None  # a gang rank: GangSpec.to_wire()
    gather: bool = False  # a gang rank returns its value (not only rank 0)
    warm: bool = False  # the gang's group is already formed
    multi: list[dict[str, Any]] | None = None  # spmd=False: every device (key, uuid, kind)
    batch: list[int] | None = None  # a batch: payload frames per member
    members: list[str] | None = None  # a batch: the members' invocation ids
    app: str = ""  # a deployed function's app and version: nested calls keep the version
    version: int = 0
    retry_on: list[str] | None = None  # Retries(on=...): "module.qualname" of each class
    shm_owner: int = 0  # the caller's pid if big results go to it through shared memory
    host_memory: int = 0  # @gpu(host_memory=): the worker's host-memory limit while it runs
    priority: int = 0  # the call's priority (a stepped engine joins requests by it)
    lease: list[Any] | None = None  # a lease, not a call: [secret, seconds, max calls] (leases.py)


@message(21, structs={"meta": RunMeta})
@dataclass(frozen=True, slots=True)
class Run(Message):
    """Scheduler -> worker: run an invocation as one dispatch. `dispatch_token` is unique
    per dispatch, scheduler-wide: the worker echoes it, and cancels name it, so a late
    result or a remembered cancel never matches another run of the same invocation."""

    invocation_id: str
    function_id: str
    code_id: str
    name: str
    dispatch_token: int
    meta: RunMeta
    frames: tuple[Frame, ...] = ()


@message(22)
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Worker -> scheduler: alive, what runs, what it measured."""

    running: list[str]
    stats: dict[str, Any]


# The exit status of a scheduler that stopped to be restarted (SIGTERM, its parent gone):
# `gpufn serve` starts it again; 0 means a final stop (`gpufn shutdown`, SIGINT).
EXIT_RESTART = 75
GAVE_UP = -999  # WorkerExited.returncode: the supervisor gave up restarting the worker
# WorkerExited.returncode: the supervisor stopped the worker, over its host-memory limit
# (the reason says by how much); its calls fail with HostOutOfMemory, never retried.
OUT_OF_HOST_MEMORY = -998


JOURNAL_ID_MAX = 63  # bytes: a longer call id is not journaled (WorkerExited.started)


@message(23)
@dataclass(frozen=True, slots=True)
class WorkerExited(Message):
    """Supervisor -> scheduler: a worker process ended (and will be restarted).
    `incarnation` is the generation of the process that ended (0: unknown): the scheduler
    ignores a notice about an older generation than the device's current worker."""

    device: str
    pid: int
    returncode: int
    reason: str
    incarnation: int = 0
    # The calls the process had started, from its journal (worker/host/held.py), when
    # `journaled`: the journal was whole (not missing, not wrapped), so a call not in it
    # (and whose id is at most JOURNAL_ID_MAX bytes) never started there.
    started: list[str] = field(default_factory=list)
    journaled: bool = False


@message(24)
@dataclass(frozen=True, slots=True)
class KillWorker(Message):
    """Scheduler -> supervisor: kill this device's worker (hard timeout, hung rank)."""

    device: str
    pid: int
    reason: str


@message(25)
@dataclass(frozen=True, slots=True)
class LoadModel(Message):
    """Scheduler -> worker: make a model resident: run its loader (frames hold the loader
    code), or bring it back from host memory (spec["restore"], no frames)."""

    model: str
    spec: dict[str, Any]
    frames: tuple[Frame, ...] = ()


@message(26)
@dataclass(frozen=True, slots=True)
class EvictModel(Message):
    """Scheduler -> worker: free a model's device memory, to host (offload) or entirely."""

    model: str
    offload: bool


class ModelState(str, Enum):
    """Where a model operation left the model on a worker (a string on the wire)."""

    RESIDENT = "resident"
    OFFLOADED = "offloaded"
    EVICTED = "evicted"
    LOAD_FAILED = "load_failed"
    OFFLOAD_FAILED = "offload_failed"


@message(27)
@dataclass(frozen=True, slots=True)
class ModelEvent(Message):
    """Worker -> scheduler: a model operation finished, leaving the model in `state`
    (message "restored" when it came back from host); nbytes and seconds are measured."""

    model: str
    state: ModelState
    nbytes: int
    seconds: float
    error_kind: str = ""
    message: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", ModelState(self.state))  # a plain str off the wire


class GroupOpKind(str, Enum):
    """What a GroupOp orders (a string on the wire)."""

    ABORT = "abort"


@message(28)
@dataclass(frozen=True, slots=True)
class GroupOp(Message):
    """Scheduler -> worker: tear down a gang's process group now (`gang` names the
    formation: gang_id, generation, reason); sent on the control channel so it lands
    while a collective blocks."""

    op: GroupOpKind
    gang: dict[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", GroupOpKind(self.op))


# --------------------------------------------------------------------------- deployments
# A client deploys an app (its functions' code and specs, pickled by value) and looks
# functions up by name; the scheduler keeps them in its state directory. Every request
# carries a client-chosen `request_id`, echoed by the `AppReply`.


APP_ALIAS = "app:"


def app_alias(app: str, function: str, version: int | None = None) -> str:
    """The function id a client submits to call a deployed function by name: the
    scheduler binds the call to the app's current version (or `version`) on admission."""
    return f"{APP_ALIAS}{app}/{function}" + (f"@{version}" if version else "")


@message(70)
@dataclass(frozen=True, slots=True)
class Deploy(Message):
    """Client -> scheduler: a new version of an app. `functions` describe each function
    (name, code_id, spec, models, ncode); frames hold each function's code frames
    (`ncode` of them) then its models' loader frames, function after function. `meta`:
    code_hash, tag, who, git_commit, git_dirty, strategy, source."""

    request_id: int
    app: str
    meta: dict[str, Any]
    functions: list[dict[str, Any]]
    frames: tuple[Frame, ...] = ()


@message(71)
@dataclass(frozen=True, slots=True)
class Lookup(Message):
    """Client -> scheduler: resolve app/function (version 0: the current one)."""

    request_id: int
    app: str
    function: str
    version: int = 0


@dataclass(frozen=True, slots=True)
class NoArgs:
    """A command that takes no arguments."""


@dataclass(frozen=True, slots=True)
class AppArgs:
    """`history`, `stop`: the app."""

    app: str = ""


@dataclass(frozen=True, slots=True)
class RollbackArgs:
    """`rollback`: to `version` (0: the one before the current), said by `who`."""

    app: str = ""
    version: int | None = 0
    who: str = ""
    strategy: str | None = "rolling"


APP_COMMANDS: dict[str, type[Any]] = {"list": NoArgs, "history": AppArgs, "stop": AppArgs,
                                      "rollback": RollbackArgs}


@message(72, args=("command", APP_COMMANDS))
@dataclass(frozen=True, slots=True)
class AppCommand(Message):
    """Client -> scheduler: list, history, rollback or stop (`args`: `APP_COMMANDS`)."""

    request_id: int
    command: str
    args: dict[str, Any] = field(default_factory=dict)


@message(73)
@dataclass(frozen=True, slots=True)
class AppReply(Message):
    """Scheduler -> client: the answer to Deploy, Lookup, AppCommand or UserCommand; on
    failure `error_kind` names a gpufn error (NotFound, AppStopped, ...)."""

    request_id: int
    ok: bool
    error_kind: str = ""
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- streaming
# A generator function's values travel as `Item`s, worker -> scheduler -> client, in
# order, before the call's terminal `Result`; the scheduler never unpickles them. Flow
# control is a credit window: the producer may have sent items 0 .. allowed-1, where
# `allowed` starts at STREAM_WINDOW and each `Credit` (client -> scheduler -> worker)
# raises it to what the consumer read plus STREAM_WINDOW. The producer also keeps the
# bytes of the values sent and not read yet under STREAM_BYTES (one value at least), so
# a stream of big values holds a few, not a window of them.

STREAM_WINDOW = 64  # values a producer may send before the consumer has read any
STREAM_BYTES = 32 * 2**20  # and the bytes of those unread, beyond the first value


@message(100)
@dataclass(frozen=True, slots=True)
class Item(Message):
    """Worker -> scheduler -> client: value number `seq` (from 0) of a generator call;
    frames hold it pickled. With `sizes`, a burst (the values yielded since the worker's
    last send): values `seq`, `seq + 1`, ... back to back in one frame, `sizes[i]` bytes
    each (one message and one frame for the burst, at every hop)."""

    invocation_id: str
    dispatch_token: int
    seq: int
    sizes: list[int] = field(default_factory=list)  # empty: one value, all the frames
    frames: tuple[Frame, ...] = ()

    def values(self) -> int:
        """How many values it holds."""
        return len(self.sizes) or 1


@message(101)
@dataclass(frozen=True, slots=True)
class Credit(Message):
    """Client -> scheduler -> worker: the producer may have sent `allowed` items in all
    (monotonic: a smaller value than one already granted changes nothing)."""

    invocation_id: str
    dispatch_token: int  # scheduler -> worker: the dispatch meant (the client sends 0)
    allowed: int


@message(102)
@dataclass(frozen=True, slots=True)
class Attach(Message):
    """Client -> scheduler: send me the Result of this call too (`FunctionCall.from_id`).
    Answered with the Result when the call ends, at once if it ended and was kept, or
    with a failed Result if the scheduler does not know the id."""

    invocation_id: str


# --------------------------------------------------------------------------- spmd=False helper
# The worker and its device-set helper process (worker/device_set/helper.py) speak these over
# a multiprocessing pipe, one `send_bytes` per frame. The helper's prints travel as
# `Output`, and `Shutdown` stops it.


@message(40)
@dataclass(frozen=True, slots=True)
class HelperRun(Message):
    """Worker -> helper: run a call. frames: the code's frames (the first `code_frames`,
    none when the helper has this code already), then the pickled (args, kwargs)."""

    invocation_id: str
    name: str
    code_id: str
    attempt: int  # the attempt number (1, 2, ...), for gpufn.context().attempt
    code_frames: int
    frames: tuple[Frame, ...] = ()


@message(41)
@dataclass(frozen=True, slots=True)
class HelperResult(Message):
    """Helper -> worker: the call ended. ok: frames hold the pickled value; else the
    pickled exception, its type name, message and formatted traceback."""

    invocation_id: str
    ok: bool
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    frames: tuple[Frame, ...] = ()


@message(55)
@dataclass(frozen=True, slots=True)
class WorkerServing(Message):
    """Scheduler -> supervisor: this worker connected and takes work, so it started
    fine; its later death is not a failure to start (the crash-loop count is reset)."""

    device: str
    pid: int
    incarnation: int



# --------------------------------------------------------------------------- leases
# Repeat calls skip the head (see gpufn/client/leases.py and scheduler/calls/leases.py).


@message(120)
@dataclass(frozen=True, slots=True)
class LeaseGrant(Message):
    """Scheduler -> client: for `seconds` (or `max_calls`), send calls of `function_id`
    straight to the worker at `endpoint` (DirectRun) with `secret`. `retries`: the
    function's, for calls its worker loses."""

    lease_id: str
    function_id: str
    endpoint: str
    secret: str
    seconds: float
    max_calls: int
    retries: int = 0
    # Calls of this client the scheduler had queued and hands to the lease instead: the
    # client sends them to the worker (they are no longer the scheduler's).
    reclaimed: list[str] = field(default_factory=list)
    # The leased device's key: a call of the client's that the scheduler ran there beside
    # the lease (`ResultMeta.devices`) says no other device was free for it.
    device: str = ""


@message(121)
@dataclass(frozen=True, slots=True)
class DirectRun(Message):
    """Client -> worker, under a lease: run this call; its Result comes straight back."""

    lease_id: str
    secret: str
    invocation_id: str
    frames: tuple[Frame, ...] = ()


@message(122)
@dataclass(frozen=True, slots=True)
class LeaseRefused(Message):
    """Worker -> client: these calls of a lease were not run (it ended, or is unknown);
    the client sends them through the scheduler."""

    lease_id: str
    invocation_ids: list[str]
    reason: str = ""


@message(123)
@dataclass(frozen=True, slots=True)
class LeaseReport(Message):
    """Worker -> scheduler, while a lease lasts: the calls it ran since the last report
    (id, ok, kind, s, wall, fn, app, v, user), for usage. Client -> scheduler, after its
    lease was lost with the worker: the calls it got answers for (id, ok)."""

    lease_id: str
    items: list[dict[str, Any]]


@message(124)
@dataclass(frozen=True, slots=True)
class LeaseOverrun(Message):
    """Worker -> scheduler (control channel): a call under a lease ran past its timeout
    and did not stop when interrupted. The scheduler fails it at its client with `message`
    (Timeout) and restarts the worker, as for a scheduled call past its timeout."""

    lease_id: str
    invocation_id: str
    message: str
    seconds: float


@message(110)
@dataclass(frozen=True, slots=True)
class Resend(Message):
    """Scheduler -> worker, after a restart: send again the Result of this call, which
    the worker said it holds (`HelloInfo.held`); its client asked for it again."""

    invocation_id: str
    dispatch_token: int


# --------------------------------------------------------------------------- operations
# The operator's CLI (`gpufn logs | usage | shutdown`) asks the scheduler through these;
# every answer is a `QueryReply` matched by request id.


class QueryKind(str, Enum):
    """What a Query asks for (a string on the wire; its arguments: `QUERIES`)."""

    LOGS = "logs"
    USAGE = "usage"


@dataclass(frozen=True, slots=True)
class LogsArgs:
    """The lines of `target` (an app, `app.function` or a function), `since` seconds ago
    or `after` a line's seq, at most `limit`."""

    target: str = ""
    since: float | None = None
    after: int = 0
    limit: int = 10_000


@dataclass(frozen=True, slots=True)
class UsageArgs:
    """Usage of the last `since` seconds, `by` "app", "function" or "user"."""

    since: float | None = None
    by: str = "function"


QUERIES: dict[str, type[Any]] = {QueryKind.LOGS.value: LogsArgs,
                                 QueryKind.USAGE.value: UsageArgs}


@message(80, args=("kind", QUERIES))
@dataclass(frozen=True, slots=True)
class Query(Message):
    """Client -> scheduler: read one of the scheduler's operational books."""

    request_id: int
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@message(81)
@dataclass(frozen=True, slots=True)
class QueryReply(Message):
    """Scheduler -> client: the answer to a Query or a Drain (ok False: `error` says why)."""

    request_id: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@message(82)
@dataclass(frozen=True, slots=True)
class Drain(Message):
    """Client -> scheduler: stop cleanly. New calls are refused and queued calls fail at
    once; running calls get `grace` seconds to finish; then every peer, remote worker
    hosts included, is told to shut down and the scheduler exits."""

    request_id: int
    grace: float
    reason: str = ""


# --------------------------------------------------------------------------- users


class UserCommandKind(str, Enum):
    """What a UserCommand asks (a string on the wire; its arguments: `USER_COMMANDS`);
    the admin's only."""

    CREATE = "create"  # -> user, token
    LIST = "list"  # -> users (never tokens)
    REVOKE = "revoke"  # -> user, dropped (connections closed)
    ROTATE = "rotate"  # -> user, token, dropped
    UPDATE = "update"  # only the fields given change (None clears a limit) -> user


@dataclass(frozen=True, slots=True)
class UserArgs:
    """A user by name, with the rights and limits to give them (create, update)."""

    name: str = ""
    operator: bool = False
    max_priority: int | None = None
    max_devices: int | None = None


@dataclass(frozen=True, slots=True)
class NameArgs:
    """A user by name (revoke, rotate)."""

    name: str = ""


USER_COMMANDS: dict[str, type[Any]] = {
    UserCommandKind.CREATE.value: UserArgs, UserCommandKind.UPDATE.value: UserArgs,
    UserCommandKind.LIST.value: NoArgs, UserCommandKind.REVOKE.value: NameArgs,
    UserCommandKind.ROTATE.value: NameArgs}


@message(90, args=("command", USER_COMMANDS))
@dataclass(frozen=True, slots=True)
class UserCommand(Message):
    """Client -> scheduler: manage the cluster's users (`gpufn token ...`); answered with
    an AppReply (on failure `error_kind` names a gpufn error)."""

    request_id: int
    command: str
    args: dict[str, Any] = field(default_factory=dict)
