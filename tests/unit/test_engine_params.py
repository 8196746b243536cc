"""SamplingParams validation (each error names the parameter and the fix), the text a
request returns as tokens arrive (held back across stop strings and split characters),
and the vLLM adapter's translation of outputs (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpufn.engines.base import FinishReason, SamplingParams
from gpufn.engines.text import IncrementalText
from gpufn.engines.vllm import from_vllm_output, vllm_param_dict
from gpufn.exceptions import InvalidSpec


@pytest.mark.parametrize(("options", "message"), [
    ({"max_tokens": 0}, r"max_tokens=0\): give a whole number of tokens >= 1"),
    ({"temperature": -1}, r"temperature=-1\): use 0 for greedy"),
    ({"top_p": 0}, r"top_p=0\): use a number in \(0, 1\]"),
    ({"seed": 1.5}, r"seed=1.5\): use an integer"),
    ({"presence_penalty": 3}, r"presence_penalty=3\): use a number in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, r"frequency_penalty=nan\)"),
    ({"logprobs": 21}, r"logprobs=21\): use None, or how many alternatives: 0..20"),
    ({"prompt_logprobs": -1}, r"prompt_logprobs=-1\)"),
    ({"stop": ("",)}, r"stop=\('',\)\): give non-empty strings"),
    ({"stop_token_ids": (-3,)}, r"stop_token_ids=\(-3,\)\): give token ids"),
    ({"logit_bias": {"a": 1}}, r"logit_bias=\{'a': 1\}\): keys are token ids"),
    ({"logit_bias": {3: 500}}, r"logit_bias=\{3: 500\}\): biases are numbers in \[-100, 100\]"),
])
def test_bad_params_name_the_parameter_and_the_fix(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        SamplingParams(**options)


def test_params_normalize_and_freeze() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[5], logit_bias={1: 2.0})  # type: ignore[arg-type]
    assert p.stop == ("END",) and p.stop_token_ids == (5,) and p.greedy
    with pytest.raises(AttributeError):
        p.max_tokens = 3  # type: ignore[misc]
    assert not SamplingParams(temperature=0.5).greedy


class CharTokenizer:
    """Token i is byte i; decoding is UTF-8 with replacement characters."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text: IncrementalText, data: bytes) -> list[str]:
    return [text.add(b) for b in data]


def test_text_is_held_back_while_it_may_start_a_stop_string() -> None:
    t = IncrementalText(CharTokenizer(), [], ["STOP", "END"])
    pieces = feed(t, b"abcSTxyzSTO")
    assert "".join(pieces) == "abcSTxyz"  # "ST" released once "x" rules the stop out
    assert pieces[3:5] == ["", ""] and t.stopped_by is None
    assert t.add(ord("P")) == "" and t.stopped_by == "STOP" and t.text == "abcSTxyz"


def test_split_characters_wait_for_their_last_byte_and_flush_ends_the_text() -> None:
    t = IncrementalText(CharTokenizer(), [], [])
    snow = "é☃".encode()
    pieces = feed(t, b"a" + snow)
    assert pieces == ["a", "", "é", "", "", "☃"]
    t2 = IncrementalText(CharTokenizer(), [], ["zz"])
    assert "".join(feed(t2, b"abz")) == "ab"
    assert t2.flush() == "z"


def V(logprob: float, rank: int, token: str) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def test_vllm_outputs_become_gpufn_outputs() -> None:
    comp = SimpleNamespace(token_ids=[7], text=" hi", finish_reason="stop", stop_reason="END",
                           logprobs=[{7: V(-2.0, 3, " hi"), 1: V(-0.5, 1, " a"),
                                      2: V(-1.0, 2, " b")}])
    out = SimpleNamespace(request_id="r", outputs=[comp], finished=True,
                          prompt_token_ids=[4, 5], prompt_logprobs=[None, {5: V(-0.1, 1, "x")}])
    params = SamplingParams(logprobs=2, prompt_logprobs=0)
    got = from_vllm_output(out, 2, 9, params)
    assert got.finish_reason is FinishReason.STOP and got.stop_reason == "END"
    assert got.token_ids == (7,) and got.text == " hi" and got.completion_tokens == 9
    assert got.logprobs is not None
    lp = got.logprobs[0]
    assert lp.chosen.logprob == -2.0 and [a.token_id for a in lp.top] == [1, 2]
    assert got.prompt_logprobs is not None and got.prompt_logprobs[0] is None
    assert got.prompt_logprobs[1] is not None and got.prompt_logprobs[1].chosen.token_id == 5
    comp.finish_reason = "weird"
    assert from_vllm_output(out, 2, 9, params).finish_reason is FinishReason.ERROR
    d = vllm_param_dict(SamplingParams(stop=("x",), logit_bias={3: 1.0}, seed=4))
    assert d["stop"] == ["x"] and d["logit_bias"] == {3: 1.0} and d["seed"] == 4


class FakeLLM:
    """vLLM's LLMEngine surface: one token per step per request, deltas out."""

    def __init__(self) -> None:
        self.reqs: dict[str, list[int]] = {}
        self.priorities: dict[str, int] = {}

    def add_request(self, rid: str, prompt: Any, params: dict[str, Any], priority: int = 0) -> None:
        self.reqs[rid] = [0, params["max_tokens"], len(prompt["prompt_token_ids"])]
        self.priorities[rid] = priority

    def step(self) -> list[SimpleNamespace]:
        outs = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            done = st[0] >= st[1]
            comp = SimpleNamespace(token_ids=[st[0]], text="t", logprobs=None,
                                   finish_reason="length" if done else None, stop_reason=None)
            outs.append(SimpleNamespace(request_id=rid, outputs=[comp], finished=done,
                                        prompt_token_ids=[0] * st[2], prompt_logprobs=None))
            if done:
                del self.reqs[rid]
        return outs

    def abort_request(self, rids: list[str]) -> None:
        for rid in rids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)


def test_the_vllm_adapter_counts_tokens_and_reports_aborts() -> None:
    from gpufn.engines.vllm import VLLMEngine

    llm = FakeLLM()
    eng = VLLMEngine(llm, params_factory=vllm_param_dict)
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    eng.add_request("b", [1], SamplingParams(max_tokens=9), priority=4)
    assert llm.priorities == {"a": 0, "b": -4}  # vLLM serves lower values first
    eng.step()
    eng.abort("b")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["b"].finish_reason is FinishReason.ABORT and outs["b"].completion_tokens == 1
    assert outs["a"].completion_tokens == 2 and outs["a"].prompt_tokens == 3
    last = eng.step()
    assert [o.finish_reason for o in last] == [FinishReason.LENGTH] and not eng.has_unfinished()
