"""The sans-I/O step loop: admission by slots and KV bytes, refusal of what can never fit,
priority join order, cancel, preemption of preemptible requests (same final text with the
real engine), deadlines, and outputs routed by request id."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpufn.engines.base import FinishReason, Prompt, RequestOutput, SamplingParams
from gpufn.engines.loop import StepLoop
from gpufn.exceptions import Unschedulable


class FakeEngine:
    """Each request emits one token per step until max_tokens; 1 KiB of KV per token."""

    kv_bytes_per_token = 1024
    max_batch = 64

    def __init__(self) -> None:
        self.running: dict[str, list[int]] = {}  # rid -> [done, max_tokens]
        self.suspended: set[str] = set()
        self.aborts: list[str] = []
        self.added: list[str] = []
        self.steps = 0

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    priority: int = 0) -> None:
        if prompt == "refuse":
            raise ValueError("the engine refuses this prompt")
        self.running[request_id] = [0, params.max_tokens]
        self.added.append(request_id)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        outs = [RequestOutput.aborted(rid) for rid in self.aborts]
        for rid in self.aborts:
            self.running.pop(rid, None)
            self.suspended.discard(rid)
        self.aborts.clear()
        for rid, state in list(self.running.items()):
            if rid in self.suspended:
                continue
            state[0] += 1
            done = state[0] >= state[1]
            outs.append(RequestOutput(rid, (state[0],), "x", done,
                                      FinishReason.LENGTH if done else None,
                                      completion_tokens=state[0]))
            if done:
                del self.running[rid]
        return outs

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.aborts)

    def bytes_for(self, prompt: Prompt, params: SamplingParams) -> int:
        return (len(prompt) + params.max_tokens) * self.kv_bytes_per_token

    def suspend(self, request_id: str) -> None:
        self.suspended.add(request_id)

    def resume(self, request_id: str) -> None:
        self.suspended.discard(request_id)


def P(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n)


def run(loop: StepLoop, steps: int, now: float = 0.0) -> list[dict[str, RequestOutput]]:
    return [loop.step(now + i).outputs for i in range(steps)]


def test_admission_by_slots_then_the_rest_join_as_slots_free() -> None:
    loop = StepLoop(FakeEngine(), max_batch=2)
    for i, n in enumerate([2, 5, 3]):
        loop.submit(f"r{i}", "ab", P(n))
    first = loop.step(0)
    assert first.joined == ("r0", "r1") and loop.waiting == ["r2"]
    second = loop.step(1)
    assert second.finished == ("r0",) and loop.waiting == ["r2"]
    third = loop.step(2)
    assert third.joined == ("r2",) and set(third.outputs) == {"r1", "r2"}


def test_admission_by_kv_bytes_and_refusal_of_what_can_never_fit() -> None:
    eng = FakeEngine()
    loop = StepLoop(eng, max_batch=8, kv_budget_bytes=10 * 1024)
    loop.submit("a", "abcd", P(2))  # 6 KiB
    loop.submit("b", "abcd", P(2))  # 6 KiB: waits for a's bytes, not for a slot
    assert loop.step(0).joined == ("a",) and loop.kv_bytes_reserved == 6 * 1024
    assert loop.step(1).finished == ("a",) and loop.kv_bytes_reserved == 0
    assert loop.step(2).joined == ("b",)
    with pytest.raises(Unschedulable, match=r"needs 11,264 bytes of KV cache .* budget is "
                                            r"10,240 bytes: lower max_tokens or shorten"):
        loop.submit("big", "abcde", P(6))
    with pytest.raises(ValueError, match="needs an engine with bytes_for"):
        StepLoop(object(), max_batch=1, kv_budget_bytes=1)  # type: ignore[arg-type]


def test_priority_decides_who_joins_first_fifo_within_a_priority() -> None:
    loop = StepLoop(FakeEngine(), max_batch=1)
    for rid, prio in [("lo1", 0), ("hi1", 3), ("lo2", 0), ("hi2", 3), ("mid", 1)]:
        loop.submit(rid, "a", P(1), priority=prio)
    assert loop.waiting == ["hi1", "hi2", "mid", "lo1", "lo2"]
    joined = [j for i in range(5) for j in loop.step(i).joined]
    assert joined == ["hi1", "hi2", "mid", "lo1", "lo2"]


def test_cancel_waiting_and_running_requests() -> None:
    eng = FakeEngine()
    loop = StepLoop(eng, max_batch=1)
    loop.submit("run", "a", P(10))
    loop.submit("wait", "a", P(10))
    loop.submit("next", "a", P(1))
    loop.step(0)
    loop.cancel("wait")
    loop.cancel("run")
    assert loop.free_slots == 1
    res = loop.step(1)  # the cancelled ones end, "next" takes the freed slot at once
    assert res.outputs["wait"].finish_reason is FinishReason.ABORT
    assert res.outputs["run"].finish_reason is FinishReason.ABORT
    assert res.joined == ("next",) and res.outputs["next"].finished
    assert set(res.finished) == {"wait", "run", "next"} and not loop.has_work()
    loop.cancel("unknown")


def test_preemption_suspends_lower_priority_preemptible_requests_newest_first() -> None:
    eng = FakeEngine()
    loop = StepLoop(eng, max_batch=3)
    loop.submit("keep", "a", P(20), priority=0)  # not preemptible
    loop.submit("old", "a", P(20), priority=0, preemptible=True)
    loop.submit("new", "a", P(20), priority=0, preemptible=True)
    loop.step(0)
    loop.submit("urgent", "a", P(2), priority=9)
    res = loop.step(1)
    assert res.preempted == ("new",) and res.joined == ("urgent",)
    assert eng.suspended == {"new"} and loop.waiting == ["new"]
    res = loop.step(2)
    assert res.finished == ("urgent",)
    res = loop.step(3)
    assert res.joined == ("new",) and not eng.suspended


def test_no_preemption_for_equal_priority_or_when_it_would_not_make_room() -> None:
    loop = StepLoop(FakeEngine(), max_batch=2, kv_budget_bytes=30 * 1024)
    loop.submit("a", "a", P(9), preemptible=True)  # 10 KiB
    loop.submit("b", "a", P(9), preemptible=False)  # 10 KiB
    loop.step(0)
    loop.submit("same", "a", P(5), priority=0)
    assert loop.step(1).preempted == ()
    loop.cancel("same")
    loop.submit("huge", "a", P(25), priority=5)  # 26 KiB: only a is preemptible, not enough
    res = loop.step(2)
    assert res.preempted == () and "huge" in loop.waiting


def test_requests_waiting_past_their_deadline_fail_and_refused_ones_fail_alone() -> None:
    loop = StepLoop(FakeEngine(), max_batch=1)
    loop.submit("busy", "a", P(5))
    loop.submit("late", "a", P(1), now=0.0, deadline=2.0)
    loop.submit("refused", "refuse", P(1), priority=1)
    res = loop.step(0.0)
    assert res.outputs["refused"].finish_reason is FinishReason.ERROR
    assert "refuses" in (res.outputs["refused"].error or "")
    assert "late" in loop.waiting
    res = loop.step(2.5)
    assert res.outputs["late"].finish_reason is FinishReason.ERROR
    assert "deadline" in (res.outputs["late"].error or "")
    with pytest.raises(ValueError, match="already"):
        loop.submit("busy", "a", P(1))


@pytest.fixture
def one_thread() -> Iterator[None]:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: two threads contend badly
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(600)  # real decoding: minutes on a loaded 2-core machine
def test_outputs_are_routed_by_request_id_with_the_real_engine(one_thread: None) -> None:
    support = pytest.importorskip("tests.unit.engine_support")
    eng = support.engine(max_batch=4)
    budget = 4 * eng.bytes_for("The quick brown fox", SamplingParams(max_tokens=16))
    loop = StepLoop(eng, max_batch=4, kv_budget_bytes=budget)
    expected = {}
    for i, prompt in enumerate(["The quick brown fox", "Hello! How", "Call me", "One, two"]):
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        expected[f"r{i}"] = support.alone(eng, support.Req(f"r{i}", prompt, params)).tokens
        loop.submit(f"r{i}", prompt, params, preemptible=True)
    got: dict[str, list[int]] = {rid: [] for rid in expected}
    step = 0
    while loop.has_work():
        if step == 4:
            loop.submit("vip", "Water boils at", SamplingParams(max_tokens=4), priority=5)
        res = loop.step(float(step))
        if step == 4:
            assert len(res.preempted) == 1 and res.joined == ("vip",)
        for rid, out in res.outputs.items():
            got.setdefault(rid, []).extend(out.token_ids)
        assert loop.kv_bytes_reserved <= budget
        step += 1
    for rid, tokens in expected.items():
        assert got[rid] == tokens, rid
