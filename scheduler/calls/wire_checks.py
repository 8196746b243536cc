"""What a peer sent that the codec's type checks cannot judge: a Register's spec and
models, a Submit's options. A bad value becomes `InvalidSpec` for that peer, never an
exception inside a handler."""

from __future__ import annotations

from typing import Any

from gpufn.exceptions import GpufnError, InvalidSpec
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec, make_spec

_MODEL_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,), "code_id": (str,), "nframes": (int,), "memory": (int, type(None)),
    "pin": (bool, int), "offload": (bool, int),
}


def register_spec(msg: p.Register) -> GpuSpec:
    """The function's spec, with its models checked against the frames sent."""
    if not all(isinstance(m, dict) for m in msg.models):
        raise InvalidSpec("each model must be described by a map")
    total = 0
    for m in msg.models:
        if not isinstance(m.get("name"), str):
            raise InvalidSpec("a model has no name")
        for key, kinds in _MODEL_FIELDS.items():
            if key in m and not isinstance(m[key], kinds):
                raise InvalidSpec(f"model {m['name']!r}: {key} has the wrong type")
        n = m.get("nframes", 0)
        if isinstance(n, bool) or n < 0:
            raise InvalidSpec(f"model {m['name']!r}: nframes must be a count")
        total += n
    if total > len(msg.frames):
        raise InvalidSpec(f"the models claim {total} frames, {len(msg.frames)} were sent")
    return _spec(lambda: make_spec(GpuSpec.from_wire(msg.spec)))


def submit_spec(base: GpuSpec, options: dict[str, Any]) -> GpuSpec:
    """A call's spec: the function's, with the call's options."""
    if not all(isinstance(k, str) for k in options):
        raise InvalidSpec("option names must be strings")
    return _spec(lambda: make_spec(base, **options))


def _spec(build: Any) -> GpuSpec:
    try:
        spec: GpuSpec = build()
    except GpufnError:
        raise
    except Exception as e:  # a value make_spec did not expect: the peer's mistake
        raise InvalidSpec(f"invalid spec: {type(e).__name__}: {e}") from None
    return spec
