"""Where tensor_parallel reads transformers' plans: experts named by either plan, and the
query groups of attention whose k/v heads are kept whole."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from gpufn.parallel._plans import their_tp_plan
from gpufn.parallel.tensor import _regroup

ATTN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
EXPERTS_TP = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
              "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}
EXPERTS_EP = {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
              "layers.*.mlp.experts.down_proj": "grouped_gemm",
              "layers.*.mlp.experts": "ep_dispatch_experts"}


def test_experts_in_the_tp_plan_are_taken_as_they_are() -> None:  # transformers <= 5.24
    config = SimpleNamespace(base_model_tp_plan={**ATTN, **EXPERTS_TP}, base_model_ep_plan=EXPERTS_EP)
    assert their_tp_plan(config) == {**ATTN, **EXPERTS_TP}


def test_experts_only_in_the_ep_plan_are_sharded_as_the_tp_plan_did() -> None:  # 5.25
    config = SimpleNamespace(base_model_tp_plan=dict(ATTN), base_model_ep_plan=EXPERTS_EP)
    assert their_tp_plan(config) == {**ATTN, **EXPERTS_TP}
    assert config.base_model_tp_plan == ATTN  # the config's own plan is left as it was


def test_no_experts_no_plans() -> None:
    assert their_tp_plan(SimpleNamespace(base_model_tp_plan=dict(ATTN))) == ATTN
    assert their_tp_plan(SimpleNamespace(base_model_tp_plan=None, base_model_ep_plan=None)) == {}
    assert their_tp_plan(SimpleNamespace()) == {}
    other = {"layers.*.mlp.experts": "grouped_gemm"}  # an ep style that is not the dispatch
    assert their_tp_plan(SimpleNamespace(base_model_tp_plan={}, base_model_ep_plan=other)) == {}


def _attn(**counts: int) -> nn.Module:
    attn = nn.Module()
    for name, value in counts.items():
        setattr(attn, name, value)
    return attn


def test_query_groups_follow_the_local_counts() -> None:
    mqa = _attn(num_heads=4, num_kv_heads=1, num_key_value_groups=8)  # 8 heads halved, 1 kv kept
    _regroup(mqa)
    assert mqa.num_key_value_groups == 4
    gqa = _attn(num_attention_heads=4, num_key_value_heads=2, num_key_value_groups=2)
    _regroup(gqa)
    assert gqa.num_key_value_groups == 2
    plain = _attn(num_heads=4, num_key_value_groups=8)  # no k/v count to divide by: left alone
    _regroup(plain)
    assert plain.num_key_value_groups == 8
    none = _attn(num_heads=4, num_kv_heads=1)
    _regroup(none)
    assert not hasattr(none, "num_key_value_groups")
