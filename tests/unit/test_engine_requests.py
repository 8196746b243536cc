"""The transformers engine request by request: join and leave mid-batch, abort, a failing
request fails alone, priority join order, stop strings and tokens, max_tokens, EOS,
logprobs against a plain full forward, echo and prompt logprobs, penalties and bias,
and the KV bytes each sequence holds."""

from __future__ import annotations

import pytest
import torch

from gpufn.engines.base import FinishReason, SamplingParams
from gpufn.engines.sampling import RowSampler
from tests.unit.engine_support import (  # noqa: F401
    Req,
    alone,
    drive,
    engine,
    model_and_tokenizer,
    one_thread,
)

LONG = SamplingParams(max_tokens=30, ignore_eos=True)

# Real decoding at one thread: 15 s alone, several minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(600)


def test_requests_join_and_leave_without_waiting_for_each_other() -> None:
    eng = engine()
    reqs = [Req("long", "The quick brown fox", LONG),
            Req("short", "Hello!", SamplingParams(max_tokens=3, ignore_eos=True), join_at=4)]
    res = drive(eng, reqs)
    assert res["short"].last.completion_tokens == 3
    assert res["long"].last.completion_tokens == 30
    assert len(res["short"].outputs) == 3  # one token per step: it joined and left alone
    assert res["short"].tokens == alone(eng, reqs[1]).tokens


def test_abort_frees_the_slot_at_the_next_step_and_others_continue() -> None:
    eng = engine(max_batch=2)
    reqs = [Req("a", "One, two", LONG), Req("b", "Call me", LONG), Req("c", "Water", LONG)]

    def cancel(step: int, e: object) -> None:
        if step == 5:
            eng.abort("a")
            assert eng.num_running == 2 and eng.num_waiting == 1

    res = drive(eng, reqs, on_step=cancel)
    assert res["a"].last.finish_reason is FinishReason.ABORT
    assert res["a"].last.completion_tokens == 5
    assert len(res["c"].outputs) == 30 and res["c"].tokens == alone(eng, reqs[2]).tokens
    assert res["b"].tokens == alone(eng, reqs[1]).tokens
    eng.abort("never-added")  # unknown ids are ignored


def test_a_failing_request_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine()
    reqs = [Req("ok1", "The rain in Spain", LONG), Req("ok2", "Numbers: 0 1 2", LONG, join_at=5)]
    choose = RowSampler.choose
    calls = {"bad": 0}

    def flaky(self: RowSampler, logits: torch.Tensor) -> int:
        if self.params.max_tokens == 30 and self.params.seed == 7:
            calls["bad"] += 1
            if calls["bad"] == 4:
                raise RuntimeError("boom in this request's sampling")
        return choose(self, logits)

    monkeypatch.setattr(RowSampler, "choose", flaky)
    bad = Req("bad", "Hello", SamplingParams(max_tokens=30, ignore_eos=True, seed=7), join_at=3)
    res = drive(eng, [reqs[0], bad, reqs[1]])
    assert res["bad"].last.finish_reason is FinishReason.ERROR
    assert "boom" in (res["bad"].last.error or "")
    assert res["bad"].last.completion_tokens == 3
    monkeypatch.setattr(RowSampler, "choose", choose)
    for r in reqs:
        assert res[r.rid].last.completion_tokens == 30
        assert res[r.rid].tokens == alone(eng, r).tokens


def test_a_bad_request_is_refused_at_add_naming_the_parameter() -> None:
    eng = engine()
    with pytest.raises(ValueError, match=r"logit_bias: token id 99999 is outside the vocab"):
        eng.add_request("x", "hi", SamplingParams(logit_bias={99999: 1.0}))
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request("y", [], SamplingParams())
    with pytest.raises(ValueError, match="max_len"):
        eng.add_request("z", [5] * 3000, SamplingParams())
    eng.add_request("dup", "hi", SamplingParams())
    with pytest.raises(ValueError, match="already"):
        eng.add_request("dup", "hi", SamplingParams())
    eng.abort("dup")
    assert eng.step()[0].finish_reason is FinishReason.ABORT
    assert not eng.has_unfinished()


def test_higher_priority_joins_first_fifo_within_a_priority() -> None:
    eng = engine(max_batch=1)
    for rid, prio in [("lo1", 0), ("hi1", 5), ("lo2", 0), ("mid", 2), ("hi2", 5)]:
        eng.add_request(rid, "Hello", SamplingParams(max_tokens=2, ignore_eos=True), prio)
    order = []
    while eng.has_unfinished():
        for out in eng.step():
            if out.completion_tokens == 1:
                order.append(out.request_id)
    assert order == ["hi1", "hi2", "mid", "lo1", "lo2"]


def test_stop_strings_never_appear_and_end_the_request() -> None:
    eng = engine()
    free = alone(eng, Req("f", "Hello! How are", LONG))
    assert len(free.text) > 6
    stop = free.text[3:5]
    res = alone(eng, Req("s", "Hello! How are", SamplingParams(max_tokens=30, ignore_eos=True,
                                                               stop=(stop, "zzzz"))))
    cut = free.text.index(stop)
    assert res.text == free.text[:cut]
    assert res.last.finish_reason is FinishReason.STOP and res.last.stop_reason == stop
    assert stop not in res.text


def test_stop_token_ids_eos_and_max_tokens() -> None:
    eng = engine()
    free = alone(eng, Req("f", "One, two", LONG))
    third = free.tokens[2]
    res = alone(eng, Req("t", "One, two", SamplingParams(max_tokens=30, stop_token_ids=(third,),
                                                         ignore_eos=True)))
    first = free.tokens.index(third)
    assert res.tokens == free.tokens[:first + 1]
    assert res.last.finish_reason is FinishReason.STOP and res.last.stop_reason == third
    eos = SamplingParams(max_tokens=30, logit_bias={2: 100.0})  # 2 is <|eos|>
    res = alone(eng, Req("e", "One, two", eos))
    assert res.tokens == [2] and res.text == "" and res.last.finish_reason is FinishReason.STOP
    res = alone(eng, Req("m", "One, two", SamplingParams(max_tokens=4, ignore_eos=True)))
    assert res.last.finish_reason is FinishReason.LENGTH and res.last.completion_tokens == 4
    assert res.last.prompt_tokens == len(model_and_tokenizer()[1].encode("One, two"))


def test_logprobs_equal_a_full_forward_log_softmax() -> None:
    eng = engine()
    model, tok = model_and_tokenizer()
    prompt = tok.encode("Please write a short poem")
    res = drive(eng, [Req("lp", prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                       logprobs=3, prompt_logprobs=2)),
                      Req("mate", "Hello", LONG)])["lp"]
    seq = prompt + res.tokens
    with torch.inference_mode():
        model.config._attn_implementation = "sdpa"
        try:
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        finally:
            model.config._attn_implementation = "gpufn_rows"
    got = [lp for o in res.outputs for lp in (o.logprobs or ())]
    assert len(got) == 12
    for i, step in enumerate(got):
        row = ref[len(prompt) - 1 + i]
        assert step.chosen.token_id == res.tokens[i]
        assert step.chosen.logprob == pytest.approx(float(row[res.tokens[i]]), abs=1e-4)
        assert [a.token_id for a in step.top] == row.topk(3).indices.tolist()
        assert step.top[0].token == tok.decode([step.top[0].token_id])
    plp = res.outputs[0].prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == len(prompt)
    for i, step in enumerate(plp[1:], start=1):
        assert step is not None and step.chosen.token_id == prompt[i]
        assert step.chosen.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert len(step.top) == 2


def test_echo_prepends_the_prompt_text() -> None:
    eng = engine()
    plain = alone(eng, Req("p", "The rain in Spain", SamplingParams(max_tokens=5)))
    echo = alone(eng, Req("e", "The rain in Spain", SamplingParams(max_tokens=5, echo=True)))
    assert echo.text == "The rain in Spain" + plain.text
    assert echo.tokens == plain.tokens


def test_logit_bias_and_penalties_steer_greedy_decoding() -> None:
    eng = engine()
    free = alone(eng, Req("f", "Hello", SamplingParams(max_tokens=8, ignore_eos=True)))
    banned = free.tokens[0]
    res = alone(eng, Req("b", "Hello", SamplingParams(max_tokens=8, ignore_eos=True,
                                                      logit_bias={banned: -100.0})))
    assert banned not in res.tokens
    forced = alone(eng, Req("f2", "Hello", SamplingParams(max_tokens=4, ignore_eos=True,
                                                          logit_bias={77: 100.0})))
    assert forced.tokens == [77] * 4
    rep = alone(eng, Req("r", "Hello", SamplingParams(max_tokens=24, ignore_eos=True)))
    pen = alone(eng, Req("p", "Hello", SamplingParams(max_tokens=24, ignore_eos=True,
                                                      frequency_penalty=2.0,
                                                      presence_penalty=2.0)))
    assert len(set(pen.tokens)) > len(set(rep.tokens))


def test_kv_bytes_per_token_and_per_request() -> None:
    eng = engine()
    model, tok = model_and_tokenizer()
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (
        c.hidden_size // c.num_attention_heads) * 4
    assert eng.kv_bytes_per_token == per_token
    prompt = tok.encode("The quick brown fox")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert eng.bytes_for(prompt, params) == (len(prompt) + 10) * per_token
    assert eng.bytes_for("The quick brown fox", params) == (len(prompt) + 10) * per_token
    eng.add_request("a", prompt, params)
    eng.step()
    assert eng.kv_bytes_in_use == eng.bytes_for(prompt, params)
    while eng.has_unfinished():
        eng.step()
    assert eng.kv_bytes_in_use == 0


def test_text_deltas_concatenate_to_the_decoded_completion() -> None:
    eng = engine()
    tok = model_and_tokenizer()[1]
    reqs = [Req(f"t{i}", p, SamplingParams(max_tokens=40, temperature=1.2, seed=i,
                                           ignore_eos=True))
            for i, p in enumerate(["Le petit chat", "Numbers: 0 1", "x"])]
    for rid, res in drive(eng, reqs).items():
        assert res.text == tok.decode(res.tokens, skip_special_tokens=True), rid


def test_prompts_joining_in_one_step_are_bounded_by_prefill_tokens() -> None:
    eng = engine(prefill_tokens=10)
    tok = model_and_tokenizer()[1]
    prompt = tok.encode("The quick brown fox jumps")  # 5 tokens or more
    assert len(prompt) >= 5
    for i in range(4):
        eng.add_request(f"p{i}", prompt * 2 if i == 0 else prompt, SamplingParams(max_tokens=3))
    assert [o.request_id for o in eng.step()] == ["p0"]  # alone: longer than the budget
    joined = {o.request_id for o in eng.step()} - {"p0"}
    assert len(joined) == 10 // len(prompt)
