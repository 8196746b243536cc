"""`gpufn plan` on the published shapes of Llama-3-8B, Llama-3-70B and Llama-3.1-405B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufn.cli.main import app
from gpufn.parallel import capacity as planner

GiB = 2**30
# The published config.json values (meta-llama/Meta-Llama-3-8B, -70B, Llama-3.1-405B).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA31_405B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 16384, "intermediate_size": 53248,
    "num_attention_heads": 128, "num_hidden_layers": 126, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("cfg, billions", [(LLAMA3_8B, 8.03), (LLAMA3_70B, 70.55),
                                           (LLAMA31_405B, 405.85)])
def test_parameter_counts_match_the_published_sizes(cfg: dict, billions: float) -> None:
    assert planner.ModelShape.from_config(cfg).params / 1e9 == pytest.approx(billions, abs=0.01)


def test_405b_at_bf16_needs_more_than_8_x_80_gib() -> None:
    result = planner.plan(LLAMA31_405B, devices=8, device_memory=80 * GiB, dtype="bf16")
    assert result.fitting == [] and result.recommended is None
    # the weights alone are more than all eight devices hold
    assert result.shape.params * 2 > 8 * 80 * GiB
    assert result.missing_bytes > 150 * GiB
    need = planner.devices_needed(LLAMA31_405B, device_memory=80 * GiB, dtype="bf16")
    assert need is not None and need[0] == 16


def test_70b_fits_tp4_on_4_x_80_gib() -> None:
    result = planner.plan(LLAMA3_70B, devices=4, device_memory=80 * GiB, context=8192, batch=16)
    tp4 = next(lay for lay in result.layouts if (lay.tp, lay.pp) == (4, 1))
    assert tp4.fits
    assert tp4.weights / GiB == pytest.approx(70.55e9 * 2 / 4 / GiB, rel=0.01)
    assert tp4.kv_cache / GiB == pytest.approx(10.0, rel=0.01)  # 16 x 8192 x 80 x 2 x 2 kv heads x 128 x 2 B
    assert result.recommended is tp4
    assert tp4.allreduce_bytes_per_token == 2 * 80 * 8192 * 2 * 2 * 3 / 4
    # on one device it does not fit; on two only with the KV cache much smaller
    assert planner.plan(LLAMA3_70B, devices=1, device_memory=80 * GiB).recommended is None


def test_8b_fits_one_device_and_is_replicated() -> None:
    result = planner.plan(LLAMA3_8B, devices=8, device_memory=80 * GiB)
    best = result.recommended
    assert best is not None and (best.tp, best.pp) == (1, 1)
    assert planner.plan(LLAMA3_8B, devices=8, device_memory=80 * GiB, dtype="int8").recommended


def _write(tmp_path: Path, name: str, cfg: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json"


def test_cli_recommends_and_refuses(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["plan", str(_write(tmp_path, "Meta-Llama-3-70B", LLAMA3_70B)),
                             "--devices", "4", "--device-memory", "80GiB", "--context", "8192",
                             "--batch", "16", "--json"])
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.output)
    assert (out["recommended"]["tp"], out["recommended"]["pp"]) == (4, 1)
    assert {(r["tp"], r["pp"]) for r in out["layouts"]} >= {(4, 1), (2, 2)}
    text = runner.invoke(app, ["plan", str(tmp_path / "Meta-Llama-3-70B" / "config.json"),
                               "--devices", "4"])
    # batch 1: the KV cache is small, two devices hold it and four hold two replicas
    assert text.exit_code == 0 and "recommended: TP=2 PP=1 on 2 device(s), 2 replicas" in text.output
    big = _write(tmp_path, "Llama-3.1-405B", LLAMA31_405B)
    no = runner.invoke(app, ["plan", str(big), "--devices", "8", "--device-memory", "80GiB",
                             "--dtype", "bf16"])
    assert no.exit_code == 1
    assert "does not fit on 8 x 80.0 GiB" in no.output and "GiB missing in all" in no.output
    assert "fits on 16 x 80.0 GiB" in no.output
    bad = runner.invoke(app, ["plan", str(big), "--dtype", "bf17"])
    assert bad.exit_code == 2 and "bf17" in bad.output
