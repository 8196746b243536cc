"""vLLM's engine behind gpufn's step interface and step loop (needs CUDA and vllm; skipped
elsewhere, saying which is missing). The model is the tiny seeded Llama, saved locally."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from gpufn.engines.base import FinishReason, SamplingParams
from gpufn.engines.loop import StepLoop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs vllm (pip install vllm); not installed here"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from gpufn.engines.testing import tiny_model_and_tokenizer
    from gpufn.engines.vllm import VLLMEngine

    path: Path = tmp_path_factory.mktemp("tiny-llama")
    model, tok = tiny_model_and_tokenizer()
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return VLLMEngine.from_args(model=str(path), tokenizer=str(path), dtype="float32",
                                enforce_eager=True, gpu_memory_utilization=0.2,
                                max_model_len=512)


def test_requests_step_together_through_the_loop(engine) -> None:  # type: ignore[no-untyped-def]
    loop = StepLoop(engine, max_batch=8,
                    kv_budget_bytes=64 * engine.bytes_for("hello", SamplingParams()))
    texts: dict[str, str] = {}
    last = {}
    for i in range(8):
        loop.submit(f"r{i}", f"Hello number {i}",
                    SamplingParams(max_tokens=8 + i, ignore_eos=True, logprobs=2))
    step = 0
    while loop.has_work():
        if step == 2:
            loop.cancel("r7")
        for rid, out in loop.step(float(step)).outputs.items():
            texts[rid] = texts.get(rid, "") + out.text
            last[rid] = out
            assert out.logprobs is None or len(out.logprobs[0].top) == 2
        step += 1
        assert step < 500
    assert last["r7"].finish_reason is FinishReason.ABORT
    for i in range(7):
        assert last[f"r{i}"].finish_reason is FinishReason.LENGTH
        assert last[f"r{i}"].completion_tokens == 8 + i
