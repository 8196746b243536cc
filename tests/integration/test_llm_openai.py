"""The shipped example examples/llm_openai.py deployed on a real `gpufn serve --http-port`:
`tiny-llama` on the stepped transformers engine answers the `openai` client as a chat model
(streamed and not, the same text) and as a completion model (echo with log-probabilities,
max_tokens 0 as lm-evaluation-harness asks), and 16 concurrent chats share the engine's
steps while each gets exactly its alone answer."""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("transformers")

import gpufn  # noqa: E402

from .http_served import ServedGateway  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llm_openai.py"


@pytest.fixture(scope="module")
def oai(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    s = ServedGateway(tmp_path_factory.mktemp("llm"))
    s.start()
    try:
        client = s.client()
        try:
            s.wait_ready(client)
            gpufn.deploy(EXAMPLE, name="llm", client=client)
        finally:
            client.close()
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key=s.token, max_retries=0, timeout=120)
    finally:
        s.stop()


def _chat(oai: Any, content: str, n: int = 12) -> str:
    r = oai.chat.completions.create(model="tiny-llama", max_tokens=n,
                                    messages=[{"role": "user", "content": content}])
    return str(r.choices[0].message.content)


def test_chat_streamed_and_not_agree(oai: Any) -> None:
    msgs = [{"role": "user", "content": "Tell me about GPUs."}]
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=12, stream=True) if c.choices)
    whole = oai.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=12)
    assert whole.choices[0].message.content == streamed and streamed
    assert whole.usage.completion_tokens == 12


def test_concurrent_chats_each_get_their_alone_answer(oai: Any) -> None:
    questions = [f"Question {i}: what is a GPU?" for i in range(16)]
    alone = [_chat(oai, q) for q in questions[:4]]
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda q: _chat(oai, q), questions))
    assert together[:4] == alone


def test_completion_echo_logprobs_for_a_log_likelihood(oai: Any) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    r = oai.completions.create(model="tiny-llama", prompt=prompt, max_tokens=0, echo=True,
                               logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt
    lps = choice.logprobs
    assert lps.token_logprobs[0] is None and len(lps.tokens) == len(lps.token_logprobs) > 3
    assert all(v <= 0 and math.isfinite(v) for v in lps.token_logprobs[1:])
    assert "".join(lps.tokens) == prompt
    more = oai.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, logprobs=2)
    assert len(more.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) <= 2 for t in more.choices[0].logprobs.top_logprobs)
