"""The OpenAI routes against a real `gpufn serve --http-port`, driven by the clients users
run: the official `openai` package (chat, completions with echo and logprobs, embeddings,
models.retrieve, every refusal a 400 naming its `param`), `langchain-openai` and `litellm`.
Models: examples/openai_completions.py (`tiny-gpt2`, chat and completion),
examples/embeddings.py (`mini-bert`) and tests/integration/openai_app.py."""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("transformers")

import gpufn  # noqa: E402

from .http_served import ServedGateway  # noqa: E402

pytestmark = pytest.mark.timeout(240)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
APP = Path(__file__).with_name("openai_app.py")
MESSAGES = [{"role": "user", "content": "Tell me about GPUs."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    s = ServedGateway(tmp_path_factory.mktemp("oai"))
    s.start()
    try:
        client = s.client()
        try:
            s.wait_ready(client)
            gpufn.deploy(EXAMPLES / "openai_completions.py", name="gpt", client=client)
            gpufn.deploy(EXAMPLES / "embeddings.py", name="emb", client=client)
            gpufn.deploy(APP, name="oa", client=client)
        finally:
            client.close()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def oai(served: ServedGateway) -> Any:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.token, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def example() -> Any:
    """examples/openai_completions.py, imported here for its local reference run."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import openai_completions
    finally:
        sys.path.remove(str(EXAMPLES))
    return openai_completions


def refused(call: Any, param: str) -> Any:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["code"], err
    return err


# --------------------------------------------------------------------------- openai


def test_models_list_and_retrieve(oai: Any) -> None:
    ids = {m.id for m in oai.models.list()}
    assert {"tiny-gpt2", "mini-bert", "tooling", "multi"} <= ids
    m = oai.models.retrieve("tiny-gpt2")
    assert m.id == "tiny-gpt2" and m.owned_by == "gpt"
    assert m.model_extra["gpufn"]["roles"] == {"chat": "chat", "completion": "complete"}
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["type"] == "not_found_error" and e.value.body["code"] == "model_not_found"


def test_echo_with_zero_max_tokens_gives_the_prompts_logprobs(oai: Any, example: Any) -> None:
    """What lm-evaluation-harness sends for a log-likelihood, equal to a local full forward."""
    import torch

    prompt = "The GPU runs the model"
    out = oai.completions.create(model="tiny-gpt2", prompt=prompt, echo=True, max_tokens=0,
                                 logprobs=1, temperature=0)
    c = out.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    tok = example.build_tokenizer()
    ids = tok.encode(prompt)
    assert c.logprobs.tokens == [tok.decode([i]) for i in ids]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    model = example.build_model(len(tok))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    want = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0


def test_token_id_prompts_in_a_batch_and_the_stream(oai: Any, example: Any) -> None:
    tok = example.build_tokenizer()
    batch = [tok.encode("Paris is the capital of"), tok.encode("The GPU")]
    out = oai.completions.create(model="tiny-gpt2", prompt=batch, echo=True, max_tokens=1,
                                 logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for c, ids in zip(out.choices, batch, strict=True):
        assert len(c.logprobs.token_logprobs) == len(ids) + 1  # lm-eval drops the last
        assert all(len(t) == 2 for t in c.logprobs.top_logprobs[1:])
    plain = oai.completions.create(model="tiny-gpt2", prompt=["a", "The GPU"], max_tokens=6)
    chunks = list(oai.completions.create(model="tiny-gpt2", prompt=["a", "The GPU"],
                                         max_tokens=6, stream=True,
                                         stream_options={"include_usage": True}))
    for i in (0, 1):
        text = "".join(ch.choices[0].text for ch in chunks
                       if ch.choices and ch.choices[0].index == i)
        assert text == plain.choices[i].text and text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 12


def test_stop_and_n_declared(oai: Any) -> None:
    out = oai.completions.create(model="multi", prompt=["x", "y"], n=2)
    assert [(c.index, c.text) for c in out.choices] == [(0, "x#0"), (1, "x#1"), (2, "y#0"),
                                                        (3, "y#1")]
    assert out.usage.total_tokens == 6
    full = oai.completions.create(model="tiny-gpt2", prompt="The GPU", max_tokens=8).choices[0]
    cut = full.text[3:6]
    stopped = oai.completions.create(model="tiny-gpt2", prompt="The GPU", max_tokens=8,
                                     stop=[cut]).choices[0]
    assert stopped.text == full.text[:full.text.find(cut)] and stopped.finish_reason == "stop"


def test_chat_on_the_same_model(oai: Any) -> None:
    answer = oai.chat.completions.create(model="tiny-gpt2", messages=MESSAGES, max_tokens=5)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in oai.chat.completions.create(
        model="tiny-gpt2", messages=MESSAGES, max_tokens=5, stream=True) if ch.choices)
    assert answer.choices[0].message.content == streamed and streamed


def test_embeddings_float_base64_dimensions_and_usage(oai: Any) -> None:
    texts = [f"text number {i} about GPUs" for i in range(40)]
    out = oai.embeddings.create(model="mini-bert", input=texts)
    assert [d.index for d in out.data] == list(range(40))
    assert all(len(d.embedding) == 64 for d in out.data) and out.usage.prompt_tokens > 40
    raw = oai.embeddings.with_raw_response.create(model="mini-bert", input=texts[:2],
                                                  encoding_format="base64").http_response.json()
    first = struct.unpack("<64f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(first) == pytest.approx(out.data[0].embedding, abs=1e-6)
    small = oai.embeddings.create(model="mini-bert", input=[[5, 6, 7]], dimensions=16)
    assert len(small.data[0].embedding) == 16 and small.usage.prompt_tokens == 3
    assert sum(x * x for x in small.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    # the inputs of a request are calls that dynamic batching runs together
    sizes = [d.embedding[0] for d in oai.embeddings.create(model="batchy",
                                                           input=[f"t{i}" for i in range(16)]).data]
    assert max(sizes) > 1, sizes
    refused(lambda: oai.embeddings.create(model="batchy", input="x", dimensions=4), "dimensions")


def test_every_undeclared_parameter_is_refused_by_name(oai: Any) -> None:
    chat = oai.chat.completions.create
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for param, value in [("tools", [tool]), ("tool_choice", "required"),
                         ("response_format", {"type": "json_object"}), ("logprobs", True),
                         ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                         ("logit_bias", {"5": 10}), ("top_p", 0.5), ("n", 2)]:
        err = refused(lambda p=param, v=value: chat(model="tiny-gpt2", messages=MESSAGES,
                                                     **{p: v}), param)
        assert err["code"] == "unsupported_parameter" and param in err["message"]
    refused(lambda: chat(model="tiny-gpt2", messages=MESSAGES, extra_body={"top_k": 5}), "top_k")
    comp = oai.completions.create
    for param, value in [("n", 2), ("best_of", 2), ("logit_bias", {"5": 1}),
                         ("presence_penalty", 1.0), ("suffix", "!")]:
        refused(lambda p=param, v=value: comp(model="tiny-gpt2", prompt="x", **{p: v}), param)
    refused(lambda: comp(model="tiny-gpt2", prompt="x", logprobs=50), "logprobs")
    refused(lambda: comp(model="tiny-gpt2", prompt=[], max_tokens=1), "prompt")
    refused(lambda: oai.embeddings.create(model="mini-bert", input="x",
                                          extra_body={"truncate": True}), "truncate")
    refused(lambda: oai.embeddings.create(model="mini-bert", input=""), "input")
    # neutral values change nothing: accepted
    chat(model="tiny-gpt2", messages=MESSAGES, max_tokens=2, n=1, presence_penalty=0,
         logit_bias={})


def test_tools_and_response_format_reach_a_model_that_declares_them(oai: Any) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    out = oai.chat.completions.create(model="tooling", messages=MESSAGES, tools=[tool],
                                      tool_choice="required")
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"x": 1})
    js = oai.chat.completions.create(model="tooling", messages=MESSAGES,
                                     response_format={"type": "json_object"})
    assert json.loads(js.choices[0].message.content) == {"name": "gpu", "count": 2}


def test_errors_in_openais_shape_with_request_ids_and_no_traceback(served: ServedGateway,
                                                                    oai: Any) -> None:
    with httpx.Client(base_url=served.url, timeout=60,
                      headers={"Authorization": f"Bearer {served.token}"}) as http:
        for path in ("/healthz", "/v1/apps", "/v1/models", "/nope"):
            assert http.get(path).headers["x-request-id"].startswith("req_")
        assert http.get("/healthz", headers={"x-request-id": "mine-1"}).headers[
            "x-request-id"] == "mine-1"
        r = http.post("/v1/chat/completions", json={"model": "broken", "messages": MESSAGES})
        err = r.json()["error"]
        assert r.status_code == 500 and err["type"] == "server_error", err
        assert err["message"] == "RuntimeError: boom mid-stream" and set(err) == {
            "message", "type", "param", "code"}
        rid = r.headers["x-request-id"]
        text = http.post("/v1/chat/completions", json={
            "model": "broken", "messages": MESSAGES, "stream": True}).text
        assert "boom mid-stream" in text and "Traceback" not in text and ".py" not in text
        r = httpx.get(f"{served.url}/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert rid in served.log() and 'raise RuntimeError("boom mid-stream")' in served.log()
    with pytest.raises(openai.APIError, match="boom mid-stream"):
        list(oai.chat.completions.create(model="broken", messages=MESSAGES, stream=True))
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="tiny-gpt2", input="x")  # a chat/completion model


# --------------------------------------------------------------------------- langchain, litellm


def test_langchain_invoke_stream_batch_and_structured_output_refused(served: ServedGateway) -> None:
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    llm = lc.ChatOpenAI(model="tiny-gpt2", base_url=f"{served.url}/v1", api_key=served.token,
                        max_tokens=6, temperature=0, max_retries=0)
    text = llm.invoke("Hello").content
    assert text and "".join(c.content for c in llm.stream("Hello")) == text
    assert [m.content for m in llm.batch(["Hello", "Hello"])] == [text, text]

    class Answer(BaseModel):
        name: str

    with pytest.raises(openai.BadRequestError) as e:
        llm.with_structured_output(Answer).invoke("Hello")
    assert e.value.body["param"] in ("response_format", "tools"), e.value.body
    tooling = lc.ChatOpenAI(model="tooling", base_url=f"{served.url}/v1", api_key=served.token,
                            max_retries=0)
    got = tooling.with_structured_output(Answer, method="json_mode").invoke("Hello")
    assert got == Answer(name="gpu")


def test_litellm_sync_and_streaming(served: ServedGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    kw = {"model": "openai/tiny-gpt2", "api_base": f"{served.url}/v1",
          "api_key": served.token, "messages": MESSAGES, "max_tokens": 5}
    text = litellm.completion(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       litellm.completion(stream=True, **kw))
    assert text and streamed == text
    out = litellm.text_completion(model="text-completion-openai/tiny-gpt2",
                                  api_base=f"{served.url}/v1", api_key=served.token,
                                  prompt="The GPU", max_tokens=4)
    assert out.choices[0].text



def test_the_clients_reach_no_network_at_import() -> None:
    """litellm fetches a model cost map at import unless LITELLM_LOCAL_MODEL_COST_MAP=True."""
    import subprocess

    pytest.importorskip("litellm")
    pytest.importorskip("langchain_openai")
    code = ("import socket\ncalls = []\n"
            "def guard(self, addr):\n    calls.append(addr)\n    raise OSError('blocked')\n"
            "socket.socket.connect = guard\n"
            "import litellm, langchain_openai, openai\nprint(calls)\n")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
