"""Execution shapes: how one dispatched call occupies its devices.

Chosen once, at dispatch, from the spec. The shape answers which devices run a
process, how many of them report a result, and what is freed when one reports, so the
rest of the scheduler never asks `if spmd` or `if batch`:

| shape    | runs a process on          | reports | a report frees            |
| -------- | -------------------------- | ------- | ------------------------- |
| SINGLE   | its one device             | 1       | that device               |
| BATCH    | its one device (a carrier) | 1       | that device               |
| GANG     | every device, one rank each| N       | the reporting rank's device |
| HELD_SET | the first device only; the others are held idle (spmd=False) | 1 | every device |

A GANG needs the rendezvous store (its ranks form a process group); a HELD_SET's devices
must all be on one node (one process sees them all).
"""

from __future__ import annotations

from enum import Enum

from gpufn.wire.spec import GpuSpec


class Shape(Enum):
    SINGLE = "single"
    BATCH = "batch"
    GANG = "gang"
    HELD_SET = "held_set"

    @staticmethod
    def of(spec: GpuSpec) -> Shape:
        if spec.count > 1:
            return Shape.GANG if spec.spmd else Shape.HELD_SET
        return Shape.BATCH if spec.batch_size is not None else Shape.SINGLE

    @property
    def multi_device(self) -> bool:
        return self in (Shape.GANG, Shape.HELD_SET)

    @property
    def needs_rendezvous(self) -> bool:
        return self is Shape.GANG

    @property
    def one_node(self) -> bool:
        """All its devices must be on one node."""
        return self is Shape.HELD_SET

    def runners(self, devices: tuple[str, ...]) -> tuple[str, ...]:
        """The devices whose worker runs (and may be told to stop) a process of the call."""
        return devices[:1] if self is Shape.HELD_SET else devices

    def reporters(self, devices: tuple[str, ...]) -> int:
        return len(self.runners(devices))

    def frees_on_report(self, devices: tuple[str, ...], reporter: str) -> tuple[str, ...]:
        """Devices freed when `reporter`'s process ends (its result, or its loss)."""
        if self is Shape.HELD_SET:
            return devices if devices and reporter == devices[0] else (reporter,)
        return (reporter,)
