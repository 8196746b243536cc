"""What `tensor_parallel` shards: a user's dict plan, or the "auto" plan of a recognised model, as rules per module."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gpufn.exceptions import InvalidSpec
from gpufn.parallel._families import Family, family_of

log = logging.getLogger("gpufn.parallel.tensor")

STRATEGIES: tuple[str, ...] = ("colwise", "rowwise", "replicate")

_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
    nn.CELU, nn.Mish, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Dropout, nn.Identity,
)


@dataclass(frozen=True)
class Rule:
    """How one module is sharded."""

    strategy: str  # one of STRATEGIES
    gather_output: bool = False  # colwise: all-gather the output back to full width
    split_input: bool = False  # rowwise: the input arrives replicated and is split here
    source: str = ""  # the plan entry that produced the rule, for error messages

    @property
    def local_output(self) -> bool:
        """The module's output stays sharded on the feature dim (its consumer sees local heads)."""
        return self.strategy == "colwise" and not self.gather_output


@dataclass
class Sharding:
    """Everything `tensor_parallel` does to one model."""

    rules: dict[str, Rule] = field(default_factory=dict)  # module name -> rule
    experts: list[str] = field(default_factory=list)  # mixture-of-experts modules split per expert
    families: dict[str, tuple[Family, Any]] = field(default_factory=dict)  # base model prefix -> (family, config)

    def family(self, name: str) -> tuple[Family, Any] | None:
        """The family (and config) of the Hugging Face base model holding module `name`, if any."""
        best: tuple[int, tuple[Family, Any]] | None = None
        for prefix, entry in self.families.items():
            inside = prefix == "" or name == prefix or name.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[0]):
                best = (len(prefix), entry)
        return best[1] if best else None


# transformers' plan vocabulary (transformers/distributed/tensor_parallel.py) in torch's styles.
_HF_STYLES: dict[str, Rule] = {
    "colwise": Rule("colwise"),
    "colwise_rep": Rule("colwise", gather_output=True),
    "colwise_gather_output": Rule("colwise", gather_output=True),
    "rowwise": Rule("rowwise"),
    "rowwise_rep": Rule("rowwise", split_input=True),
    "rowwise_split_input": Rule("rowwise", split_input=True),
    "embedding_rowwise": Rule("rowwise", split_input=True),
    "embedding_colwise": Rule("colwise", gather_output=True),
    "replicate": Rule("replicate"),
    # gradient all-reduce of a replicated norm: nothing to do for the forward pass
    "replicated_with_grad_allreduce": Rule("replicate"),
}
_EXPERT_STYLES = {"moe_tp_experts", "packed_colwise", "rowwise"}


def matches(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def hf_base_models(module: nn.Module) -> dict[str, nn.Module]:
    """Prefix -> each Hugging Face base model inside `module` (a module with a config and model_type)."""
    found: dict[str, nn.Module] = {}
    for prefix, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if getattr(config, "model_type", None) and id(getattr(sub, "base_model", None)) == id(sub):
            found[prefix] = sub
    return found


def user_plan(module: nn.Module, plan: Mapping[str, str]) -> Sharding:
    names = [name for name, _ in module.named_modules() if name]
    sharding = Sharding()
    for prefix, base in hf_base_models(module).items():
        try:
            sharding.families[prefix] = (family_of(base)[1], base.config)
        except InvalidSpec:
            pass  # the user's plan is theirs to check; fused layers are still refused (see tensor.py)
    for pattern, strategy in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise InvalidSpec(f"tensor_parallel plan: key {pattern!r} is not a module-name pattern")
        if strategy not in STRATEGIES:
            raise InvalidSpec(
                f"tensor_parallel plan: {pattern!r}: {strategy!r} is not a sharding strategy; "
                f"use one of {', '.join(repr(s) for s in STRATEGIES)}"
            )
        matched = [name for name in names if matches(pattern, name)]
        if not matched:
            examples = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)][:3] or names[:3]
            raise InvalidSpec(
                f"tensor_parallel plan: pattern {pattern!r} matches no module of "
                f"{type(module).__name__}; patterns are fnmatch-style over qualified module names "
                f"(or their dotted suffixes) such as {', '.join(map(repr, examples))}, e.g. '*.q_proj'"
            )
        for name in matched:
            previous = sharding.rules.get(name)
            if previous is not None and previous.strategy != strategy:
                raise InvalidSpec(
                    f"tensor_parallel plan: {name!r} is matched by {previous.source!r} "
                    f"({previous.strategy}) and {pattern!r} ({strategy}); make the patterns disjoint"
                )
            sharding.rules[name] = Rule(strategy, source=pattern)
    return sharding


def auto_plan(module: nn.Module) -> Sharding:
    bases = hf_base_models(module)
    sharding = Sharding()
    if bases:
        for prefix, base in bases.items():
            family = family_of(base)[1]
            sharding.families[prefix] = (family, base.config)
            _family_rules(module, prefix, base, family, sharding)
    else:
        sharding.rules = _layout_rules(module)
    if not sharding.experts and not any(rule.strategy != "replicate" for rule in sharding.rules.values()):
        raise InvalidSpec(
            f"tensor_parallel(plan='auto') found nothing it knows how to shard in "
            f"{type(module).__name__} (it knows the Hugging Face model types it has checked, and in other "
            "modules Llama-style q/k/v/o and gate/up/down projections and nn.Sequential MLPs): pass a dict "
            "plan, e.g. {'*.fc1': 'colwise', '*.fc2': 'rowwise'}"
        )
    return sharding


def their_tp_plan(config: object) -> dict[str, str]:
    """transformers' `base_model_tp_plan`, with the fused experts its `base_model_ep_plan`
    names when the tp plan leaves them out: transformers 5.25 moved Mixtral's, Qwen2-MoE's
    and most mixtures' experts from the one to the other (`ep_dispatch_experts`), and without
    this their experts stayed whole on every rank. Each rank still holds a 1/world slice of
    every expert (gpufn's expert tensor parallelism), whatever the ep plan would dispatch."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if "moe_tp_experts" in plan.values():
        return plan
    for key, style in (getattr(config, "base_model_ep_plan", None) or {}).items():
        if style == "ep_dispatch_experts":
            plan[key] = "moe_tp_experts"
            plan[f"{key}.gate_up_proj"] = "packed_colwise"
            plan[f"{key}.down_proj"] = "rowwise"
    return plan


def _family_rules(root: nn.Module, prefix: str, base: nn.Module, family: Family, sharding: Sharding) -> None:
    """Rules from the family's plan (its own, or transformers' `base_model_tp_plan` plus extras)."""
    if family.plan is not None:
        plan = dict(family.plan)
    else:
        plan = {**their_tp_plan(base.config), **family.extra}
    modules = {n: m for n, m in root.named_modules() if n}
    params = {name for name, _ in root.named_parameters()}
    blocked: set[str] = set()  # blocks (parent modules) holding an entry we cannot express
    expert_entries: dict[str, dict[str, str]] = {}  # experts module -> {param or "": style}
    for key, style in plan.items():
        pattern = f"{prefix}.{key}" if prefix else key
        hits = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        param_hits = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
        if style == "moe_tp_experts":
            for name in hits:
                expert_entries.setdefault(name, {})[""] = style
            continue
        if param_hits and style in _EXPERT_STYLES:
            for name in param_hits:
                owner, _, param = name.rpartition(".")
                expert_entries.setdefault(owner, {})[param] = style
            continue
        rule = _HF_STYLES.get(style) if isinstance(style, str) else None
        if rule is None or param_hits:
            log.info("tensor_parallel: skipping %s: %r (not expressible with torch's styles)", pattern, style)
            blocked.update(parent_name(n) for n in hits + param_hits)
            continue
        for name in hits:
            if style.startswith("embedding_") != isinstance(modules[name], nn.Embedding):
                blocked.add(parent_name(name))
                continue
            sharding.rules[name] = Rule(rule.strategy, rule.gather_output, rule.split_input, source=f"{pattern}: {style}")
    for name, entries in expert_entries.items():
        if entries == {"": "moe_tp_experts", "gate_up_proj": "packed_colwise", "down_proj": "rowwise"}:
            sharding.experts.append(name)
        else:
            log.info("tensor_parallel: keeping %s replicated (expert plan %s)", name, entries)
            blocked.add(parent_name(name))
    if blocked:
        log.info("tensor_parallel: keeping replicated the blocks %s", sorted(blocked))
        sharding.rules = {n: r for n, r in sharding.rules.items() if parent_name(n) not in blocked}


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (a Linear with its weight stored transposed), without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def is_linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _layout_rules(module: nn.Module) -> dict[str, Rule]:
    """Rules for modules that are not Hugging Face models: Llama-style names, nn.Sequential MLPs."""
    rules: dict[str, Rule] = {}

    def add(prefix: str, names: Iterable[str], strategy: str, source: str) -> None:
        for child in names:
            rules[f"{prefix}.{child}" if prefix else child] = Rule(strategy, source=source)

    for prefix, sub in module.named_modules():
        children = {name: child for name, child in sub.named_children()}
        linear = {name for name, child in children.items() if is_linear_like(child)}
        if {"q_proj", "k_proj", "v_proj", "o_proj"} <= linear:
            add(prefix, ("q_proj", "k_proj", "v_proj"), "colwise", "llama attention")
            add(prefix, ("o_proj",), "rowwise", "llama attention")
        if {"up_proj", "down_proj"} <= linear:
            add(prefix, sorted({"gate_proj", "up_proj"} & linear), "colwise", "llama mlp")
            add(prefix, ("down_proj",), "rowwise", "llama mlp")
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
