"""Engines that step many requests of one model together (continuous batching): the
interface, the transformers engine, the vLLM adapter and the sans-I/O step loop."""

from __future__ import annotations

from typing import Any

from gpufn.engines.base import (
    Engine,
    FinishReason,
    KVAccounting,
    Logprob,
    Preemptible,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)

_LAZY = {"TransformersEngine": "gpufn.engines.transformers_engine",
         "VLLMEngine": "gpufn.engines.vllm", "StepLoop": "gpufn.engines.loop",
         "generate": "gpufn.engines.driver", "text": "gpufn.engines.driver",
         "chat_pieces": "gpufn.engines.driver", "completion_pieces": "gpufn.engines.driver",
         "RequestFailed": "gpufn.engines.driver"}

__all__ = ["Engine", "FinishReason", "KVAccounting", "Logprob", "Preemptible",
           "RequestFailed", "RequestOutput", "SamplingParams", "StepLoop", "TokenLogprobs",
           "TransformersEngine", "VLLMEngine", "chat_pieces", "completion_pieces", "generate",
           "text"]


def __getattr__(name: str) -> Any:
    """The engines load torch and transformers (or vllm) only when first named."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpufn.engines' has no attribute {name!r}")
