from __future__ import annotations

import dataclasses
import re

import msgpack
import pytest

from gpufn.wire import codec
from gpufn.wire import protocol as p

SAMPLES: list[p.Message] = [
    p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, "tok", 42, p.HelloInfo(user="x", ran=["a"])),
    p.Hello(p.Role.WORKER, p.PROTOCOL_VERSION, "tok", 43, p.HelloInfo(
        device="n:0", running={"r1": [7, 1]}, held={"h1": [5, 2]}, models=[["m@abc", 1024]])),
    p.Welcome(True, "", "", p.WelcomeInfo(devices=2, user="bob", admin=False)),
    p.Welcome(False, "AuthenticationError", "wrong token"),
    p.Ping(1), p.Pong(1), p.Goodbye("bye"), p.Shutdown("stop"), p.Error("GpufnError", "bad"),
    p.Register("f1", "c1", "square", {"count": 1}, [{"name": "m", "nframes": 1}], (b"code", b"m")),
    p.Submit("i1", "f1", {"priority": 3}, frames=(b"args", b"\x00" * 10)),
    p.Cancel("i1", "because", False),
    p.Cancel("i1", "", True, 0, 7),
    p.Result("i1", True, "", "", p.ResultMeta(duration=0.5, devices=["n:0"]), (b"value",)),
    p.Result("i2", False, "Timeout", "too slow"),
    p.Output("i1", "stdout", "hello\n"),
    p.StatusRequest(7), p.StatusReply(7, {"devices": []}),
    p.LoadCode("c1", "square", (b"code",)),
    p.Run("i1", "f1", "c1", "square", 1, p.RunMeta(timeout=3.0, models={"m": "k"}), (b"args",)),
    p.Heartbeat(["i1"], {"completed": 3}),
    p.WorkerExited("n:0", 123, -9, "killed"),
    p.WorkerExited("n:0", 124, -9, "killed", 3),
    p.KillWorker("n:0", 123, "timeout"),
    p.WorkerServing("n:0", 123, 2),
    p.LoadModel("llama", {"memory": 10}, (b"loader",)),
    p.EvictModel("llama", True),
    p.ModelEvent("llama", p.ModelState.RESIDENT, 1000, 0.5),
    p.ModelEvent("llama", p.ModelState.LOAD_FAILED, 0, 0.0, "OutOfMemory", "too big"),
    p.GroupOp(p.GroupOpKind.ABORT, {"gang_id": "g", "generation": 2, "reason": "rank 1 died"}),
    p.HelperRun("i1", "square", "c1", 2, 1, (b"code", b"args")),
    p.HelperRun("i1", "square", "c1", 1, 0, (b"args",)),
    p.HelperResult("i1", True, frames=(b"value",)),
    p.HelperResult("i1", False, "ValueError", "bad", "Traceback ...", (b"exc",)),
    p.Query(3, p.QueryKind.LOGS, {"target": "app.fn", "since": 600.0}),
    p.QueryReply(3, True, {"lines": []}), p.QueryReply(3, False, error="unknown query"),
    p.Drain(4, 30.0, "maintenance"),
    p.UserCommand(5, p.UserCommandKind.CREATE, {"name": "bob", "max_devices": 2}),
    p.Deploy(3, "app", {"code_hash": "h", "tag": "t"},
             [{"name": "f", "code_id": "c1", "spec": {"count": 1}, "models": [], "ncode": 1}],
             (b"code",)),
    p.Lookup(4, "app", "f", 2),
    p.AppCommand(5, "rollback", {"app": "app", "version": 1}),
    p.AppReply(5, False, "NotFound", "no app", {}),
    p.AppReply(6, True, data={"app": "app", "version": 2}),
    p.Item("i1", 3, 0, frames=(b"value",)), p.Credit("i1", 0, 32), p.Attach("i1"), p.Resend("i1", 7),
    p.LeaseGrant("lease:1", "f1", "tcp://127.0.0.1:5000?key=abc", "s3cret", 1.0, 100, 2),
    p.DirectRun("lease:1", "s3cret", "i1", frames=(b"args",)),
    p.LeaseRefused("lease:1", ["i1", "i2"], "the lease ended"),
    p.LeaseReport("lease:1", [{"id": "i1", "ok": True, "s": 0.01}]),
    p.LeaseOverrun("lease:1", "i1", "f call i1 ran longer than its timeout of 1s", 11.5),
    p.Shutdown("restarting", final=False),
    p.Result("i3", False, "", "raised", p.ResultMeta(items=3, first_item_s=0.1, items_per_s=30.0,
                                                     retryable=True), (b"exc",)),
    p.Run("i1", "f1", "c1", "f", 2, p.RunMeta(retry_on=["builtins.ConnectionError"]), (b"args",)),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(p.message_types().values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: p.Message) -> None:
    frames = p.encode(msg)
    assert len(frames[0]) == 1
    back = p.decode(frames)
    assert type(back) is type(msg)
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        a, b = getattr(msg, f.name), getattr(back, f.name)
        if f.name == "frames":
            assert [bytes(x) for x in a] == [bytes(x) for x in b]
        else:
            assert a == b, f.name


def test_payload_frames_stay_out_of_the_header() -> None:
    big = b"x" * 1_000_000
    frames = p.encode(p.Submit("i", "f", {}, frames=(big,)))
    assert len(frames[1]) < 100  # header stays small
    assert frames[2] is big  # the buffer itself, no copy


def test_messages_are_frozen_and_slotted() -> None:
    msg = p.Ping(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.seq = 2  # type: ignore[misc]
    assert not hasattr(msg, "__dict__")


@pytest.mark.parametrize(
    "frames",
    [[b"\x01"], [b"\xfe", b"\x90"], [b"ab", b"\x90"], [b"\x03", msgpack.packb(["not-an-int", 1, 2])]],
)
def test_garbage_is_a_decode_error(frames: list[bytes]) -> None:
    with pytest.raises(p.DecodeError):
        p.decode(frames)


def test_batches_round_trip_in_order() -> None:
    msgs = [p.Ping(1), p.Submit("i", "f", {}, frames=(b"a", b"b")), p.Output("i", "stdout", "x"), p.Ping(2)]
    frames = p.encode_batch(msgs)
    assert frames[0] == p.PACKED_TAG and len(frames) == 2  # small: packed into one frame
    back = p.decode_all(frames)
    assert [type(m) for m in back] == [type(m) for m in msgs]
    assert back[1].frames == (b"a", b"b") and back[3].seq == 2  # type: ignore[attr-defined]
    assert p.decode_all(p.encode_batch([p.Ping(7)])) == [p.Ping(7)]
    with pytest.raises(p.DecodeError):
        p.decode_all([p.BATCH_TAG, msgpack.packb([5]), b"\x03"])


def test_a_batch_packs_frames_up_to_16_kib_and_1_mib_in_all() -> None:
    def submit(i: int, n: int) -> list[object]:
        return p.encode(p.Submit(str(i), "f", {}, frames=(b"x" * n,)))

    assert p.batch_frames([submit(0, 16 * 1024), submit(1, 1)])[0] == p.PACKED_TAG
    assert p.batch_frames([submit(0, 16 * 1024 + 1), submit(1, 1)])[0] == p.BATCH_TAG
    parts = [submit(i, 16 * 1024) for i in range(64)]  # exactly 1 MiB of payload frames
    overhead = sum(len(f) for fs in parts for f in fs) - 1024 * 1024
    parts[0] = submit(0, 16 * 1024 - overhead)  # all frames: exactly 1 MiB
    assert sum(len(f) for fs in parts for f in fs) == 1024 * 1024
    assert p.batch_frames(parts)[0] == p.PACKED_TAG
    parts[0] = submit(0, 16 * 1024 - overhead + 1)
    assert p.batch_frames(parts)[0] == p.BATCH_TAG


def test_a_single_message_is_no_batch() -> None:
    frames = p.encode(p.Ping(3))
    assert p.batch_frames([frames]) is frames and p.encode_batch([p.Ping(3)]) == frames


def test_a_buffer_is_measured_in_bytes_not_items() -> None:
    import array

    ints = memoryview(array.array("i", range(5000)))  # 5,000 items, 20,000 bytes
    frames = p.batch_frames([p.encode(p.Ping(1)), [*p.encode(p.Submit("i", "f", {})), ints]])
    assert frames[0] == p.BATCH_TAG and frames[-1] is ints


def test_a_batch_header_that_is_not_a_list_of_counts_is_a_decode_error() -> None:
    for header in ({"not": "a list"}, ["x"], [0]):
        with pytest.raises(p.DecodeError):
            p.decode_all([p.BATCH_TAG, msgpack.packb(header), b"\x03", b"\x90"])


def test_a_batch_with_a_big_frame_keeps_its_frames_apart() -> None:
    big = b"x" * (codec.PACK_FRAME_MAX + 1)
    msgs = [p.Ping(1), p.Submit("i", "f", {}, frames=(big,))]
    frames = p.encode_batch(msgs)
    assert frames[0] == p.BATCH_TAG and frames[-1] is big  # zero-copy, not packed
    assert p.decode_all(frames)[1].frames[0] == big  # type: ignore[attr-defined]
    edge = p.encode_batch([p.Ping(1), p.Submit("i", "f", {}, frames=(big[:-1],))])
    assert edge[0] == p.PACKED_TAG  # a frame of exactly PACK_FRAME_MAX is packed
    many = codec.PACK_MAX // codec.PACK_FRAME_MAX
    over = [p.Submit(str(i), "f", {}, frames=(big[:-1],)) for i in range(many + 1)]
    assert p.encode_batch(over)[0] == p.BATCH_TAG  # over PACK_MAX in all: apart
    assert p.encode_batch(over[:many - 1])[0] == p.PACKED_TAG


def test_a_packed_batch_takes_any_small_buffer_as_bytes() -> None:
    import zmq

    parts = [p.encode(p.Ping(1)),
             [*p.encode(p.Submit("i", "f", {})), memoryview(b"mv"), bytearray(b"ba"),
              zmq.Frame(b"zf")]]
    frames = p.batch_frames(parts)
    assert frames[0] == p.PACKED_TAG
    back = p.decode_all(frames)
    assert back[1].frames == (b"mv", b"ba", b"zf")  # type: ignore[attr-defined]


@pytest.mark.parametrize("packed", [
    b"\xc1",  # not msgpack
    msgpack.packb({"not": "a list"}),
    msgpack.packb([b"not a list of frames"]),
    msgpack.packb([[b"\x01"]]),  # one frame: no header
    msgpack.packb([["\x01", b"\x90"]]),  # a str, not bytes
    msgpack.packb([[b"\x01", b"\x90"]]) + b"\x00",  # trailing bytes
])
def test_a_bad_packed_batch_is_a_decode_error(packed: bytes) -> None:
    with pytest.raises(p.DecodeError):
        p.decode_all([p.PACKED_TAG, packed])


def test_states_are_enums_that_travel_as_strings() -> None:
    back = p.decode(p.encode(p.ModelEvent("m", p.ModelState.OFFLOADED, 1, 0.1)))
    assert isinstance(back, p.ModelEvent) and back.state is p.ModelState.OFFLOADED
    assert back.state == "offloaded"  # a str on the wire and for old readers
    assert msgpack.unpackb(p.encode(p.GroupOp(p.GroupOpKind.ABORT, {}))[1]) == ["abort", {}]
    with pytest.raises(p.DecodeError):
        p.decode([p.encode(p.Ping(1))[0][:0] + bytes([27]), msgpack.packb(["m", "melted", 1, 0.0])])


_WRONG = [{"bad": 1}, [1], "s", 1.5, None, b"b"]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_field_of_the_wrong_type_is_refused(msg: p.Message) -> None:
    """A header with all its fields present (the compiled fast path) but one of the wrong
    type never decodes: no handler sees a number where it expects a string."""
    frames = p.encode(msg)
    header = msgpack.unpackb(frames[1])
    checks = codec._checks(type(msg))
    assert len(header) == len(checks)
    for i, (name, kinds) in enumerate(checks):
        if kinds is None:
            continue
        wrong = next(w for w in _WRONG if not isinstance(w, kinds))
        bad = [*header[:i], wrong, *header[i + 1:]]
        with pytest.raises(p.DecodeError, match=name):
            p.decode([frames[0], msgpack.packb(bad), *frames[2:]])


@pytest.mark.parametrize("msg, why", [
    (p.Query(1, p.QueryKind.LOGS, {"target": "f", "limt": 5}), "takes no argument 'limt'"),
    (p.Query(1, p.QueryKind.USAGE, {"since": "an hour"}), "argument 'since' of 'usage' is a str"),
    (p.AppCommand(1, "rollback", {"app": "a", "version": "2"}), "argument 'version'"),
    (p.AppCommand(1, "list", {"app": "a"}), "'list' takes no argument 'app' (it takes none)"),
    (p.UserCommand(1, "create", {"name": "bob", "max_devices": 1.5}), "argument 'max_devices'"),
    (p.UserCommand(1, "revoke", {"name": "bob", "operator": True}), "takes no argument 'operator'"),
])
def test_the_arguments_of_a_kind_are_typed_on_decode(msg: p.Message, why: str) -> None:
    with pytest.raises(p.DecodeError, match=re.escape(why)):
        p.decode(p.encode(msg))


def test_well_typed_arguments_and_unknown_kinds_pass_decode() -> None:
    for msg in (p.Query(1, p.QueryKind.LOGS, {"target": "f", "since": 60, "after": 3}),
                p.UserCommand(1, "update", {"name": "bob", "max_devices": None}),
                p.AppCommand(1, "rollback", {"app": "a", "version": None, "who": "me"}),
                p.AppCommand(1, "frobnicate", {"anything": 1})):  # its handler answers it
        assert p.decode(p.encode(msg)) == msg


def test_a_tag_is_taken_once_and_within_1_to_254() -> None:
    """0 and 255 open batches (a message under either would be read as a batch)."""
    @dataclasses.dataclass(frozen=True, slots=True)
    class Probe(p.Message):
        n: int

    for tag in (0, 255, 256, -1):
        with pytest.raises(ValueError, match=f"tag {tag} is taken or out of range"):
            codec.message(tag)(Probe)
    taken = codec._TAG_OF[p.Ping][0]
    with pytest.raises(ValueError, match="is taken"):
        codec.message(taken)(Probe)
    assert Probe not in codec._TAG_OF
    assert 254 not in codec._BY_TAG
    try:
        codec.message(254)(Probe)  # the last free tag
        assert p.decode(p.encode(Probe(5))) == Probe(5)
    finally:
        for book in (codec._BY_TAG, codec._TAG_OF, codec._GETTER, codec._HAS_FRAMES):
            book.pop(254 if book is codec._BY_TAG else Probe, None)  # type: ignore[call-overload]


def test_bytes_in_a_header_stay_bytes() -> None:
    """msgpack's bin type: a str would come back for bytes (or fail on non-UTF-8)."""
    reply = p.StatusReply(7, {"blob": b"\xff\x00", "text": "t"})
    assert p.decode(p.encode(reply)) == reply


def test_a_one_frame_message_is_refused_as_too_short() -> None:
    with pytest.raises(p.DecodeError, match="at least 2 frames, got 1"):
        p.decode(p.encode(p.Ping(1))[:1])


def test_fields_of_any_type_or_of_a_tuple_are_not_checked() -> None:
    from typing import Any, TypeVar

    assert codec._wire_types(Any) is None and codec._wire_types(tuple) is None
    assert codec._wire_types(TypeVar("T")) is None
    assert codec._wire_types(int | Any) is None
    assert codec._wire_types(float) == (int, float) and codec._wire_types(bool) == (bool, int)


def test_a_shorter_header_takes_defaults_and_a_longer_one_is_refused() -> None:
    full = p.encode(p.WorkerExited("n:0", 124, -9, "killed", 3))
    header = msgpack.unpackb(full[1])
    back = p.decode([full[0], msgpack.packb(header[:-3])])
    assert back == p.WorkerExited("n:0", 124, -9, "killed")  # fields added since: defaults
    with pytest.raises(p.DecodeError, match=r"8 fields, at most 7 expected"):
        p.decode([full[0], msgpack.packb([*header, 1])])
    query = p.encode(p.Query(3, p.QueryKind.LOGS, {"target": "f"}))
    short = msgpack.unpackb(query[1])[:2]  # no args field: its kind's check has nothing to see
    assert p.decode([query[0], msgpack.packb(short)]) == p.Query(3, p.QueryKind.LOGS)


def test_a_well_typed_full_header_never_takes_the_slow_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled check passes every sample's header by itself (a float in an int-or-float
    field, an int in a bool-or-int one): the slow path is for refusals and short headers."""
    slow: list[str] = []

    def record(cls: type, values: object) -> None:
        slow.append(cls.__name__)

    monkeypatch.setattr(codec, "_CHECKERS", {})
    monkeypatch.setattr(codec, "_check_slowly", record)
    for msg in [*SAMPLES, p.Drain(4, 30, "x"), p.Drain(4, 30.5, "x")]:
        assert p.decode(p.encode(msg)) == msg
    assert slow == []


@pytest.mark.parametrize("frames, why", [
    ([p.BATCH_TAG], "at least 2 frames"),
    ([p.BATCH_TAG, msgpack.packb([1]), b"\x03"], "frame count"),
    ([p.BATCH_TAG, msgpack.packb([0])], "frame count"),
    ([p.BATCH_TAG, msgpack.packb([2.0]), b"\x03", b"\x90"], "frame count"),
    ([p.PACKED_TAG, msgpack.packb([[b"\x03"]])], "bad packed batch"),
])
def test_a_batch_of_messages_shorter_than_2_frames_is_refused_as_such(
        frames: list[bytes], why: str) -> None:
    with pytest.raises(p.DecodeError, match=why):
        p.decode_all(frames)


def test_an_empty_batch_holds_no_message() -> None:
    assert p.decode_all([p.BATCH_TAG, msgpack.packb([])]) == []
    ping = p.encode(p.Ping(5))
    assert p.decode_all([p.BATCH_TAG, msgpack.packb([2]), *ping]) == [p.Ping(5)]
