"""Batching never changes a request's result: greedy requests of mixed prompts, lengths and
stops, joining at different steps, equal their alone runs token for token; preempted ones
resume with the same text; seeded sampling does not depend on batch-mates."""

from __future__ import annotations

import random

import pytest

from gpufn.engines.base import FinishReason, SamplingParams
from tests.unit.engine_support import Req, alone, drive, engine, one_thread  # noqa: F401

PROMPTS = ["The quick brown fox", "Hello! How are you today?", "One, two, three,",
           "Call me Ishmael.", "GPUs decode many sequences at once because", "x",
           "def add(a, b):\n", "Le petit chat dort sur le canape."]

# Real decoding at one thread: 15 s alone, several minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(600)


def mixed_requests(n: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = " ".join(rng.choice(PROMPTS) for _ in range(rng.randrange(1, 4)))
        stop = (rng.choice(["e", "at", " o", "Gar"]),) if i % 3 == 0 else ()
        params = SamplingParams(max_tokens=rng.randrange(1, 24), stop=stop)
        reqs.append(Req(f"r{i}", prompt, params, join_at=rng.randrange(0, 12)))
    return reqs


def test_sixteen_concurrent_greedy_requests_equal_their_alone_runs() -> None:
    eng = engine(max_batch=16)
    reqs = mixed_requests(16, seed=3)
    batched = drive(eng, reqs)
    reasons = set()
    for r in reqs:
        one = alone(eng, r)
        assert batched[r.rid].tokens == one.tokens, r
        assert batched[r.rid].text == one.text, r
        assert batched[r.rid].last.finish_reason == one.last.finish_reason
        reasons.add(batched[r.rid].last.finish_reason)
    assert FinishReason.LENGTH in reasons and FinishReason.STOP in reasons


def test_more_requests_than_slots_equal_their_alone_runs() -> None:
    eng = engine(max_batch=5)
    reqs = mixed_requests(12, seed=11)
    batched = drive(eng, reqs)
    for r in reqs:
        assert batched[r.rid].tokens == alone(eng, r).tokens, r


def test_preempted_requests_resume_with_the_same_text() -> None:
    eng = engine(max_batch=4)
    reqs = [Req(f"p{i}", PROMPTS[i], SamplingParams(max_tokens=20, ignore_eos=True))
            for i in range(4)]
    expected = drive(eng, reqs)
    preempted: list[str] = []
    waiting: list[int] = []

    def preempt(step: int, e: object) -> None:
        waiting.append(eng.num_waiting)
        if step in (3, 9, 14):
            rid = f"p{step % 4}"
            eng.preempt(rid)
            eng.add_request(f"hi{step}", "Water boils", SamplingParams(max_tokens=6), 5)
            preempted.append(rid)

    got = drive(eng, reqs, on_step=preempt)
    assert len(preempted) == 3
    assert waiting[4] == 1  # the victim waited while the higher-priority request ran
    for r in reqs:
        assert got[r.rid].tokens == expected[r.rid].tokens
        assert got[r.rid].text == expected[r.rid].text
        assert got[r.rid].last.completion_tokens == 20


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates() -> None:
    eng = engine()
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234,
                            ignore_eos=True)
    target = Req("seeded", "The rain in Spain", params)
    one = alone(eng, target)
    noise = [Req(f"n{i}", PROMPTS[i], SamplingParams(max_tokens=12, temperature=1.0),
                 join_at=i) for i in range(6)]
    mixed = drive(eng, [*noise, Req("seeded", "The rain in Spain", params, join_at=2)])
    assert mixed["seeded"].tokens == one.tokens
    other_seed = alone(eng, Req("s2", "The rain in Spain",
                                SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9,
                                               seed=99, ignore_eos=True)))
    assert other_seed.tokens != one.tokens


def test_min_rows_auto_measures_the_threshold_and_keeps_exactness() -> None:
    eng = engine(max_batch=8, min_rows="auto")
    assert 1 < eng.min_rows <= 16  # MKL fp32: rows of 1-3 take other kernels
    reqs = mixed_requests(8, seed=5)
    batched = drive(eng, reqs)
    for r in reqs:
        assert batched[r.rid].tokens == alone(eng, r).tokens, r
