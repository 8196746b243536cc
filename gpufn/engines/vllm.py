"""`VLLMEngine`: vLLM's `LLMEngine` behind gpufn's step interface. vLLM batches, pages and
preempts on its own; this adapter translates requests and outputs (vllm imported lazily)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpufn.engines.base import (
    FinishReason,
    Logprob,
    Prompt,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
            "abort": FinishReason.ABORT}


class VLLMEngine:
    """Wraps a `vllm.LLMEngine` (`VLLMEngine.from_args(model="...", ...)` builds one from
    `EngineArgs`). Outputs are requested as deltas, so each step's text and tokens are
    new ones, as gpufn's `RequestOutput` expects."""

    def __init__(self, llm_engine: Any,
                 params_factory: Callable[[SamplingParams], Any] | None = None) -> None:
        self.llm = llm_engine
        self._to_params = params_factory or to_vllm_params
        self._aborted: list[str] = []
        self._prompt_tokens: dict[str, int] = {}
        self._completion_tokens: dict[str, int] = {}
        self._params: dict[str, SamplingParams] = {}

    @classmethod
    def from_args(cls, **engine_args: Any) -> VLLMEngine:
        from vllm import EngineArgs, LLMEngine

        return cls(LLMEngine.from_engine_args(EngineArgs(**engine_args)))

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    priority: int = 0) -> None:
        vllm_prompt: Any = prompt if isinstance(prompt, str) \
            else {"prompt_token_ids": [int(t) for t in prompt]}
        # vLLM serves lower values first and refuses any unless its engine was built
        # with scheduling_policy="priority"; gpufn serves higher values first.
        extra = {"priority": -priority} if priority else {}
        self.llm.add_request(request_id, vllm_prompt, self._to_params(params), **extra)
        self._completion_tokens[request_id] = 0
        self._params[request_id] = params

    def step(self) -> list[RequestOutput]:
        outputs = [RequestOutput.aborted(rid, prompt_tokens=self._prompt_tokens.get(rid, 0),
                                         completion_tokens=self._completion_tokens[rid])
                   for rid in self._aborted if rid in self._completion_tokens]
        for rid in self._aborted:
            for book in (self._prompt_tokens, self._completion_tokens, self._params):
                book.pop(rid, None)
        self._aborted.clear()
        if not self.llm.has_unfinished_requests():
            return outputs
        for out in self.llm.step():
            rid = out.request_id
            if rid not in self._completion_tokens:
                continue
            self._prompt_tokens.setdefault(rid, len(out.prompt_token_ids or ()))
            self._completion_tokens[rid] += len(out.outputs[0].token_ids) if out.outputs else 0
            outputs.append(from_vllm_output(out, self._prompt_tokens[rid],
                                            self._completion_tokens[rid], self._params[rid]))
            if out.finished:
                for book in (self._prompt_tokens, self._completion_tokens, self._params):
                    book.pop(rid, None)
        return outputs

    def abort(self, request_id: str) -> None:
        """vLLM drops an aborted request silently; its 'abort' output comes from here."""
        if request_id in self._completion_tokens and request_id not in self._aborted:
            self.llm.abort_request([request_id])
            self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._aborted) or bool(self.llm.has_unfinished_requests())

    @property
    def kv_bytes_per_token(self) -> int:
        """From vLLM's model config: 2 (K and V) x layers x KV heads x head size x dtype.
        vLLM allocates its KV pool up front (`gpu_memory_utilization`); charge that pool to
        the ledger as the model's, and use this for admission."""
        import torch

        mc = self.llm.model_config
        pc = self.llm.vllm_config.parallel_config
        dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.float16
        return int(2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size()
                   * dtype.itemsize)

    def bytes_for(self, prompt: Prompt, params: SamplingParams) -> int:
        n = len(self.llm.get_tokenizer().encode(prompt)) if isinstance(prompt, str) else len(prompt)
        return (n + params.max_tokens) * self.kv_bytes_per_token


def to_vllm_params(params: SamplingParams) -> Any:
    """gpufn's SamplingParams as vLLM's (deltas out, our stop and logprob rules)."""
    from vllm import SamplingParams as VParams
    from vllm.sampling_params import RequestOutputKind

    return VParams(**vllm_param_dict(params), output_kind=RequestOutputKind.DELTA)


def vllm_param_dict(p: SamplingParams) -> dict[str, Any]:
    return dict(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        logit_bias=dict(p.logit_bias) or None, include_stop_str_in_output=False)


def from_vllm_output(out: Any, prompt_tokens: int, completion_tokens: int,
                     params: SamplingParams) -> RequestOutput:
    """One vLLM `RequestOutput` (delta kind, one completion) as gpufn's."""
    comp = out.outputs[0] if out.outputs else None
    ids = tuple(int(t) for t in comp.token_ids) if comp is not None else ()
    reason = None
    if out.finished:
        name = getattr(comp, "finish_reason", None) if comp is not None else None
        reason = _REASONS.get(str(name), FinishReason.ERROR)
    lps = None
    if comp is not None and comp.logprobs:
        lps = tuple(_position(step, tok, params.logprobs or 0) for step, tok in zip(comp.logprobs, ids, strict=False))
    plps = None
    if getattr(out, "prompt_logprobs", None):
        toks = out.prompt_token_ids or ()
        plps = tuple(None if step is None else _position(step, int(t), params.prompt_logprobs or 0)
                     for step, t in zip(out.prompt_logprobs, toks, strict=False))
    return RequestOutput(
        out.request_id, ids, comp.text if comp is not None else "", bool(out.finished), reason,
        prompt_tokens, completion_tokens, lps, plps,
        getattr(comp, "stop_reason", None),
        None if reason is not FinishReason.ERROR else f"vLLM finished it with {reason}")


def _position(step: Mapping[int, Any], chosen: int, k: int) -> TokenLogprobs:
    """vLLM's {token_id: Logprob(logprob, rank, decoded_token)} for one position: the
    top `k` by rank (1 = most likely), plus the chosen token wherever it ranks."""
    def lp(tid: int, v: Any) -> Logprob:
        return Logprob(int(tid), float(v.logprob), str(v.decoded_token or ""))

    ranked = sorted((v.rank, t, v) for t, v in step.items()
                    if v.rank is not None and 1 <= v.rank <= k)
    mine = step.get(chosen)
    return TokenLogprobs(lp(chosen, mine) if mine is not None
                         else Logprob(chosen, float("nan"), ""),
                         tuple(lp(t, v) for _, t, v in ranked))
