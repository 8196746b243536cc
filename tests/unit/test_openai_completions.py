"""`/v1/completions`' pieces: prompt forms and their bound, a choice's text and legacy
logprobs (offsets computed or given, every malformed item refused with the model named),
`n` choices per prompt, usage summed over prompts, and the streamed answer over the
gateway tests' stand-in connection (items, finishes, usage, `[DONE]`, an error event)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("starlette")

from gpufn.exceptions import ConnectionLost
from gpufn.http import calls, directory
from gpufn.http import openai_completions as oc
from gpufn.http.errors import HTTPError
from tests.unit.test_http_gateway import _item, entry, result, settle

pytestmark = pytest.mark.timeout(30)


def test_prompt_forms_and_their_bound() -> None:
    for empty in ("", ["a", ""]):  # an engine has nothing to start from: 400, not its 500
        with pytest.raises(HTTPError, match="a prompt is empty") as e:
            oc.prompts({"prompt": empty})
        assert e.value.status == 400 and e.value.param == "prompt"
    assert oc.prompts({"prompt": [0, 5]}) == [[0, 5]]
    assert oc.prompts({"prompt": ["a"] * oc.MAX_PROMPTS}) == ["a"] * oc.MAX_PROMPTS
    with pytest.raises(HTTPError, match="at most 2048 prompts per request, got 2049") as e:
        oc.prompts({"prompt": ["a"] * (oc.MAX_PROMPTS + 1)})
    assert e.value.param == "prompt"
    for bad in ([-1], [[1], []], [True, 1], [1.0], {"a": 1}):
        with pytest.raises(HTTPError, match="prompt must be a string"):
            oc.prompts({"prompt": bad})


def item(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def test_a_choice_collects_text_and_computes_offsets_across_items() -> None:
    part = oc.PromptCalls(first=4, n=1)
    index, piece, lp, choice = part.add(item(text="ab", tokens=["a", "b"]))
    assert (index, piece) == (4, "ab")
    assert lp == {"tokens": ["a", "b"], "token_logprobs": [None, None],
                  "top_logprobs": [None, None], "text_offset": [0, 1]}
    _, piece, lp, _ = part.add(b'"cd"')  # text only: no logprobs piece
    assert piece == "cd" and lp is None
    _, _, lp, _ = part.add(item(text="e", tokens=["e"], token_logprobs=[-1],
                                text_offset=[9], finish_reason="stop"))
    assert lp is not None and lp["text_offset"] == [9]  # given offsets are kept
    _, _, lp, _ = part.add(item(text="f", tokens=["f"], token_logprobs=[-2]))
    assert lp is not None and lp["text_offset"] == [5]  # from the choice's length so far
    assert "".join(choice.text) == "abcdef" and choice.length == 6
    assert choice.finish == "stop" and choice.tokens == ["a", "b", "e", "f"]
    part.add(item(finish_reason="content_filter"))  # not a completion's reason: kept as it was
    assert choice.finish == "stop"
    part.add(item(finish_reason="length", text=""))
    assert choice.finish == "length" and "".join(choice.text) == "abcdef"


@pytest.mark.parametrize("value, why", [
    (item(text=3), "a 'text' that is not a string"),
    (item(tokens="ab"), "'tokens' that are not a list of strings"),
    (item(tokens=["a", 1]), "'tokens' that are not a list of strings"),
    (item(tokens=["a"], token_logprobs=[1, 2]), "of different lengths"),
    (item(tokens=["a"], top_logprobs=[None, None]), "of different lengths"),
    (item(tokens=["a"], text_offset=[0, 1]), "of different lengths"),
    (item(tokens=["a"], token_logprobs="x"), "of different lengths"),
    (item(tokens=["a"], token_logprobs=["x"]), "'token_logprobs' that are not numbers"),
    (item(tokens=["a"], top_logprobs=[["a"]]), "'top_logprobs' that are not {token: logprob}"),
    (b"[1]", "a list, not text or a dict"),
    (item(index=1), "an 'index' of 1 for a request of n=1"),
    (item(index=-1), "an 'index' of -1"),
    (item(index=True), "an 'index' of True"),
    (item(index="0"), "an 'index' of '0'"),
])
def test_a_malformed_item_is_the_models_fault_and_says_so(value: bytes, why: str) -> None:
    with pytest.raises(HTTPError) as e:
        oc.PromptCalls(first=0, n=1).add(value)
    assert why in e.value.message and e.value.status == 500
    assert (e.value.type, e.value.code) == ("BadCompletionItem", "bad_model_output")
    assert e.value.message.startswith("a completion model yielded ")
    assert e.value.message.endswith("(see docs/api.md, 'OpenAI models')")


def test_n_choices_a_prompt_and_usage_summed_over_prompts() -> None:
    a, b = oc.PromptCalls(first=0, n=2), oc.PromptCalls(first=2, n=2)
    assert a.add(item(text="x", index=1))[0] == 1 and b.add(item(text="y", index=1))[0] == 3
    a.add(item(usage={"prompt_tokens": 2, "completion_tokens": 3}))
    b.add(item(usage={"prompt_tokens": 4}))
    assert a.usage == {"prompt_tokens": 2, "completion_tokens": 3}
    assert oc.total_usage([a, b]) == {"prompt_tokens": 6, "completion_tokens": 3,
                                      "total_tokens": 9}
    assert oc.total_usage([oc.PromptCalls(0, 1)]) is None
    out = oc.body_of({"id": "cmpl-1"}, [a, b], logprobs=False)
    assert out["id"] == "cmpl-1" and out["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"])
            for c in out["choices"]] == [(0, "", "stop", None), (1, "x", "stop", None),
                                         (2, "", "stop", None), (3, "y", "stop", None)]
    with_lp = oc.body_of({}, [a], logprobs=True)["choices"][1]["logprobs"]
    assert with_lp == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _target() -> directory.Target:
    return directory._target("app", {"name": "complete"}, 1, False)


def _events(chunks: list[bytes]) -> list[Any]:
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n")
        body = c[len(b"data: "):-2]
        out.append(body.decode() if body == b"[DONE]" else json.loads(body))
    return out


def test_the_streamed_answer_items_then_finishes_usage_and_done() -> None:
    async def go() -> None:
        e = entry()
        runs = []
        for i in range(2):
            sub = calls.submit(e, _target(), [], {"prompt": str(i)}, {})
            runs.append((sub, oc.PromptCalls(first=i, n=1)))
        gen = oc.stream_chunks(e, runs, "app.complete", {"id": "cmpl-x"}, logprobs=True,
                               include_usage=True)
        got: list[bytes] = []
        reader = asyncio.ensure_future(_read(gen, got))
        await settle()
        (s0, _), (s1, _) = runs
        q0, q1 = e.client.streams[s0.invocation_id], e.client.streams[s1.invocation_id]
        q1.put(_item(s1.invocation_id, 0, {"text": "B", "tokens": ["B"], "token_logprobs": [-1]}))
        q0.put(_item(s0.invocation_id, 0, "A"))
        q0.put(_item(s0.invocation_id, 1, {"finish_reason": "length",
                                           "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
        e.client.submitted[s0.invocation_id].set_result(result(s0.invocation_id))
        e.client.submitted[s1.invocation_id].set_result(result(s1.invocation_id))
        await asyncio.wait_for(reader, 5)
        events = _events(got)
        assert events[-1] == "[DONE]"
        pieces = [(ev["choices"][0]["index"], ev["choices"][0]["text"]) for ev in events[:2]]
        assert sorted(pieces) == [(0, "A"), (1, "B")]
        lp = next(ev["choices"][0]["logprobs"] for ev in events[:2]
                  if ev["choices"][0]["index"] == 1)
        assert lp["tokens"] == ["B"] and lp["token_logprobs"] == [-1]
        finishes = [(ev["choices"][0]["index"], ev["choices"][0]["finish_reason"])
                    for ev in events[2:4]]
        assert finishes == [(0, "length"), (1, "stop")]
        assert events[4]["choices"] == [] and events[4]["usage"] == {
            "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        assert all(ev["id"] == "cmpl-x" and ev["object"] == "text_completion"
                   for ev in events[:-1])
        assert e.client.cancels == [] and e.inflight == 0

    asyncio.run(go())


async def _read(gen: Any, into: list[bytes]) -> None:
    async for chunk in gen:
        into.append(chunk)


def test_a_failed_stream_ends_with_an_error_event_and_cancels_the_others() -> None:
    async def go() -> None:
        for failure in ("result", "lost"):
            e = entry()
            runs = []
            for i in range(2):
                sub = calls.submit(e, _target(), [], {"prompt": str(i)}, {})
                runs.append((sub, oc.PromptCalls(first=i, n=1)))
            got: list[bytes] = []
            reader = asyncio.ensure_future(_read(oc.stream_chunks(
                e, runs, "app.complete", {"id": "c"}, logprobs=False, include_usage=False), got))
            await settle()
            (s0, _), (s1, _) = runs
            e.client.streams[s1.invocation_id].put(_item(s1.invocation_id, 0, "B"))
            await settle()
            fut = e.client.submitted[s0.invocation_id]
            if failure == "result":
                fut.set_result(result(s0.invocation_id, ok=False, kind="ValueError",
                                      message="bad prompt"))
            else:
                fut.set_exception(ConnectionLost("the scheduler went away"))
            await asyncio.wait_for(reader, 5)
            events = _events(got)
            assert events[0]["choices"][0]["text"] == "B" and events[0]["choices"][0][
                "logprobs"] is None
            assert "error" in events[-1] and "[DONE]" not in events
            assert ("bad prompt" if failure == "result" else "went away") in events[-1][
                "error"]["message"]
            assert [inv for inv, _ in e.client.cancels] == [s1.invocation_id]
            assert e.inflight == 0

    asyncio.run(go())


def _runs(e: Any, n_prompts: int, n: int = 1) -> list[Any]:
    runs = []
    for i in range(n_prompts):
        sub = calls.submit(e, _target(), [], {"prompt": str(i)}, {})
        runs.append((sub, oc.PromptCalls(first=i * n, n=n)))
    return runs


def test_streamed_finishes_name_every_choice_of_every_prompt() -> None:
    async def go() -> None:
        e = entry()
        runs = _runs(e, 2, n=2)
        got: list[bytes] = []
        reader = asyncio.ensure_future(_read(oc.stream_chunks(
            e, runs, "app.complete", {}, logprobs=False, include_usage=False), got))
        await settle()
        for sub, _ in runs:
            e.client.streams[sub.invocation_id].put(_item(sub.invocation_id, 0, {
                "text": "t", "index": 1, "finish_reason": "length"}))
            e.client.submitted[sub.invocation_id].set_result(result(sub.invocation_id))
        await asyncio.wait_for(reader, 5)
        finishes = [(ev["choices"][0]["index"], ev["choices"][0]["finish_reason"])
                    for ev in _events(got)[2:-1]]
        assert finishes == [(0, "stop"), (1, "length"), (2, "stop"), (3, "length")]

    asyncio.run(go())


def test_a_stream_that_cannot_start_or_breaks_its_order_ends_with_its_error() -> None:
    async def go() -> None:
        e = entry()
        runs = _runs(e, 2)

        def lost(sub: Any, name: str) -> Any:
            raise ConnectionLost("the scheduler at tcp://sched:1 went away")

        e.client.submit_stream = lost  # type: ignore[method-assign]
        got: list[bytes] = []
        await asyncio.wait_for(_read(oc.stream_chunks(
            e, runs, "app.complete", {}, logprobs=False, include_usage=False), got), 5)
        assert "went away" in _events(got)[-1]["error"]["message"]

        e = entry()
        runs = _runs(e, 1)
        got = []
        reader = asyncio.ensure_future(_read(oc.stream_chunks(
            e, runs, "app.complete", {}, logprobs=False, include_usage=False), got))
        await settle()
        (sub, _), = runs
        e.client.streams[sub.invocation_id].put(_item(sub.invocation_id, 3, "late"))
        await asyncio.wait_for(reader, 5)
        assert "error" in _events(got)[-1] and e.inflight == 0

    asyncio.run(go())


def test_a_stream_closed_early_cancels_its_calls_before_it_returns() -> None:
    async def go() -> None:
        e = entry()
        runs = _runs(e, 2)
        gen = oc.stream_chunks(e, runs, "app.complete", {}, logprobs=False,
                               include_usage=False)
        first = asyncio.ensure_future(gen.__anext__())
        await settle()
        (s0, _), (s1, _) = runs
        e.client.streams[s0.invocation_id].put(_item(s0.invocation_id, 0, "a"))
        assert b'"a"' in await asyncio.wait_for(first, 5)
        await gen.aclose()  # the HTTP client left
        assert sorted(inv for inv, _ in e.client.cancels) == sorted(
            [s0.invocation_id, s1.invocation_id])
        assert e.inflight == 0

    asyncio.run(go())
