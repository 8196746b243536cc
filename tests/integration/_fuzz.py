"""A seeded generator of bad input for the scheduler's port, and the peers that send it.

Each case is a list of multipart messages plus what each must draw from the scheduler:
"error" (an `Error`), "refused" (a `Welcome(ok=False)`), "result" (a failed `Result`),
"status", "pong", "none" (ignored by design: a late result, a cancel of an unknown call)
or "any" (a reply is allowed but not required). Strangers (no valid Hello) must draw
exactly one refusal per message; insiders (said Hello with the token) are checked against
the labels after a Ping barrier.
"""

from __future__ import annotations

import random
import socket
import string
import struct
import time
import typing
from collections import Counter
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import msgpack
import zmq

from gpufn.memory_pool.probe import simulated_devices
from gpufn.wire import codec
from gpufn.wire import protocol as p

# Messages the scheduler accepts from some role (the rest are "unexpected" from anyone).
# What the scheduler handles from some peer; every other type is "unexpected". Operator
# commands (Drain stops the cluster, Deploy/AppCommand change apps) are valid from a client
# holding the token, so they are never sent as if they were garbage.
INBOUND = (p.Hello, p.Ping, p.Goodbye, p.Register, p.Submit, p.Cancel, p.StatusRequest,
           p.Result, p.Output, p.Heartbeat, p.WorkerExited, p.ModelEvent, p.Item, p.Credit,
           p.Attach, p.Query, p.Drain, p.Deploy, p.Lookup, p.AppCommand, p.UserCommand,
           p.LeaseReport)
CLIENT_FORBIDDEN = (p.Result, p.Output, p.Heartbeat, p.ModelEvent, p.WorkerExited, p.Item)


def _rand_str(rng: random.Random, n: int = 12) -> str:
    alphabet = string.ascii_letters + string.digits + "é中\x00 /:"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))


def rand_value(rng: random.Random, depth: int = 2) -> Any:
    """Any msgpack value: scalars of every type, edge numbers, nested containers."""
    k = rng.randrange(11 if depth > 0 else 8)
    if k == 0:
        return None
    if k == 1:
        return rng.random() < 0.5
    if k == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), rng.randint(-1000, 1000)])
    if k == 3:
        return rng.choice([0.0, -1.5, float("inf"), float("-inf"), float("nan"), 1e308])
    if k in (4, 5):
        return _rand_str(rng)
    if k == 6:
        return rng.randbytes(rng.randint(0, 16))
    if k == 7:
        return ""
    if k in (8, 9):
        return [rand_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {_rand_str(rng, 6): rand_value(rng, depth - 1) for _ in range(rng.randint(0, 4))}


def _value_for(rng: random.Random, hint: Any) -> Any:
    """A well-typed value for a field annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _value_for(rng, args[0]) if args else None
    hint = origin or hint
    if hint is str:
        return _rand_str(rng)
    if hint is bool:
        return rng.random() < 0.5
    if hint is int:
        return rng.randint(0, 1000)
    if hint is float:
        return rng.random() * 10
    if hint is dict:
        return {}
    if hint is list:
        return []
    if isinstance(hint, type) and issubclass(hint, Enum):
        return next(iter(hint)).value
    if hasattr(hint, "from_wire"):
        return hint().to_wire()
    return None


def sample_header(rng: random.Random, cls: type[p.Message]) -> list[Any]:
    """A well-typed header (field values in order) for any registered message class."""
    hints = typing.get_type_hints(cls)
    return [_value_for(rng, hints[f.name]) for f in fields(cls) if f.name != "frames"]


def frames_of(cls: type[p.Message], header: Any, payload: int = 0) -> list[bytes]:
    tag = next(t for t, c in p.message_types().items() if c is cls)
    return [bytes([tag]), msgpack.packb(header, use_bin_type=True), *[b"x"] * payload]


def _wrong_type(rng: random.Random, kinds: tuple[type, ...]) -> Any:
    for _ in range(100):
        v = rand_value(rng)
        if not isinstance(v, kinds):
            return v
    return object.__class__  # unreachable in practice


@dataclass
class Case:
    messages: list[list[bytes]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # the generator category of each

    def add(self, frames: list[bytes], label: str, kind: str) -> None:
        self.messages.append(frames)
        self.labels.append(label)
        self.kinds.append(kind)


class Generator:
    """Bad messages of every kind the issue names, from one seed."""

    def __init__(self, seed: int, token: str) -> None:
        self.rng = random.Random(seed)
        self.token = token
        self.classes = list(p.message_types().values())

    # ------------------------------------------------------------------ undecodable

    def random_bytes(self) -> list[bytes]:
        r = self.rng
        return [r.randbytes(r.randint(0, 48)) for _ in range(r.randint(1, 4))]

    def truncated(self) -> list[bytes]:
        r = self.rng
        cls = r.choice(self.classes)
        header = msgpack.packb(sample_header(r, cls), use_bin_type=True)
        frames = frames_of(cls, None)
        frames[1] = header[: r.randrange(len(header))]  # never the whole header
        return frames

    def wrong_tag(self) -> list[bytes]:
        r = self.rng
        taken = set(p.message_types()) | {0}
        tag = r.choice([bytes([t]) for t in range(256) if t not in taken] + [b"", b"\x01\x01", b"\x0b\x00"])
        return [tag, msgpack.packb(sample_header(r, r.choice(self.classes)), use_bin_type=True)]

    def wrong_types(self, classes: tuple[type[p.Message], ...] | None = None) -> list[bytes]:
        """A known tag whose header has a field of the wrong type, the wrong shape, or
        a field of the wrong type inside a nested record (Result.meta, Run.meta)."""
        r = self.rng
        cls = r.choice(list(classes or self.classes))
        header = sample_header(r, cls)
        checks = [(i, k) for i, (_, k) in enumerate(codec._checks(cls)) if k is not None]
        how = r.randrange(6)
        if how == 0 or not checks:
            header = r.choice([{}, {"a": 1}, 7, "x", None, b"\x01"])  # not a list
        elif how == 1:
            header = [*header, *[rand_value(r) for _ in range(r.randint(1, 3))]]  # extra fields
        elif how == 2 and any(isinstance(v, list) and cls_struct(cls, i) for i, v in enumerate(header)):
            i = next(i for i, v in enumerate(header) if isinstance(v, list) and cls_struct(cls, i))
            kind = cls_struct(cls, i)
            assert kind is not None
            inner = [(j, k) for j, (_, k) in enumerate(codec._checks(kind)) if k is not None]
            j, kinds = r.choice(inner)
            header[i][j] = _wrong_type(r, kinds)
        else:
            for _ in range(r.randint(1, len(checks))):
                i, kinds = r.choice(checks)
                header[i] = _wrong_type(r, kinds)
        return [frames_of(cls, None)[0], msgpack.packb(header, use_bin_type=True)]

    def huge_lengths(self) -> list[bytes]:
        """msgpack headers and batch headers that declare far more than they hold."""
        r = self.rng
        cls = r.choice(self.classes)
        tag = frames_of(cls, None)[0]
        declared = r.choice([b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                             b"\xdf\xff\xff\xff\xff", b"\xdc\xff\xff", b"\xc5\xff\xff"])
        if r.random() < 0.3:  # a batch whose counts claim frames that are not there
            counts = r.choice([[2**31], [2**32 - 1, 1], [1] * 1000, [3, 2**20], [0], [-1]])
            return [p.BATCH_TAG, msgpack.packb(counts), tag, b"\x90"]
        return [tag, declared + r.randbytes(r.randint(0, 8))]

    # ------------------------------------------------------------------ decodable

    def hello(self, *, role: str = p.Role.CLIENT, token: str | None = None,
              version: int = p.PROTOCOL_VERSION, info: dict[str, Any] | None = None) -> list[bytes]:
        return p.encode(p.Hello(role, version, self.token if token is None else token, 4242,
                                p.HelloInfo(**(info or {}))))

    def wrong_version(self) -> list[bytes]:
        r = self.rng
        # never the version spoken now: such a Hello would be welcomed (and its peer could then
        # send a valid Drain that stops the cluster)
        v = r.choice([0, p.PROTOCOL_VERSION - 1, -1, 2**31, p.PROTOCOL_VERSION + r.randint(1, 100)])
        return self.hello(role=r.choice([p.Role.CLIENT, p.Role.WORKER, p.Role.SUPERVISOR]), version=v)

    def wrong_token(self) -> list[bytes]:
        r = self.rng
        return self.hello(role=r.choice([p.Role.CLIENT, p.Role.WORKER, p.Role.SUPERVISOR]),
                          token=r.choice(["", "x", self.token + "x", self.token[:-1], _rand_str(r)]))

    def valid(self, classes: tuple[type[p.Message], ...] | None = None) -> tuple[type[p.Message], list[bytes]]:
        r = self.rng
        cls = r.choice(list(classes or [c for c in self.classes if c is not p.Hello]))
        return cls, frames_of(cls, sample_header(r, cls), payload=r.randint(0, 2))

    # ------------------------------------------------------------------ cases

    def stranger(self, n: int) -> Case:
        """Messages from a peer that never said a valid Hello: each must be refused."""
        case = Case()
        makers = [("random bytes", self.random_bytes), ("truncated msgpack", self.truncated),
                  ("wrong tag", self.wrong_tag), ("wrong field types", self.wrong_types),
                  ("huge declared length", self.huge_lengths), ("wrong version", self.wrong_version),
                  ("wrong token", self.wrong_token),
                  ("unauthenticated valid", lambda: self.valid()[1])]
        for _ in range(n):
            kind, make = self.rng.choice(makers)
            case.add(make(), "refusal", kind)
        return case

    def insider_client(self, n: int) -> Case:
        """A client with the token sending wrong-order and ill-typed messages."""
        r, case = self.rng, Case()
        case.add(self.hello(), "welcome", "hello")
        for _ in range(n):
            k = r.randrange(9)
            if k == 0:
                case.add(self.wrong_types(), "error", "wrong field types")
            elif k == 1:
                case.add(r.choice([self.random_bytes, self.truncated, self.wrong_tag,
                                   self.huge_lengths])(), "error", "undecodable")
            elif k == 2:  # Submit before (without) Register
                sub = p.Submit(f"fz{r.getrandbits(48):x}", f"nofn{r.getrandbits(32):x}",
                               {}, frames=(b"args",))
                case.add(p.encode(sub), "result", "submit before register")
            elif k == 3:  # a Register whose spec is wrong (always: memory is not a size)
                spec = {_rand_str(r, 5): rand_value(r) for _ in range(r.randint(0, 3))}
                spec["memory"] = r.choice(["lots", -5, [1], {"a": 1}, True])
                for key in ("count", "priority", "timeout", "type", "concurrency"):
                    if r.random() < 0.3:
                        spec[key] = rand_value(r)
                models = r.choice([[], [rand_value(r)], [{"name": rand_value(r), "nframes": rand_value(r)}]])
                reg = p.Register(f"fn{r.getrandbits(48):x}", "code", _rand_str(r), spec, models,
                                 (b"code",) * r.randint(0, 2))
                case.add(p.encode(reg), "error", "register with a bad spec")
            elif k == 4:
                case.add(p.encode(p.Cancel(f"fz{r.getrandbits(48):x}", _rand_str(r))), "none",
                         "cancel of an unknown call")
            elif k == 5:
                _, frames = self.valid(CLIENT_FORBIDDEN)
                case.add(frames, "error", "worker message from a client")
            elif k == 6:
                _, frames = self.valid(tuple(c for c in self.classes if c not in INBOUND))
                case.add(frames, "error", "unexpected message type")
            elif k == 7:
                case.add(r.choice([self.wrong_version, self.wrong_token])(), "refused",
                         "bad hello from a client")
            else:
                case.add(self.hello(role=p.Role.WORKER, info={"device": r.choice(
                    ["nowhere:0", "", _rand_str(r)])}), "refused", "worker hello for an unknown device")
            if k not in (2, 3, 5, 6) and r.random() < 0.05:
                case.add(p.encode(p.StatusRequest(r.randint(0, 2**31))), "status", "status")
        return case

    def insider_worker(self, n: int) -> Case:
        """A worker of a device its own supervisor announced, reporting on calls it was
        never given (results, outputs, heartbeats, model events)."""
        r, case = self.rng, Case()
        for _ in range(n):
            k = r.randrange(6)
            if k == 0:
                meta = p.ResultMeta(dispatch_token=r.randint(0, 2**40), duration=r.random())
                res = p.Result(f"fz{r.getrandbits(48):x}", r.random() < 0.5, "", _rand_str(r), meta,
                               (b"value",))
                case.add(p.encode(res), "none", "result for a call never given")
            elif k == 1:
                case.add(p.encode(p.Output(f"fz{r.getrandbits(48):x}", "stdout", _rand_str(r))),
                         "none", "output for a call never given")
            elif k == 2:
                case.add(p.encode(p.Heartbeat([_rand_str(r) for _ in range(3)], {})), "none",
                         "heartbeat")
            elif k == 3:
                ev = p.ModelEvent(_rand_str(r), r.choice(list(p.ModelState)), r.randint(0, 2**40),
                                  r.random(), _rand_str(r), _rand_str(r))
                case.add(p.encode(ev), "any", "model event for a model never loaded")
            elif k == 4:
                case.add(self.wrong_types((p.Result, p.Heartbeat, p.ModelEvent, p.Output)), "error",
                         "wrong field types")
            else:
                _, frames = self.valid((p.Register, p.Submit, p.Cancel, p.WorkerExited))
                case.add(frames, "error", "client message from a worker")
        return case


def cls_struct(cls: type[p.Message], index: int) -> type[Any] | None:
    return dict(codec._STRUCT_FIELDS.get(cls, ())).get(index)


# --------------------------------------------------------------------------- peers


def _identity(rng: random.Random) -> bytes:
    return bytes([rng.randint(1, 255)]) + rng.randbytes(rng.randint(1, 30))


class Peer:
    """One DEALER connection that sends a case and collects what comes back."""

    def __init__(self, ctx: zmq.Context[Any], address: str, identity: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.replies: list[p.Message] = []
        self.sent_frames = 0
        self.sent_messages = 0

    def send(self, case: Case) -> None:
        for frames in case.messages:
            self.sock.send_multipart(frames)
            self.sent_frames += len(frames)
            self.sent_messages += 1

    def ping(self, seq: int) -> None:
        self.sock.send_multipart(p.encode(p.Ping(seq)))

    def receive(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.replies.extend(p.decode_all(frames))

    def close(self) -> None:
        self.sock.close(0)


def collect(peers: dict[Peer, Any], done: Any, timeout: float) -> None:
    """Poll `peers` until `done(peer)` holds for each, or `timeout` passes."""
    poller = zmq.Poller()
    for peer in peers:
        poller.register(peer.sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    waiting = {peer for peer in peers if not done(peer)}
    while waiting and time.monotonic() < deadline:
        for sock, _ in poller.poll(50):
            for peer in list(waiting):
                if peer.sock is sock:
                    peer.receive()
        waiting = {peer for peer in waiting if not done(peer)}


def reply_kinds(replies: list[p.Message]) -> Counter[str]:
    out: Counter[str] = Counter()
    for m in replies:
        if isinstance(m, p.Error):
            out["error"] += 1
        elif isinstance(m, p.Welcome):
            out["welcome" if m.ok else "refused"] += 1
        elif isinstance(m, p.Result):
            out["result" if not m.ok else "ok result"] += 1
        elif isinstance(m, p.StatusReply):
            out["status"] += 1
        elif isinstance(m, p.Pong):
            out["pong"] += 1
        else:
            out[type(m).__name__] += 1
    return out


def fake_device(node: str) -> dict[str, Any]:
    """A device that only the fuzzer's own supervisor announces (no real call fits it:
    its type is FUZZ)."""
    return simulated_devices(node, 1, 2**30, name="FUZZ")[0].to_wire()


# --------------------------------------------------------------------------- raw TCP


_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _ready_command() -> bytes:
    props = b"".join(bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
                     for k, v in ((b"Socket-Type", b"DEALER"), (b"Identity", b"")))
    body = b"\x05READY" + props
    return b"\x04" + bytes([len(body)]) + body


def raw_case(rng: random.Random) -> tuple[str, bytes]:
    """Bytes for a raw TCP connection that speaks broken ZMTP."""
    k = rng.randrange(5)
    if k == 0:
        return "raw garbage", rng.randbytes(rng.randint(1, 200))
    if k == 1:
        return "greeting then garbage", _GREETING + rng.randbytes(rng.randint(1, 100))
    if k == 2:  # a frame declaring more than GPUFN_MAX_PAYLOAD (refused before buffering)
        size = rng.choice([2**40, 2**63 - 1, 3 * 2**30])
        return "huge declared frame", _GREETING + _ready_command() + b"\x02" + struct.pack(">Q", size) + b"x" * 10
    if k == 3:  # a command frame declaring a huge size
        return "huge declared command", _GREETING + b"\x06" + struct.pack(">Q", 2**62) + b"READY"
    return "wrong ZMTP version", b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x09\x09" + rng.randbytes(60)


def raw_connection(host: str, port: int, data: bytes, timeout: float) -> bool:
    """Send `data` and keep the connection open; True once the scheduler closes it."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        deadline = time.monotonic() + timeout
        try:
            s.sendall(data)
            while time.monotonic() < deadline:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                if not s.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


# --------------------------------------------------------------------------- the run


def _check_insider(peer: Peer, case: Case, seq: int) -> str | None:
    """Why the replies to an insider's case are wrong, or None."""
    got = reply_kinds(peer.replies)
    want = Counter(case.labels)
    problems = []
    for kind in ("welcome", "refused", "result", "status"):
        if got[kind] != want[kind]:
            problems.append(f"{got[kind]} {kind} replies for {want[kind]} such messages")
    if not want["error"] <= got["error"] <= want["error"] + want["any"]:
        problems.append(f"{got['error']} errors for {want['error']} refusable messages "
                        f"(+{want['any']} that may be refused)")
    other = set(got) - {"welcome", "refused", "result", "status", "error", "pong"}
    if other:
        problems.append(f"unexpected replies {sorted(other)}")
    if not any(isinstance(m, p.Pong) and m.seq == seq for m in peer.replies):
        problems.append("no Pong for the barrier Ping")
    return "; ".join(problems) or None


def run(address: str, token: str, target: int, seed: int, raw_every: int = 3) -> dict[str, Any]:
    """Send at least `target` bad messages in rounds of several peers; return a report."""
    gen = Generator(seed, token)
    rng = random.Random(seed + 1)
    ctx = zmq.Context()
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    report: dict[str, Any] = {"messages": 0, "frames": 0, "rounds": 0, "peers": 0,
                              "by_kind": Counter(), "replies": Counter(), "failures": [],
                              "raw": Counter()}
    by_kind: Counter[str] = report["by_kind"]
    try:
        rnd = 0
        while report["messages"] < target:
            rnd += 1
            peers: dict[Peer, tuple[str, Case]] = {}
            for _ in range(6):
                peer, case = Peer(ctx, address, _identity(rng)), gen.stranger(40)
                peers[peer] = ("stranger", case)
            peers[Peer(ctx, address, _identity(rng))] = ("client", gen.insider_client(40))
            extra: list[Peer] = []
            if rnd % 4 == 1:  # a supervisor of our own, and a worker on its fake device
                node = f"fuzz{rnd}"
                sup, worker = Peer(ctx, address, _identity(rng)), Peer(ctx, address, _identity(rng))
                sup.sock.send_multipart(gen.hello(role=p.Role.SUPERVISOR,
                                                  info={"node": node, "devices": [fake_device(node)]}))
                collect({sup: None}, lambda q: bool(q.replies), 30)
                worker.sock.send_multipart(gen.hello(role=p.Role.WORKER,
                                                     info={"device": f"{node}:0", "incarnation": 1}))
                collect({worker: None}, lambda q: bool(q.replies), 30)
                ok = [m for m in sup.replies + worker.replies if isinstance(m, p.Welcome) and m.ok]
                if len(ok) != 2:
                    report["failures"].append(f"fake supervisor/worker not welcomed: "
                                              f"{sup.replies + worker.replies}")
                worker.replies.clear()
                peers[worker] = ("worker", gen.insider_worker(40))
                extra.append(sup)
            for peer, (role, case) in peers.items():
                peer.send(case)
                if role != "stranger":
                    peer.ping(rnd)
                by_kind.update(case.kinds)
                report["messages"] += peer.sent_messages
                report["frames"] += peer.sent_frames

            def done(peer: Peer, peers: dict[Peer, tuple[str, Case]] = peers, rnd: int = rnd) -> bool:
                role, case = peers[peer]
                if role == "stranger":
                    return len(peer.replies) >= len(case.messages)
                return any(isinstance(m, p.Pong) and m.seq == rnd for m in peer.replies)

            collect(peers, done, 60)
            for peer, (role, case) in peers.items():
                report["replies"].update(reply_kinds(peer.replies))
                if role == "stranger":
                    kinds = reply_kinds(peer.replies)
                    bad = set(kinds) - {"error", "refused"}
                    if len(peer.replies) != len(case.messages) or bad:
                        report["failures"].append(
                            f"round {rnd} stranger: {len(peer.replies)} replies to "
                            f"{len(case.messages)} messages, kinds {dict(kinds)}")
                else:
                    why = _check_insider(peer, case, rnd)
                    if why:
                        report["failures"].append(f"round {rnd} {role}: {why}; sent "
                                                  f"{list(zip(case.kinds, case.labels, strict=True))}")
                if role != "stranger":
                    peer.sock.send_multipart(p.encode(p.Goodbye("fuzz round over")))
            for sup in extra:
                sup.sock.send_multipart(p.encode(p.Goodbye("fuzz round over")))
            for peer in [*peers, *extra]:
                peer.close()
            report["peers"] += len(peers) + len(extra)
            report["rounds"] = rnd
            if rnd % raw_every == 0:
                kind, data = raw_case(rng)
                must = kind.startswith("huge declared")
                dropped = raw_connection(host, int(port), data, 5.0 if must else 1.0)
                report["raw"][f"{kind}: {'dropped' if dropped else 'held open'}"] += 1
                if must and not dropped:
                    report["failures"].append(f"round {rnd}: {kind} was not dropped")
    finally:
        ctx.destroy(0)
    report["by_kind"] = dict(by_kind)
    report["replies"] = dict(report["replies"])
    report["raw"] = dict(report["raw"])
    return report


def run_to_queue(address: str, token: str, target: int, seed: int, out: Any) -> None:
    """`run` in a child process (so the fuzzer does not share a GIL with the probe)."""
    try:
        out.put(run(address, token, target, seed))
    except BaseException as e:
        import traceback

        out.put({"crashed": "".join(traceback.format_exception(e))})
