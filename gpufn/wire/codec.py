"""The codec under every wire message: how a message class is registered (a one-byte tag,
`@message`; header records, `@struct`), `encode`/`decode` (the only msgpack calls), the
field checks that refuse a header of the wrong types, typed argument records for the
kind-plus-arguments channels, and batch framing. The messages themselves are in
`protocol`.
"""

from __future__ import annotations

import operator
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import fields
from enum import Enum
from typing import Any, TypeVar, Union

import msgpack

Frame = Any  # bytes | memoryview | zmq.Frame: whatever zmq can send without a copy


class DecodeError(ValueError):
    """A frame list that is not a gpufn message (wrong tag, bad header)."""


_BY_TAG: dict[int, type[Message]] = {}
_TAG_OF: dict[type[Message], bytes] = {}
_GETTER: dict[type[Message], Callable[[Any], tuple[Any, ...]]] = {}
_HAS_FRAMES: dict[type[Message], bool] = {}

M = TypeVar("M", bound="type[Message]")


class Message:
    """Base of every wire message (frozen, slotted dataclasses registered with a tag)."""

    __slots__ = ()


_STRUCT_FIELDS: dict[type[Message], tuple[tuple[int, type[Any]], ...]] = {}
# kind-plus-arguments messages: (index of `kind`, index of `args`, kind -> argument record)
_ARGS: dict[type[Message], tuple[int, int, dict[str, type[Any]]]] = {}

S = TypeVar("S")


def struct(cls: type[S]) -> type[S]:
    """A typed record carried inside a message header (a dataclass): it travels as the
    list of its field values in order, and is rebuilt on decode."""
    getter = operator.attrgetter(*[f.name for f in fields(cls)])  # type: ignore[arg-type]
    cls.to_wire = lambda self: list(getter(self))  # type: ignore[attr-defined]
    cls.from_wire = classmethod(lambda c, v: c(*v))  # type: ignore[attr-defined]
    return cls


def message(tag: int, structs: dict[str, type[Any]] | None = None,
            args: tuple[str, dict[str, type[Any]]] | None = None) -> Callable[[M], M]:
    """Register a message class under a one-byte tag; `structs` names its header fields
    that hold a `@struct` record. `args` (the kind's field, kind -> argument record) makes
    a kind-plus-arguments message typed: its `args` dict may hold only the fields of its
    kind's record, each of its type (checked on decode like every other field)."""

    def register(cls: M) -> M:
        # 0 and 255 open batches (BATCH_TAG, PACKED_TAG): a message under either would be
        # read as one
        if tag in _BY_TAG or not 0 < tag < 255:
            raise ValueError(f"tag {tag} is taken or out of range (1 to 254)")
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        has_frames = bool(names) and names[-1] == "frames"
        header_names = names[:-1] if has_frames else names
        getter: Callable[[Any], tuple[Any, ...]]
        if not header_names:
            getter = lambda m: ()  # noqa: E731
        elif len(header_names) == 1:
            single = operator.attrgetter(header_names[0])
            getter = lambda m: (single(m),)  # noqa: E731
        else:
            getter = operator.attrgetter(*header_names)
        if structs:
            at = tuple((header_names.index(name), kind) for name, kind in structs.items())
            plain = getter

            def getter(m: Any) -> tuple[Any, ...]:
                values = list(plain(m))
                for i, _ in at:
                    values[i] = values[i].to_wire()
                return tuple(values)

            _STRUCT_FIELDS[cls] = at
        if args:
            _ARGS[cls] = (header_names.index(args[0]), header_names.index("args"), args[1])
        _BY_TAG[tag] = cls
        _TAG_OF[cls] = bytes([tag])
        _GETTER[cls] = getter
        _HAS_FRAMES[cls] = has_frames
        return cls

    return register


def encode(msg: Message) -> list[Frame]:
    """Frames for `msg`: [tag, header, *payload frames]."""
    cls = type(msg)
    header = msgpack.packb(_GETTER[cls](msg), use_bin_type=True)
    if _HAS_FRAMES[cls]:
        return [_TAG_OF[cls], header, *msg.frames]  # type: ignore[attr-defined]
    return [_TAG_OF[cls], header]


def as_bytes(frame: Frame) -> bytes:
    """A frame's bytes: bytes as they are, a zmq Frame's, or a copy of a buffer."""
    return frame if isinstance(frame, bytes) else frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def decode(frames: Sequence[Frame]) -> Message:
    """The message held by frames produced by `encode` (payload frames kept as they came)."""
    if len(frames) < 2:
        raise DecodeError(f"a gpufn message has at least 2 frames, got {len(frames)}")
    tag = as_bytes(frames[0])
    cls = _BY_TAG.get(tag[0]) if len(tag) == 1 else None
    if cls is None:
        raise DecodeError(f"unknown message tag {tag!r}: is the peer running another gpufn version?")
    try:
        values = msgpack.unpackb(as_bytes(frames[1]), raw=False, use_list=True)
        _check_fields(cls, values)
        for i, kind in _STRUCT_FIELDS.get(cls, ()):
            _check_fields(kind, values[i])
            values[i] = kind.from_wire(values[i])
        if cls in _ARGS:
            _check_args(cls, values)
        if _HAS_FRAMES[cls]:
            # by name: a shorter header (fields added since) leaves them at their defaults
            return cls(*values, frames=tuple(frames[2:]))  # type: ignore[call-arg]
        return cls(*values)
    except Exception as e:  # whatever a malformed header raises, it is the peer's fault
        raise DecodeError(f"bad header for {cls.__name__}: {e}") from e


# A field's checks: (name, the Python types msgpack may decode it to, or None for any).
_CHECKS: dict[type[Any], tuple[tuple[str, tuple[type, ...] | None], ...]] = {}


def _wire_types(hint: Any) -> tuple[type, ...] | None:
    """The types a header field with this annotation may arrive as (None: anything)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        out: list[type] = []
        for arg in typing.get_args(hint):
            t = _wire_types(arg)
            if t is None:
                return None
            out += t
        return tuple(out)
    if origin is not None:
        hint = origin  # dict[str, Any] -> dict, list[str] -> list
    if hint is float:
        return (int, float)
    if hint is bool:
        return (bool, int)
    if hint in (Any, tuple) or not isinstance(hint, type):
        return None
    if issubclass(hint, Enum):
        return (str,)  # a str enum travels as its value; the message converts it
    if hasattr(hint, "from_wire"):
        return (list,)  # a @struct record travels as the list of its fields
    return (hint,)


def _checks(cls: type[Any]) -> tuple[tuple[str, tuple[type, ...] | None], ...]:
    checks = _CHECKS.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = _CHECKS[cls] = tuple(
            (f.name, _wire_types(hints.get(f.name, Any))) for f in fields(cls)
            if f.name != "frames")
    return checks


def _check_fields(cls: type[Any], values: Any) -> None:
    """Refuse a header whose values do not have the field types of `cls` (a peer may
    send anything; a handler must never see a number where it expects a string)."""
    check = _CHECKERS.get(cls)
    if check is None:
        check = _CHECKERS[cls] = _compile_check(cls)
    check(values)


def _check_slowly(cls: type[Any], values: Any) -> None:
    if type(values) is not list:
        raise TypeError(f"the header must be a list of fields, got {type(values).__name__}")
    checks = _checks(cls)
    if len(values) > len(checks):
        raise TypeError(f"{len(values)} fields, at most {len(checks)} expected")
    for value, (name, kinds) in zip(values, checks[: len(values)], strict=True):
        if kinds is not None and not isinstance(value, kinds):
            raise TypeError(f"field {name!r} is a {type(value).__name__}, expected "
                            + " or ".join(k.__name__ for k in kinds))


def _check_args(cls: type[Any], values: list[Any]) -> None:
    """The arguments of a kind-plus-arguments message against its kind's record: only
    its fields, each of its type. An unknown kind passes (its handler answers it)."""
    at_kind, at_args, records = _ARGS[cls]
    if len(values) <= at_args:
        return
    record = records.get(values[at_kind])
    if record is None:
        return
    known = dict(_checks(record))
    for name, value in values[at_args].items():
        if name not in known:
            raise TypeError(f"{values[at_kind]!r} takes no argument {name!r} "
                            f"(it takes {', '.join(sorted(known)) or 'none'})")
        kinds = known[name]
        if kinds is not None and not isinstance(value, kinds):
            raise TypeError(f"argument {name!r} of {values[at_kind]!r} is a "
                            f"{type(value).__name__}, expected "
                            + " or ".join(k.__name__ for k in kinds))


# A checker per message class, compiled once from its field types: a header with every
# field present (what `encode` sends) is checked by one expression; anything else, and
# every refusal, goes the slow way, which also says what is wrong.
_CHECKERS: dict[type[Any], Callable[[Any], None]] = {}


def _compile_check(cls: type[Any]) -> Callable[[Any], None]:
    checks = _checks(cls)
    env: dict[str, Any] = {"slow": _check_slowly, "cls": cls, "list": list}
    names = [f"v{i}" for i in range(len(checks))]
    tests = []
    for i, (_, kinds) in enumerate(checks):
        if kinds is not None:
            env[f"k{i}"] = kinds[0] if len(kinds) == 1 else kinds
            tests.append(f"isinstance(v{i}, k{i})")
    if not checks:
        body = "    if type(values) is not list or values:\n        slow(cls, values)\n"
    else:
        body = (f"    if type(values) is not list or len(values) != {len(checks)}:\n"
                "        slow(cls, values)\n        return\n"
                f"    {', '.join(names)}, = values\n")
        if tests:
            body += f"    if not ({' and '.join(tests)}):\n        slow(cls, values)\n"
    exec(f"def check(values):\n{body}", env)  # built from our own field types, never input
    check: Callable[[Any], None] = env["check"]
    return check


BATCH_TAG = b"\x00"
# A batch of small messages packed into one frame: [0xff, msgpack([[frames of msg 1],
# [frames of msg 2], ...])]. Two socket operations a batch instead of one per frame (a
# leased .map's batch of 64 calls was ~190 frames: a send, and a recv and a zmq.Frame at
# the other end, each); a batch with a large or non-bytes frame keeps the frames apart.
PACKED_TAG = b"\xff"
PACK_FRAME_MAX = 16 * 1024  # the largest frame packed (bigger ones go zero-copy or alone)
PACK_MAX = 1024 * 1024  # the most bytes packed into one frame


def encode_batch(msgs: Sequence[Message]) -> list[Frame]:
    """Several messages for one peer as one multipart message (one socket operation):
    packed into one frame when all are small, else [0x00, msgpack([frames of msg 1,
    frames of msg 2, ...]), *all frames]."""
    if len(msgs) == 1:
        return encode(msgs[0])
    return batch_frames([encode(m) for m in msgs])


def batch_frames(parts: Sequence[list[Frame]]) -> list[Frame]:
    """Already-encoded messages as one batch (a single message stays as it is)."""
    if len(parts) == 1:
        return parts[0]
    packed = _packed(parts)
    if packed is not None:
        return [PACKED_TAG, packed]
    return [BATCH_TAG, msgpack.packb([len(f) for f in parts]), *(f for fs in parts for f in fs)]


def _packed(parts: Sequence[list[Frame]]) -> bytes | None:
    """The messages packed into one frame, or None when one frame is too big for it."""
    total, other = 0, False
    for fs in parts:
        for f in fs:
            if type(f) is bytes:
                n = len(f)
            else:  # a memoryview, a zmq Frame: bytes of it (a copy, being small)
                n, other = (f.nbytes if isinstance(f, memoryview) else len(f)), True
            if n > PACK_FRAME_MAX:
                return None
            total += n
    if total > PACK_MAX:
        return None
    if other:
        parts = [[f if type(f) is bytes else as_bytes(f) for f in fs] for fs in parts]
    return msgpack.packb(parts)


def decode_all(frames: Sequence[Frame]) -> list[Message]:
    """The messages in `frames`: one, or every message of a batch."""
    if len(frames) == 2 and as_bytes(frames[0]) == PACKED_TAG:
        try:
            parts = msgpack.unpackb(as_bytes(frames[1]), use_list=True)
            if not isinstance(parts, list) or not all(
                    isinstance(fs, list) and len(fs) >= 2
                    and all(isinstance(f, bytes) for f in fs) for fs in parts):
                raise ValueError("it must list each message's frames as bytes")
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as e:
            raise DecodeError(f"bad packed batch: {e}") from e
        return [decode(fs) for fs in parts]
    if len(frames) >= 2 and as_bytes(frames[0]) == BATCH_TAG:
        try:
            counts = msgpack.unpackb(as_bytes(frames[1]))
            if not isinstance(counts, list) or not all(isinstance(n, int) and n >= 2 for n in counts):
                raise ValueError("the header must list each message's frame count (2 or more)")
        except (ValueError, TypeError, msgpack.ExtraData) as e:
            raise DecodeError(f"bad batch header: {e}") from e
        out, i = [], 2
        for n in counts:
            out.append(decode(frames[i:i + n]))
            i += n
        if i != len(frames):
            raise DecodeError(f"batch declares {i} frames, got {len(frames)}")
        return out
    return [decode(frames)]


def message_types() -> dict[int, type[Message]]:
    return dict(_BY_TAG)


