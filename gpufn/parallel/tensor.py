"""Tensor parallelism: shard a model's linear layers over the ranks of a gang with
`torch.distributed.tensor.parallel` (ColwiseParallel / RowwiseParallel), from a plan or recognised layouts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from gpufn.exceptions import InvalidSpec
from gpufn.parallel._experts import check_experts, shard_experts
from gpufn.parallel._families import FusedLayout
from gpufn.parallel._mesh import resolve_mesh
from gpufn.parallel._plans import (
    STRATEGIES,
    Rule,
    Sharding,
    auto_plan,
    is_conv1d,
    is_linear_like,
    parent_name,
    user_plan,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["STRATEGIES", "Strategy", "tensor_parallel"]

Strategy = Literal["colwise", "rowwise", "replicate"]

# Attention-module attributes that count heads or head-sized features; transformers' attention
# code reads some of them (GPT-2's `split_size`, BART's `embed_dim`...) to reshape, so each rank
# must see its local value once q/k/v are sharded.
_HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads")
_HEAD_WIDTH_ATTRS = ("embed_dim", "split_size", "all_head_size", "hidden_size", "inner_dim")
_KV_NAMES = ("k_proj", "v_proj", "key", "value")
_KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads")


def tensor_parallel(
    module: nn.Module,
    plan: Literal["auto"] | Mapping[str, str] = "auto",
    *,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard `module` in place across the ranks of `mesh` and return it.

    Every rank calls this with the same model (rank 0's weights are the ones distributed). After it,
    each rank holds a slice of every sharded layer; calling the module on every rank with the same
    input gives every rank the full output, as the unsharded model would.

    `mesh`: a 1-D `DeviceMesh`; by default the mesh of the running gpufn call
    (`gpufn.context().mesh`), else one over torch.distributed's default group.

    `plan="auto"`:
      - for a Hugging Face model, only model types whose layouts were checked against one process
        (`gpufn.parallel._families.FAMILIES`: Llama, Mistral, Qwen2/3, Qwen2-MoE, Mixtral, Phi,
        Phi-3, Gemma 1-3, GPT-2, GPTBigCode, CodeGen, GPT-J, GPT-NeoX, Falcon, OPT, StableLM,
        Starcoder2, OLMo, Cohere, Granite, ...). It follows the model's own `base_model_tp_plan`
        ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
        "embedding_rowwise", ... onto torch's `ColwiseParallel` / `RowwiseParallel`; experts
        under "moe_tp_experts" are split per expert along their intermediate size), or gpufn's
        own plan for the types without one. Fused projections are split by their model's layout:
        GPT-2's [q|k|v], per-head [q k v] (GPT-NeoX, Falcon, GPTBigCode), multi-query
        [q|k|v] with one shared k/v head (GPTBigCode, Falcon: k/v replicated), CodeGen's four
        model-parallel shards. An unknown model type, or a configuration it cannot split
        correctly (ALiBi in Bloom/MPT, per-head q/k norms in StableLM...), is an `InvalidSpec`;
        plan entries torch's styles cannot express keep their whole block replicated;
      - for other modules: Llama-style blocks (`q_proj/k_proj/v_proj` colwise + `o_proj` rowwise,
        `gate_proj/up_proj` colwise + `down_proj` rowwise) and `nn.Sequential` MLPs (each Linear
        paired with the next one, with only activations or dropout between them, as colwise +
        rowwise; an unpaired Linear stays replicated).
    Embeddings and the LM head stay replicated unless the model's plan says otherwise.

    A dict plan maps module-name patterns to "colwise", "rowwise" or "replicate". A pattern is
    fnmatch-style and matches a qualified module name or any dotted suffix of it: `"*.q_proj"`,
    `"layers.*.mlp.down_proj"` (matches `model.layers.0.mlp.down_proj`). "colwise" shards a
    Linear's output features (its output stays sharded: feed it to a "rowwise" layer);
    "rowwise" shards its input features and all-reduces the output; "replicate" leaves the module
    whole on every rank. On an `nn.Embedding`, "rowwise" shards the vocabulary and "colwise" the
    embedding dim, both returning full embeddings. Fused projections of recognised model types are
    split by their layout as above; a colwise layer inside attention whose width is not a whole
    number of heads (an unrecognised fused layout) is refused.

    In both cases attention modules whose q/k/v are sharded get their head counts and head-sized
    widths (`num_heads`, `num_key_value_heads`, `split_size`, `embed_dim`, ...) divided by the
    world size, so their attention code works on local heads.

    Raises `InvalidSpec` for an unknown strategy, a pattern that matches nothing, a module that is
    not a Linear/Embedding, heads or feature dims that do not divide by the world size, or a model
    whose layout is not recognised; `GpufnError` outside a process group.
    """
    if isinstance(plan, str):
        if plan != "auto":
            raise InvalidSpec(
                f"tensor_parallel(plan={plan!r}): plan is 'auto' or a dict of module-name "
                "patterns to 'colwise' | 'rowwise' | 'replicate', e.g. {'*.q_proj': 'colwise'}"
            )
        sharding = auto_plan(module)
    elif isinstance(plan, Mapping):
        sharding = user_plan(module, plan)
    else:
        raise InvalidSpec(
            f"tensor_parallel(plan=...) got a {type(plan).__name__}: pass 'auto' or a dict of "
            "module-name patterns to 'colwise' | 'rowwise' | 'replicate'"
        )
    rules = sharding.rules
    modules = dict(module.named_modules())
    _check_types(modules, rules)

    mesh = resolve_mesh(module, mesh, what="tensor_parallel")
    world = mesh.size()
    for name in sharding.experts:
        check_experts(name, modules[name], world)
    fused = _fused_rows(modules, sharding, world)
    keep = _kept_attrs(sharding)
    _check_divisible(modules, rules, fused, keep, world)

    _convert_conv1d(module, modules, rules)
    modules = dict(module.named_modules())
    for name, rows in fused.items():
        if rows is not None:
            _relayout(module, name, rows)
    modules = dict(module.named_modules())
    _shrink_attention(modules, sharding, keep, world, mesh.get_local_rank())
    for name in sharding.experts:
        shard_experts(modules[name], mesh)

    from torch.distributed.tensor.parallel import parallelize_module

    styles = {name: style for name, rule in rules.items() if (style := _style(rule, modules[name]))}
    if styles:
        parallelize_module(module, mesh, styles)
        for name in styles:
            modules[name].register_forward_hook(_wait_output)
    return module


# ---------------------------------------------------------------------------------------------
# checks


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0]), int(weight.shape[1])


def _check_types(modules: dict[str, nn.Module], rules: dict[str, Rule]) -> None:
    from torch.distributed.tensor import DTensor

    for name, rule in rules.items():
        target = modules[name]
        if rule.strategy == "replicate":
            continue
        if not (is_linear_like(target) or isinstance(target, nn.Embedding)):
            raise InvalidSpec(
                f"tensor_parallel: {name!r} ({type(target).__name__}, from {rule.source!r}) cannot "
                f"be sharded {rule.strategy}: only nn.Linear, nn.Embedding and transformers Conv1D "
                "layers can; point the pattern at the layers inside it (e.g. '*.mlp.up_proj')"
            )
        if any(isinstance(p, DTensor) for p in target.parameters(recurse=False)):
            raise InvalidSpec(f"tensor_parallel: {name!r} is already sharded; call tensor_parallel() once per model")


def _is_attention(module: nn.Module) -> bool:
    return isinstance(getattr(module, "head_dim", None), int)


def _fused_rows(
    modules: dict[str, nn.Module], sharding: Sharding, world: int
) -> dict[str, list[torch.Tensor] | None]:
    """Colwise layers packing several projections -> the rows each rank takes (None: contiguous).

    The layout is the model family's (by model type and config); a colwise layer in an attention
    module whose width is not a whole number of its heads is an unrecognised fused layout: refused.
    """
    fused: dict[str, list[torch.Tensor] | None] = {}
    for name, rule in sharding.rules.items():
        target = modules[name]
        if not rule.local_output or not is_linear_like(target):
            continue
        parent = modules[parent_name(name)]
        entry = sharding.family(name)
        layout: FusedLayout | None = entry[0].fused.get(name.rpartition(".")[2]) if entry else None
        if layout is not None:
            try:
                fused[name] = layout(parent, target, world)
            except InvalidSpec as exc:  # name the layer
                raise InvalidSpec(f"tensor_parallel: {name!r}: {str(exc).removeprefix('tensor_parallel: ')}") from None
            continue
        if _is_attention(parent):
            head_dim: int = getattr(parent, "head_dim")  # noqa: B009 (an int: _is_attention)
            counts = {v for a in _HEAD_COUNT_ATTRS if isinstance(v := getattr(parent, a, None), int)}
            if counts and _features(target)[1] not in {c * head_dim for c in counts}:
                model_type = getattr(entry[1], "model_type", None) if entry else None
                raise InvalidSpec(
                    f"tensor_parallel: {name!r} ({type(parent).__name__}"
                    f"{f', model type {model_type!r}' if model_type else ''}) has {_features(target)[1]} "
                    f"outputs, not a whole number of its {sorted(counts)} heads of {head_dim}: a fused "
                    "projection whose layout is not recognised; mark it 'replicate' (or its whole "
                    "attention block) in a dict plan, or run the model on one device (count=1)"
                )
    return fused


def _kept_attrs(sharding: Sharding) -> dict[str, tuple[str, ...]]:
    """Base model prefix -> attention attributes that keep their global value (e.g. MQA's one k/v head)."""
    return {prefix: family.keep(config) for prefix, (family, config) in sharding.families.items()}


def _keep_for(name: str, sharding: Sharding) -> tuple[str, ...]:
    entry = sharding.family(name)
    return entry[0].keep(entry[1]) if entry else ()


def _attention_heads(parent: nn.Module, target: nn.Module) -> int | None:
    """How many heads the colwise layer produces, if its parent looks like attention."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    width = _features(target)[1]
    return width // head_dim if width % head_dim == 0 else None


def _check_divisible(
    modules: dict[str, nn.Module],
    rules: dict[str, Rule],
    fused: dict[str, list[torch.Tensor] | None],
    keep: dict[str, tuple[str, ...]],
    world: int,
) -> None:
    kept = {attr for attrs in keep.values() for attr in attrs}
    for name, rule in rules.items():
        target = modules[name]
        if rule.strategy == "replicate" or name in fused:
            continue  # a fused layout checks its own heads
        parent = modules[parent_name(name)]
        if rule.local_output and is_linear_like(target):
            heads = _attention_heads(parent, target)
            if heads is not None and heads % world:
                kind = "key/value heads" if name.rpartition(".")[2] in _KV_NAMES else "attention heads"
                raise InvalidSpec(
                    f"tensor_parallel: {name!r} has {heads} {kind}, which do not divide by the "
                    f"world size {world}: use a device count that divides {heads} "
                    f"(@gpu(count=...)), or keep this attention block replicated"
                )
            for attr in _HEAD_COUNT_ATTRS:
                value = getattr(parent, attr, None)
                if attr not in kept and isinstance(value, int) and not isinstance(value, bool) and value % world:
                    raise InvalidSpec(
                        f"tensor_parallel: {parent_name(name)!r} has {attr}={value}, which does not "
                        f"divide by the world size {world}: use a device count that divides {value}"
                    )
        if isinstance(target, nn.Embedding):
            dim, label = (
                (target.embedding_dim, "embedding dim") if rule.strategy == "colwise"
                else (target.num_embeddings, "vocabulary size")
            )
        else:
            in_f, out_f = _features(target)
            dim, label = (out_f, "out_features") if rule.strategy == "colwise" else (in_f, "in_features")
        if dim % world:
            raise InvalidSpec(
                f"tensor_parallel: {name!r} ({rule.strategy}) has {label} {dim}, which does not "
                f"divide by the world size {world}: use a device count that divides {dim}, or "
                f"mark it 'replicate'"
            )


# ---------------------------------------------------------------------------------------------
# rewrites


def _convert_conv1d(root: nn.Module, modules: dict[str, nn.Module], rules: dict[str, Rule]) -> None:
    """Replace each sharded transformers `Conv1D` by the equivalent `nn.Linear` (torch's styles
    shard only Linear/Embedding; Conv1D computes x @ W + b with W stored (in, out))."""
    for name, rule in rules.items():
        conv = modules[name]
        if rule.strategy == "replicate" or not is_conv1d(conv):
            continue
        weight = conv.weight
        bias = getattr(conv, "bias", None)
        assert isinstance(weight, torch.Tensor)
        in_f, out_f = int(weight.shape[0]), int(weight.shape[1])
        linear = nn.Linear(in_f, out_f, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            if bias is not None:
                assert linear.bias is not None
                linear.bias.copy_(bias)
        linear.train(conv.training)
        linear.requires_grad_(weight.requires_grad)
        _replace(root, name, linear)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _relayout(root: nn.Module, name: str, rows: list[torch.Tensor]) -> None:
    """Rebuild a fused Linear so that torch's contiguous Shard(0) gives rank r exactly `rows[r]`,
    in order (its heads of every part; rows shared by all ranks, like a multi-query k/v head, repeat)."""
    linear = root.get_submodule(name)
    assert isinstance(linear, nn.Linear)
    order = torch.cat(rows).to(linear.weight.device)
    new = nn.Linear(linear.in_features, len(order), bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            assert new.bias is not None
            new.bias.copy_(linear.bias[order])
    new.train(linear.training)
    new.requires_grad_(linear.weight.requires_grad)
    if type(linear) is not nn.Linear:
        new.__class__ = type(linear)  # keep a subclass's forward (FalconLinear), same parameters
    _replace(root, name, new)


def _shrink_attention(
    modules: dict[str, nn.Module], sharding: Sharding, keep: dict[str, tuple[str, ...]], world: int,
    rank: int,
) -> None:
    """Divide head counts and head-sized widths of modules whose q/k/v outputs become local,
    and give per-head embeddings (T5's relative position bias) this rank's heads."""
    parents = {
        parent_name(name) for name, rule in sharding.rules.items()
        if rule.local_output and is_linear_like(modules[name])
    }
    for name in sorted(parents):
        parent = modules[name]
        if not any(isinstance(getattr(parent, a, None), int) for a in ("head_dim", *_HEAD_COUNT_ATTRS)):
            continue  # an MLP: nothing reads head counts
        kept = _keep_for(name, sharding)
        _localise_head_embeddings(name, parent, sharding, kept, world, rank)
        for attr in (*_HEAD_COUNT_ATTRS, *_HEAD_WIDTH_ATTRS):
            value = getattr(parent, attr, None)
            if attr in kept or not isinstance(value, int) or isinstance(value, bool):
                continue
            if value % world:
                raise InvalidSpec(
                    f"tensor_parallel: {name!r} has {attr}={value}, which does not "
                    f"divide by the world size {world}: use a device count that divides {value}"
                )
            setattr(parent, attr, value // world)
        _regroup(parent)
        entry = sharding.family(name)
        if entry is not None and entry[0].localise is not None:
            entry[0].localise(parent, entry[1], world)


def _regroup(attn: nn.Module) -> None:
    """Queries per key/value head (`num_key_value_groups`, which transformers' attention
    repeats k/v by) from the local counts: a multi-query model's one k/v head is kept whole
    while its query heads divide, so the ratio divides too (Falcon reads it since 5.25)."""
    if not isinstance(getattr(attn, "num_key_value_groups", None), int):
        return
    heads = next((v for a in ("num_heads", "num_attention_heads")
                  if isinstance(v := getattr(attn, a, None), int)), None)
    kv = next((v for a in _KV_COUNT_ATTRS if isinstance(v := getattr(attn, a, None), int)), None)
    if heads and kv:
        attn.num_key_value_groups = heads // kv  # type: ignore[assignment]


def _localise_head_embeddings(
    name: str, parent: nn.Module, sharding: Sharding, kept: tuple[str, ...], world: int, rank: int
) -> None:
    """An attention module's embedding with one column per head (a relative position bias)
    keeps only this rank's heads, contiguous as a colwise q gives them; else its bias would
    have every head while the scores have the local ones."""
    heads = {v for a in _HEAD_COUNT_ATTRS
             if a not in kept and isinstance(v := getattr(parent, a, None), int) and not isinstance(v, bool)}
    for child_name, child in parent.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if not isinstance(child, nn.Embedding) or child.embedding_dim not in heads:
            continue
        if full in sharding.rules and sharding.rules[full].strategy != "replicate":
            raise InvalidSpec(
                f"tensor_parallel: {full!r} holds one column per attention head of {name!r}; "
                "leave it out of the plan (or mark it 'replicate'): it follows the heads"
            )
        local = child.embedding_dim // world
        cols = slice(rank * local, (rank + 1) * local)
        new = nn.Embedding(child.num_embeddings, local, padding_idx=child.padding_idx,
                           device=child.weight.device, dtype=child.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(child.weight[:, cols])
        new.train(child.training)
        new.requires_grad_(child.weight.requires_grad)
        setattr(parent, child_name, new)


def _wait_output(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
    """Hand on a plain tensor rather than torch's AsyncCollectiveTensor, which would otherwise
    reach the caller's results (and fail to pickle back to the client)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, AsyncCollectiveTensor):
        waited: torch.Tensor = output.trigger_wait()
        return waited
    return None


def _style(rule: Rule, target: nn.Module) -> ParallelStyle | None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if rule.strategy == "replicate":
        return None
    embedding = isinstance(target, nn.Embedding)
    if rule.strategy == "colwise":
        return ColwiseParallel(output_layouts=Replicate() if rule.gather_output or embedding else None)
    return RowwiseParallel(input_layouts=Replicate() if rule.split_input or embedding else None)
