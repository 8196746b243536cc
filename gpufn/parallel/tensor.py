"""Tensor parallelism: shard a model's linear layers over the ranks of a gang with
`torch.distributed.tensor.parallel` (ColwiseParallel / RowwiseParallel), from a plan or recognised layouts."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from gpufn.exceptions import InvalidSpec
from gpufn.parallel._mesh import resolve_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["STRATEGIES", "Strategy", "tensor_parallel"]

log = logging.getLogger(__name__)

Strategy = Literal["colwise", "rowwise", "replicate"]
STRATEGIES: tuple[str, ...] = ("colwise", "rowwise", "replicate")

# Attention-module attributes that count heads or head-sized features; transformers' attention
# code reads some of them (GPT-2's `split_size`, BART's `embed_dim`...) to reshape, so each rank
# must see its local value once q/k/v are sharded.
_HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads")
_HEAD_WIDTH_ATTRS = ("embed_dim", "split_size", "all_head_size", "hidden_size")
_KV_NAMES = ("k_proj", "v_proj", "key", "value")

_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
    nn.CELU, nn.Mish, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Dropout, nn.Identity,
)


@dataclass(frozen=True)
class _Rule:
    """How one module is sharded."""

    strategy: str  # one of STRATEGIES
    gather_output: bool = False  # colwise: all-gather the output back to full width
    split_input: bool = False  # rowwise: the input arrives replicated and is split here
    source: str = ""  # the plan entry that produced the rule, for error messages

    @property
    def local_output(self) -> bool:
        """The module's output stays sharded on the feature dim (its consumer sees local heads)."""
        return self.strategy == "colwise" and not self.gather_output


# transformers' plan vocabulary (transformers/distributed/tensor_parallel.py) in torch's styles.
_HF_STYLES: dict[str, _Rule] = {
    "colwise": _Rule("colwise"),
    "colwise_rep": _Rule("colwise", gather_output=True),
    "colwise_gather_output": _Rule("colwise", gather_output=True),
    "rowwise": _Rule("rowwise"),
    "rowwise_rep": _Rule("rowwise", split_input=True),
    "rowwise_split_input": _Rule("rowwise", split_input=True),
    "embedding_rowwise": _Rule("rowwise", split_input=True),
    "embedding_colwise": _Rule("colwise", gather_output=True),
    "replicate": _Rule("replicate"),
}


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

    `plan="auto"` picks, in order:
      - a Hugging Face model's own plan (`config.base_model_tp_plan` of each base model inside
        `module`, e.g. Llama, Mistral, Qwen): "colwise", "rowwise", "colwise_rep" /
        "colwise_gather_output", "rowwise_rep" / "rowwise_split_input", "embedding_rowwise",
        "embedding_colwise" and "replicate" map onto torch's `ColwiseParallel` /
        `RowwiseParallel`. Entries torch's two styles cannot express ("packed_colwise",
        "packed_rowwise", "sequence_parallel", "moe_tp_experts", "moe_identity_expert",
        "mla_kv_a_proj", "local_params", "all_reduce", "replicated_with_grad_allreduce", and any
        entry naming a parameter rather than a module) are skipped, and so is every other entry of
        the same block (the attention or MLP module holding it), which then stays replicated;
      - Llama-style blocks: `q_proj/k_proj/v_proj` colwise + `o_proj` rowwise,
        `gate_proj/up_proj` colwise + `down_proj` rowwise;
      - GPT-2 blocks (transformers `Conv1D`, converted to `nn.Linear`): `c_attn` (fused q,k,v,
        re-laid out so each rank holds its own heads' q, k and v) colwise + `c_proj` rowwise,
        `c_fc` colwise + `c_proj` rowwise;
      - `nn.Sequential` MLPs: each Linear paired with the next one (with only activations or
        dropout between them) as colwise + rowwise; an unpaired Linear stays replicated.
    Embeddings and the LM head stay replicated.

    A dict plan maps module-name patterns to "colwise", "rowwise" or "replicate". A pattern is
    fnmatch-style and matches a qualified module name or any dotted suffix of it: `"*.q_proj"`,
    `"layers.*.mlp.down_proj"` (matches `model.layers.0.mlp.down_proj`). "colwise" shards a
    Linear's output features (its output stays sharded: feed it to a "rowwise" layer);
    "rowwise" shards its input features and all-reduces the output; "replicate" leaves the module
    whole on every rank. On an `nn.Embedding`, "rowwise" shards the vocabulary and "colwise" the
    embedding dim, both returning full embeddings.

    In both cases attention modules whose q/k/v are sharded get their head counts and head-sized
    widths (`num_heads`, `num_key_value_heads`, `split_size`, `embed_dim`, ...) divided by the
    world size, so their attention code works on local heads.

    Raises `InvalidSpec` for an unknown strategy, a pattern that matches nothing, a module that is
    not a Linear/Embedding, or heads or feature dims that do not divide by the world size;
    `GpufnError` outside a process group.
    """
    if isinstance(plan, str):
        if plan != "auto":
            raise InvalidSpec(
                f"tensor_parallel(plan={plan!r}): plan is 'auto' or a dict of module-name "
                "patterns to 'colwise' | 'rowwise' | 'replicate', e.g. {'*.q_proj': 'colwise'}"
            )
        rules = _auto_rules(module)
    elif isinstance(plan, Mapping):
        rules = _user_rules(module, plan)
    else:
        raise InvalidSpec(
            f"tensor_parallel(plan=...) got a {type(plan).__name__}: pass 'auto' or a dict of "
            "module-name patterns to 'colwise' | 'rowwise' | 'replicate'"
        )
    modules = dict(module.named_modules())
    _check_types(modules, rules)

    mesh = resolve_mesh(module, mesh, what="tensor_parallel")
    world = mesh.size()
    fused = _fused_parts(modules, rules)
    _check_divisible(modules, rules, fused, world)

    _convert_conv1d(module, modules, rules)
    modules = dict(module.named_modules())
    for name, parts in fused.items():
        _relayout_fused(modules[name], parts, world)
    _shrink_attention(modules, rules, world)

    from torch.distributed.tensor.parallel import parallelize_module

    styles = {name: style for name, rule in rules.items() if (style := _style(rule, modules[name]))}
    if styles:
        parallelize_module(module, mesh, styles)
        for name in styles:
            modules[name].register_forward_hook(_wait_output)
    return module


# ---------------------------------------------------------------------------------------------
# plans -> rules


def _matches(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def _user_rules(module: nn.Module, plan: Mapping[str, str]) -> dict[str, _Rule]:
    names = [name for name, _ in module.named_modules() if name]
    rules: dict[str, _Rule] = {}
    for pattern, strategy in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise InvalidSpec(f"tensor_parallel plan: key {pattern!r} is not a module-name pattern")
        if strategy not in STRATEGIES:
            raise InvalidSpec(
                f"tensor_parallel plan: {pattern!r}: {strategy!r} is not a sharding strategy; "
                f"use one of {', '.join(repr(s) for s in STRATEGIES)}"
            )
        matched = [name for name in names if _matches(pattern, name)]
        if not matched:
            examples = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)][:3] or names[:3]
            raise InvalidSpec(
                f"tensor_parallel plan: pattern {pattern!r} matches no module of "
                f"{type(module).__name__}; patterns are fnmatch-style over qualified module names "
                f"(or their dotted suffixes) such as {', '.join(map(repr, examples))}, e.g. '*.q_proj'"
            )
        for name in matched:
            previous = rules.get(name)
            if previous is not None and previous.strategy != strategy:
                raise InvalidSpec(
                    f"tensor_parallel plan: {name!r} is matched by {previous.source!r} "
                    f"({previous.strategy}) and {pattern!r} ({strategy}); make the patterns disjoint"
                )
            rules[name] = _Rule(strategy, source=pattern)
    return rules


def _auto_rules(module: nn.Module) -> dict[str, _Rule]:
    rules = _hf_rules(module)
    if not rules or all(rule.strategy == "replicate" for rule in rules.values()):
        rules = _layout_rules(module)  # no Hugging Face plan, or one that names none of its modules
    if not any(rule.strategy != "replicate" for rule in rules.values()):
        raise InvalidSpec(
            f"tensor_parallel(plan='auto') found nothing it knows how to shard in "
            f"{type(module).__name__} (it knows Hugging Face plans, Llama-style q/k/v/o and "
            "gate/up/down projections, GPT-2 blocks and nn.Sequential MLPs): pass a dict plan, "
            "e.g. {'*.fc1': 'colwise', '*.fc2': 'rowwise'}"
        )
    return rules


def _hf_rules(module: nn.Module) -> dict[str, _Rule] | None:
    """Rules from the `base_model_tp_plan` of every Hugging Face base model in `module`, or None."""
    modules = dict(module.named_modules())
    params = {name for name, _ in module.named_parameters()}
    found = False
    rules: dict[str, _Rule] = {}
    blocked: set[str] = set()  # blocks (parent modules) holding an entry we cannot express
    for prefix, sub in modules.items():
        config = getattr(sub, "config", None)
        plan = getattr(config, "base_model_tp_plan", None)
        if not plan or getattr(sub, "base_model", None) is not sub:
            continue
        found = True
        for key, style in plan.items():
            pattern = f"{prefix}.{key}" if prefix else key
            rule = _HF_STYLES.get(style) if isinstance(style, str) else None
            hits = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
            param_hits = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
            if rule is None or param_hits:
                log.info("tensor_parallel: skipping %s: %r (not expressible with torch's styles)", pattern, style)
                blocked.update(_parent_name(n) for n in hits + param_hits)
                continue
            for name in hits:
                target = modules[name]
                if style.startswith("embedding_") != isinstance(target, nn.Embedding):
                    blocked.add(_parent_name(name))
                    continue
                rules[name] = _Rule(rule.strategy, rule.gather_output, rule.split_input, source=f"{pattern}: {style}")
    if not found:
        return None
    if blocked:
        log.info("tensor_parallel: keeping replicated the blocks %s", sorted(blocked))
    return {name: rule for name, rule in rules.items() if _parent_name(name) not in blocked}


def _layout_rules(module: nn.Module) -> dict[str, _Rule]:
    """Rules from recognised module layouts (Llama-style, GPT-2, nn.Sequential MLPs)."""
    rules: dict[str, _Rule] = {}

    def add(prefix: str, names: Iterable[str], strategy: str, source: str) -> None:
        for child in names:
            rules[f"{prefix}.{child}" if prefix else child] = _Rule(strategy, source=source)

    for prefix, sub in module.named_modules():
        children = {name: child for name, child in sub.named_children()}
        linear = {name for name, child in children.items() if _is_linear_like(child)}
        if {"q_proj", "k_proj", "v_proj", "o_proj"} <= linear:
            add(prefix, ("q_proj", "k_proj", "v_proj"), "colwise", "llama attention")
            add(prefix, ("o_proj",), "rowwise", "llama attention")
        if {"up_proj", "down_proj"} <= linear:
            add(prefix, sorted({"gate_proj", "up_proj"} & linear), "colwise", "llama mlp")
            add(prefix, ("down_proj",), "rowwise", "llama mlp")
        if {"c_attn", "c_proj"} <= linear and isinstance(getattr(sub, "split_size", None), int):
            add(prefix, sorted({"c_attn", "q_attn"} & linear), "colwise", "gpt2 attention")
            add(prefix, ("c_proj",), "rowwise", "gpt2 attention")
        if {"c_fc", "c_proj"} <= linear:
            add(prefix, ("c_fc",), "colwise", "gpt2 mlp")
            add(prefix, ("c_proj",), "rowwise", "gpt2 mlp")
        if isinstance(sub, nn.Sequential):
            pending: str | None = None
            for name, child in children.items():
                if isinstance(child, nn.Linear):
                    if pending is None:
                        pending = name
                    else:
                        add(prefix, (pending,), "colwise", "sequential mlp")
                        add(prefix, (name,), "rowwise", "sequential mlp")
                        pending = None
                elif not isinstance(child, _ELEMENTWISE):
                    pending = None
    return rules


# ---------------------------------------------------------------------------------------------
# checks


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (a Linear with its weight stored transposed), without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _is_linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0]), int(weight.shape[1])


def _check_types(modules: dict[str, nn.Module], rules: dict[str, _Rule]) -> None:
    from torch.distributed.tensor import DTensor

    for name, rule in rules.items():
        target = modules[name]
        if rule.strategy == "replicate":
            continue
        if not (_is_linear_like(target) or isinstance(target, nn.Embedding)):
            raise InvalidSpec(
                f"tensor_parallel: {name!r} ({type(target).__name__}, from {rule.source!r}) cannot "
                f"be sharded {rule.strategy}: only nn.Linear, nn.Embedding and transformers Conv1D "
                "layers can; point the pattern at the layers inside it (e.g. '*.mlp.up_proj')"
            )
        if any(isinstance(p, DTensor) for p in target.parameters(recurse=False)):
            raise InvalidSpec(f"tensor_parallel: {name!r} is already sharded; call tensor_parallel() once per model")


def _fused_parts(modules: dict[str, nn.Module], rules: dict[str, _Rule]) -> dict[str, int]:
    """Colwise layers that pack several projections (GPT-2's q,k,v): name -> number of parts.

    Recognised by the owning attention module's `split_size` (the width of one projection).
    """
    fused: dict[str, int] = {}
    for name, rule in rules.items():
        target = modules[name]
        if not rule.local_output or not _is_linear_like(target):
            continue
        split = getattr(modules[_parent_name(name)], "split_size", None)
        out = _features(target)[1]
        if isinstance(split, int) and split > 0 and out % split == 0 and out // split > 1:
            fused[name] = out // split
    return fused


def _attention_heads(parent: nn.Module, name: str, target: nn.Module, parts: int | None) -> int | None:
    """How many heads the colwise layer `name` produces, if its parent looks like attention."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    width = _features(target)[1] // (parts or 1)
    return width // head_dim if width % head_dim == 0 else None


def _check_divisible(
    modules: dict[str, nn.Module], rules: dict[str, _Rule], fused: dict[str, int], world: int
) -> None:
    for name, rule in rules.items():
        target = modules[name]
        if rule.strategy == "replicate":
            continue
        parent = modules[_parent_name(name)]
        if rule.local_output and _is_linear_like(target):
            heads = _attention_heads(parent, name, target, fused.get(name))
            if heads is not None and heads % world:
                kind = "key/value heads" if name.rpartition(".")[2] in _KV_NAMES else "attention heads"
                raise InvalidSpec(
                    f"tensor_parallel: {name!r} has {heads} {kind}, which do not divide by the "
                    f"world size {world}: use a device count that divides {heads} "
                    f"(@gpu(count=...)), or keep this attention block replicated"
                )
            for attr in _HEAD_COUNT_ATTRS:
                value = getattr(parent, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value % world:
                    raise InvalidSpec(
                        f"tensor_parallel: {_parent_name(name)!r} has {attr}={value}, which does not "
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
            if name in fused:
                dim, label = dim // fused[name], "width of each fused projection"
        if dim % world:
            raise InvalidSpec(
                f"tensor_parallel: {name!r} ({rule.strategy}) has {label} {dim}, which does not "
                f"divide by the world size {world}: use a device count that divides {dim}, or "
                f"mark it 'replicate'"
            )


# ---------------------------------------------------------------------------------------------
# rewrites


def _convert_conv1d(root: nn.Module, modules: dict[str, nn.Module], rules: dict[str, _Rule]) -> None:
    """Replace each sharded transformers `Conv1D` by the equivalent `nn.Linear` (torch's styles
    shard only Linear/Embedding; Conv1D computes x @ W + b with W stored (in, out))."""
    for name, rule in rules.items():
        conv = modules[name]
        if rule.strategy == "replicate" or not _is_conv1d(conv):
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
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, child, linear)


def _relayout_fused(linear: nn.Module, parts: int, world: int) -> None:
    """Reorder a fused [q | k | v] Linear's output rows to [q0 k0 v0 | q1 k1 v1 | ...] so that
    torch's contiguous Shard(0) gives rank r its own heads of every part, in the order the
    attention code splits them."""
    assert isinstance(linear, nn.Linear)
    width = linear.out_features // parts
    chunk = width // world
    order = torch.cat([
        torch.arange(p * width + r * chunk, p * width + (r + 1) * chunk)
        for r in range(world) for p in range(parts)
    ]).to(linear.weight.device)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def _shrink_attention(modules: dict[str, nn.Module], rules: dict[str, _Rule], world: int) -> None:
    """Divide head counts and head-sized widths of modules whose q/k/v outputs become local."""
    parents = {
        _parent_name(name) for name, rule in rules.items()
        if rule.local_output and _is_linear_like(modules[name])
    }
    for parent_name in sorted(parents):
        parent = modules[parent_name]
        if not any(isinstance(getattr(parent, a, None), int) for a in ("head_dim", *_HEAD_COUNT_ATTRS)):
            continue  # an MLP: nothing reads head counts
        for attr in (*_HEAD_COUNT_ATTRS, *_HEAD_WIDTH_ATTRS):
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % world:
                    raise InvalidSpec(
                        f"tensor_parallel: {parent_name!r} has {attr}={value}, which does not "
                        f"divide by the world size {world}: use a device count that divides {value}"
                    )
                setattr(parent, attr, value // world)


def _wait_output(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
    """Hand on a plain tensor rather than torch's AsyncCollectiveTensor, which would otherwise
    reach the caller's results (and fail to pickle back to the client)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, AsyncCollectiveTensor):
        waited: torch.Tensor = output.trigger_wait()
        return waited
    return None


def _style(rule: _Rule, target: nn.Module) -> ParallelStyle | None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if rule.strategy == "replicate":
        return None
    embedding = isinstance(target, nn.Embedding)
    if rule.strategy == "colwise":
        return ColwiseParallel(output_layouts=Replicate() if rule.gather_output or embedding else None)
    return RowwiseParallel(input_layouts=Replicate() if rule.split_input or embedding else None)
