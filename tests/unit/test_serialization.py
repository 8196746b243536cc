from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gpufn.exceptions import RemoteError, RemoteTraceback, SerializationError
from gpufn.wire import serialization as ser


def test_large_buffers_travel_out_of_band() -> None:
    t = torch.arange(1_000_000, dtype=torch.float32)
    a = np.ones((512, 512))
    frames = ser.dumps(((t,), {"a": a, "b": bytearray(200_000)}))
    assert len(frames) == 4  # stream + tensor + array + bytearray
    assert len(frames[0]) < 10_000  # the pickle stream holds no bulk data
    (bt,), back = ser.loads([bytes(f) for f in frames])
    assert torch.equal(bt, t) and np.array_equal(back["a"], a) and back["b"] == bytearray(200_000)


def test_small_values_stay_in_band() -> None:
    assert len(ser.dumps((1, "two", [3.0]))) == 1


def test_unpicklable_argument_is_named() -> None:
    with pytest.raises(SerializationError, match=r"keyword argument 'lock' \(lock\)"):
        ser.dump_args("f", (1, 2), {"lock": threading.Lock()})
    with pytest.raises(SerializationError, match="positional argument 1"):
        ser.dump_args("f", (1, threading.Lock()), {})


def test_exception_round_trip_keeps_type_and_traceback() -> None:
    try:
        raise KeyError("missing")
    except KeyError as e:
        frames, tb = ser.dump_exception(e)
    exc = ser.load_exception(frames, "KeyError", "'missing'", tb, "remote:")
    assert isinstance(exc, KeyError)
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "raise KeyError" in str(exc.__cause__)


class _Unrebuildable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickles, but cannot be rebuilt from args
        super().__init__(f"{a}/{b}")


def test_exception_that_cannot_be_rebuilt_becomes_remote_error() -> None:
    try:
        raise _Unrebuildable(1, 2)
    except _Unrebuildable as e:
        frames, tb = ser.dump_exception(e)
    exc = ser.load_exception(frames, "_Unrebuildable", "1/2", tb, "remote:")
    assert isinstance(exc, RemoteError)
    assert exc.type_name == "_Unrebuildable" and "1/2" in exc.message and "_Unrebuildable" in exc.traceback


def test_exception_of_unknown_module_becomes_remote_error() -> None:
    exc = ser.load_exception([b"\x80\x05garbage"], "mylib.Boom", "boom", "Traceback...", "remote:")
    assert isinstance(exc, RemoteError) and exc.type_name == "mylib.Boom" and exc.message == "boom"


def test_content_hash_is_stable() -> None:
    assert ser.content_hash(b"a", b"b") == ser.content_hash(b"a", b"b") != ser.content_hash(b"ab")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_tensor_dtypes_and_shapes_survive_out_of_band(dtype: torch.dtype) -> None:
    t = (torch.arange(400_000) % 7).to(dtype).reshape(800, 500)[:, ::2]  # non-contiguous view
    frames = ser.dumps(t)
    assert len(frames) == 2
    back = ser.loads([bytearray(f) for f in frames])
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_bytes_travel_out_of_band() -> None:
    data = bytes(range(256)) * 1024
    frames = ser.dumps({"b": data, "ba": bytearray(data)})
    assert len(frames) == 3
    back = ser.loads(frames)
    assert back["b"] == data and isinstance(back["ba"], bytearray)


def test_a_large_non_contiguous_array_travels_out_of_band_as_a_contiguous_copy() -> None:
    a = np.arange(1024 * 1024, dtype=np.float64).reshape(1024, 1024)[:, ::2]  # 4 MiB viewed
    frames = ser.dumps({"a": a, "small": a[:2, :2]})
    assert len(frames) == 2 and len(frames[0]) < 1_000  # the bytes are not in the stream
    back = ser.loads([bytes(f) for f in frames])
    assert np.array_equal(back["a"], a) and np.array_equal(back["small"], a[:2, :2])
