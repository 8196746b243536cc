"""Whether a submitted call is accepted: feasibility against the registered devices
(cached per function), the gang rendezvous store, and the queue limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufn.exceptions import GpufnError, QueueFull, Unschedulable
from gpufn.scheduler.books.model_book import ModelBook
from gpufn.scheduler.books.queues import ReadyQueue
from gpufn.scheduler.nouns.records import Device, FunctionRecord
from gpufn.scheduler.nouns.settings import SchedulerConfig
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.placement.device_fit import feasibility_error
from gpufn.wire.spec import GpuSpec


@dataclass
class Intake:
    config: SchedulerConfig
    devices: dict[str, Device]
    queue: ReadyQueue
    models: ModelBook
    rendezvous_error: str = ""
    _feasible: dict[str, str | None] = field(default_factory=dict)

    def invalidate(self) -> None:
        """Devices or model sizes changed: feasibility must be checked again."""
        self._feasible.clear()

    def refusal(self, fn: FunctionRecord, spec: GpuSpec, per_call: bool) -> GpufnError | None:
        """Why this call is not accepted (Unschedulable, QueueFull), or None."""
        err = self._feasibility(fn, spec, per_call)
        if err is None and self.rendezvous_error and Shape.of(spec).needs_rendezvous:
            err = f"{fn.name}: the gang rendezvous store could not start ({self.rendezvous_error})"
        if err is not None:
            return Unschedulable(err)
        full = self._queue_full(fn)
        return QueueFull(full) if full is not None else None

    def no_rendezvous(self, name: str) -> str:
        return (f"{name} needs a process group, but the scheduler could not start its "
                f"rendezvous store ({self.rendezvous_error}). Check that torch is installed "
                "where the scheduler runs, then restart it")

    def _feasibility(self, fn: FunctionRecord, spec: GpuSpec, per_call: bool) -> str | None:
        if per_call or fn.function_id not in self._feasible:
            err = (feasibility_error(spec, fn.name, self.devices.values(), self.models.model_bytes(fn))
                   or self.models.never_fits(fn, spec.memory, self.devices.values()))
            if per_call:
                return err
            self._feasible[fn.function_id] = err
        return self._feasible[fn.function_id]

    def _queue_full(self, fn: FunctionRecord) -> str | None:
        cfg = self.config
        if len(self.queue) >= cfg.max_queue:
            return (f"the scheduler's queue holds {len(self.queue)} calls, its limit "
                    f"(GPUFN_MAX_QUEUE={cfg.max_queue}); {fn.name} was not accepted. Retry "
                    "later, slow down, or raise the limit")
        per_fn = cfg.max_queue_per_function
        depth = self.queue.depth(fn.function_id)
        if per_fn is not None and depth >= per_fn:
            return (f"{fn.name} already has {depth} queued calls, its limit "
                    f"(GPUFN_MAX_QUEUE_PER_FUNCTION={per_fn}); this call was not accepted. "
                    "Retry later, slow down, or raise the limit")
        return None
