"""`@gpu(autocast=..., device_args=True)`: validated up front, applied around the function."""

from __future__ import annotations

import pytest
import torch

import gpufn
from gpufn.runtime import context as call_context
from gpufn.runtime.call_options import WithCallOptions, to_device, wrap
from gpufn.wire import serialization as ser


def test_options_are_validated() -> None:
    with pytest.raises(gpufn.InvalidSpec, match="autocast='bf17'"):
        gpufn.gpu(autocast="bf17")
    with pytest.raises(gpufn.InvalidSpec, match="device_args"):
        gpufn.gpu(device_args="yes")  # type: ignore[arg-type]
    with pytest.raises(gpufn.InvalidSpec, match="cache"):
        gpufn.gpu(cache=3)  # type: ignore[arg-type]


def _dtype_of_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    return (a @ b).dtype


def test_the_wrapper_runs_under_autocast_and_survives_pickling() -> None:
    assert wrap(_dtype_of_matmul, "", False) is _dtype_of_matmul
    wrapped = wrap(_dtype_of_matmul, "bf16", True)
    assert isinstance(wrapped, WithCallOptions)
    _, frames = ser.dump_code(wrapped, "f")
    remote = ser.load_code(frames)
    call_context._set(call_context.CallContext("inv", "f", device=torch.device("cpu")))
    try:
        assert remote(torch.ones(2, 2), torch.ones(2, 2)) == torch.bfloat16
    finally:
        call_context._set(None)
    assert _dtype_of_matmul(torch.ones(2, 2), torch.ones(2, 2)) == torch.float32


def test_to_device_moves_nested_tensors() -> None:
    meta = torch.device("meta")
    out = to_device(([torch.ones(1)], {"x": torch.ones(1), "n": 3}), meta)
    assert out[0][0].device == meta and out[1]["x"].device == meta and out[1]["n"] == 3


def test_with_options_changing_autocast_pickles_other_code() -> None:
    f = gpufn.gpu(_dtype_of_matmul)
    g = f.with_options(autocast="fp16")
    assert g.spec.autocast == "fp16" and g._code is not f._code
    assert f.with_options(priority=3)._code is f._code
