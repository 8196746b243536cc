"""Pipeline parallelism for inference: split a model's layer list into one stage per rank and run
micro-batches through them with `torch.distributed.pipelining` (PipelineStage + ScheduleGPipe)."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpufn.exceptions import InvalidSpec
from gpufn.parallel._mesh import module_device, resolve_mesh

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import ScheduleGPipe

__all__ = ["Pipeline", "pipeline_parallel"]

_MAX_CACHED_SHAPES = 8


def pipeline_parallel(
    module: nn.Module,
    stages: int | Sequence[str],
    microbatches: int = 1,
    *,
    mesh: DeviceMesh | None = None,
    example_input: torch.Tensor | None = None,
) -> Pipeline:
    """Split `module`'s layers into one pipeline stage per rank of `mesh` and return a `Pipeline`.

    Every rank calls this with the same model. The layer list is the model's longest
    `nn.ModuleList` (a transformer's `layers` / `h`) or, for a bare `nn.Sequential`, the model
    itself. `stages=N` splits it evenly into N stages (earlier stages take one extra layer when it
    does not divide); N must equal the mesh size. `stages=[...]` names the layers where stages
    2..N begin (torch's `SplitPoint.BEGINNING`), e.g. `["model.layers.2"]` or `["layers.2"]`
    (a qualified name or a unique dotted suffix of one).

    The model is changed in place: each rank keeps only its own layers (the others become
    pass-throughs); modules outside the layer list (embeddings, rotary tables, final norm, LM head)
    stay on every rank, and each stage runs the model's own forward, so positions and attention
    masks are computed as usual. Layers must take the hidden states as their first argument and
    return them as a tensor (transformers >= 5 decoder layers and nn.Sequential children do).

    `microbatches`: the batch (dim 0) is cut into this many micro-batches, which flow through the
    stages GPipe-style; the batch size must be a multiple of it. `mesh`: a 1-D `DeviceMesh`; by
    default the running gpufn call's, else one over torch.distributed's default group.
    `example_input`: when given, one batch is run through the pipeline now, so shape inference and
    the stage-to-stage connections are set up before the first real call.

    Inference only: the pipeline runs under `torch.no_grad()`.
    """
    mesh = resolve_mesh(module, mesh, what="pipeline_parallel")
    world = mesh.size()
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise InvalidSpec(f"pipeline_parallel(microbatches={microbatches!r}): pass a positive int")
    container_name, container, starts = _plan_stages(module, stages, world)
    stage_index = mesh.get_local_rank()
    end = starts[stage_index + 1] if stage_index + 1 < world else len(container)
    owned = range(starts[stage_index], end)
    first_layer, last_layer = container[owned.start], container[owned.stop - 1]
    for index in range(len(container)):
        if index not in owned:
            container[index] = _PassThrough(container[index])
    stage_module = _StageModule(
        module, first_layer, last_layer, is_first=stage_index == 0, is_last=stage_index == world - 1
    )
    pipe = Pipeline(
        stage_module,
        stage_index=stage_index,
        num_stages=world,
        microbatches=microbatches,
        group=mesh.get_group(),
        device=module_device(module),
        layers=(container_name, owned),
    )
    if example_input is not None:
        pipe.run(example_input)
    return pipe


class Pipeline:
    """One rank's stage of a pipelined model; call it on every rank with the same input.

    `pipe(x)` / `pipe.run(x)` returns the model's full output (for a Hugging Face model, its
    logits; for a tuple output, the first element) on every rank: the last stage computes it and
    broadcasts it to the others.
    """

    def __init__(
        self,
        stage_module: _StageModule,
        *,
        stage_index: int,
        num_stages: int,
        microbatches: int,
        group: ProcessGroup,
        device: torch.device,
        layers: tuple[str, range],
    ) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.group = group
        self.device = device
        self.layers = layers  # (qualified name of the layer list, indices this rank runs)
        self._module = stage_module
        # torch's stages infer tensor shapes on their first step and keep them: one per input shape.
        self._schedules: OrderedDict[tuple[Any, ...], _Compiled] = OrderedDict()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)

    def __repr__(self) -> str:
        name, owned = self.layers
        return (
            f"Pipeline(stage {self.stage_index}/{self.num_stages}, {name}[{owned.start}:{owned.stop}], "
            f"microbatches={self.microbatches})"
        )

    @torch.no_grad()
    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Run the batch `x` through every stage; every rank gets the full output."""
        import torch.distributed as dist

        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise InvalidSpec(f"Pipeline input must be a batched tensor, got {type(x).__name__}")
        if x.shape[0] % self.microbatches:
            raise InvalidSpec(
                f"Pipeline: batch size {x.shape[0]} is not a multiple of microbatches="
                f"{self.microbatches}: pad the batch or build the pipeline with a divisor of it"
            )
        x = x.to(self.device)
        compiled = self._compiled_for(x)
        # Stage 0 feeds the batch as the pipeline's input; later stages receive activations and
        # take the batch as a keyword for the model's own bookkeeping (positions, masks).
        out = compiled.schedule.step(x) if self.is_first else compiled.schedule.step(inputs=x)

        last = dist.get_global_rank(self.group, self.num_stages - 1)
        if compiled.out_meta is None:
            meta: list[Any] = [(tuple(out.shape), out.dtype) if self.is_last else None]
            dist.broadcast_object_list(meta, src=last, group=self.group, device=self.device)
            compiled.out_meta = meta[0]
        shape, dtype = compiled.out_meta
        result = out.contiguous() if self.is_last else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(result, src=last, group=self.group)
        return result

    def _compiled_for(self, x: torch.Tensor) -> _Compiled:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        key = (tuple(x.shape), x.dtype)
        compiled = self._schedules.get(key)
        if compiled is None:
            stage = PipelineStage(
                self._module, self.stage_index, self.num_stages, self.device, group=self.group
            )
            compiled = _Compiled(ScheduleGPipe(stage, n_microbatches=self.microbatches))
            self._schedules[key] = compiled
            if len(self._schedules) > _MAX_CACHED_SHAPES:
                self._schedules.popitem(last=False)
        else:
            self._schedules.move_to_end(key)
        return compiled


class _Compiled:
    """A schedule for one input shape, and the output's (shape, dtype) once known."""

    def __init__(self, schedule: ScheduleGPipe) -> None:
        self.schedule = schedule
        self.out_meta: tuple[tuple[int, ...], torch.dtype] | None = None


class _StageExit(Exception):
    """Raised by the last owned layer's hook to stop the model's forward after this stage."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _StageModule(nn.Module):
    """Runs the whole model's forward, but only this stage's layers: the received activation
    replaces the input of the first owned layer, and a non-last stage stops right after its
    last owned layer and hands that layer's output on."""

    def __init__(
        self, model: nn.Module, first_layer: nn.Module, last_layer: nn.Module, *, is_first: bool, is_last: bool
    ) -> None:
        super().__init__()
        self.model = model
        self.is_first = is_first
        self.is_last = is_last
        self._inject: torch.Tensor | None = None
        self._active = False
        params = inspect.signature(model.forward).parameters
        self._model_kwargs = {"use_cache": False} if "use_cache" in params else {}
        if not is_first:
            first_layer.register_forward_pre_hook(self._replace_input, with_kwargs=True)
        if not is_last:
            last_layer.register_forward_hook(self._exit)

    def forward(self, *received: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            (batch,) = received
        else:
            if inputs is None:
                raise InvalidSpec("Pipeline: every rank must call the pipeline with the same input")
            (self._inject,) = received
            batch = inputs
        self._active = True
        try:
            output = self.model(batch, **self._model_kwargs)
        except _StageExit as done:
            return done.hidden
        finally:
            self._active = False
            self._inject = None
        if not self.is_last:
            raise RuntimeError("pipeline stage: the model's forward never reached this stage's last layer")
        return _primary_output(output)

    def _replace_input(
        self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._active or self._inject is None:
            return None
        hidden, self._inject = self._inject, None
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _exit(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._active:
            raise _StageExit(output if isinstance(output, torch.Tensor) else output[0])


class _PassThrough(nn.Module):
    """Stands in for a layer another stage runs: returns the hidden states it is given. Keeps the
    replaced layer's plain attributes (`layer_idx`, `attention_type`, ...) that model code reads."""

    def __init__(self, replaced: nn.Module) -> None:
        super().__init__()
        for key, value in vars(replaced).items():
            if not key.startswith("_") and isinstance(value, (bool, int, float, str)):
                setattr(self, key, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))


def _primary_output(output: Any) -> torch.Tensor:
    """The tensor a model returns: a Hugging Face output's logits, a tuple's first element."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise InvalidSpec(
        f"Pipeline: the model returned {type(output).__name__}; it must return a tensor, a tuple "
        "starting with one, or an output with `logits`"
    )


def _find_layer_list(module: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential]:
    best: tuple[str, nn.ModuleList | nn.Sequential] | None = None
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and (best is None or len(sub) > len(best[1])):
            best = (name, sub)
    if best is None and isinstance(module, nn.Sequential):
        best = ("", module)
    if best is None or len(best[1]) == 0:
        raise InvalidSpec(
            f"pipeline_parallel: {type(module).__name__} has no layer list (nn.ModuleList) to "
            "split; wrap its layers in an nn.ModuleList or nn.Sequential"
        )
    return best


def _plan_stages(
    module: nn.Module, stages: int | Sequence[str], world: int
) -> tuple[str, nn.ModuleList | nn.Sequential, list[int]]:
    """(layer list name, layer list, index of each stage's first layer)."""
    if isinstance(stages, int) and not isinstance(stages, bool):
        if stages != world:
            raise InvalidSpec(
                f"pipeline_parallel(stages={stages}): one stage per rank, and the mesh has "
                f"{world} ranks: pass stages={world} or run with @gpu(count={stages})"
            )
        name, layers = _find_layer_list(module)
        if len(layers) < world:
            raise InvalidSpec(
                f"pipeline_parallel: {name or type(module).__name__} has {len(layers)} layers, "
                f"fewer than the {world} stages"
            )
        per, extra = divmod(len(layers), world)
        return name, layers, [k * per + min(k, extra) for k in range(world)]
    if isinstance(stages, str) or not isinstance(stages, Sequence):
        raise InvalidSpec(
            f"pipeline_parallel(stages={stages!r}): pass a stage count or a list of the layer "
            "names where stages 2..N begin"
        )
    if len(stages) != world - 1:
        raise InvalidSpec(
            f"pipeline_parallel: {len(stages)} split points make {len(stages) + 1} stages, but the "
            f"mesh has {world} ranks: pass {world - 1} split points"
        )
    modules = dict(module.named_modules())
    container: tuple[str, nn.ModuleList | nn.Sequential] | None = None
    starts = [0]
    for point in stages:
        hits = [n for n in modules if n == point or n.endswith("." + point)]
        if len(hits) != 1:
            raise InvalidSpec(
                f"pipeline_parallel: split point {point!r} matches {len(hits)} modules "
                f"({', '.join(hits[:4])}); name one layer, e.g. 'model.layers.2'"
            )
        parent_name, _, index = hits[0].rpartition(".")
        parent = modules[parent_name]
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)) or not index.isdigit():
            raise InvalidSpec(
                f"pipeline_parallel: split point {hits[0]!r} is not an entry of a layer list "
                "(nn.ModuleList / nn.Sequential)"
            )
        if container is not None and container[1] is not parent:
            raise InvalidSpec(
                f"pipeline_parallel: split points {stages!r} are in different layer lists; "
                "name layers of one list"
            )
        container = (parent_name, parent)
        if int(index) <= starts[-1]:
            raise InvalidSpec(
                f"pipeline_parallel: split points {list(stages)!r} must be increasing layers "
                "after the first, so every stage has at least one"
            )
        starts.append(int(index))
    if container is None:  # one rank: a single stage with every layer
        name, layers = _find_layer_list(module)
        return name, layers, starts
    return container[0], container[1], starts
