"""The OpenAI gateway's pure pieces: the declared-parameter rule, neutral values, value
checks, prompt and input forms, completion items with logprobs, embeddings in base64,
OpenAI's error shape with no traceback, and the three model decorators."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import pytest

import gpufn
from gpufn.wire import interface as iface

pytest.importorskip("starlette")

from gpufn.http import openai_completions as oc
from gpufn.http import openai_embeddings as oe
from gpufn.http.errors import HTTPError, from_result, public
from gpufn.http.openai_params import declared, function_kwargs
from gpufn.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


def _complete(prompt: str, max_tokens: int = 16, *, echo: bool = False,
              logprobs: int | None = None) -> Iterator[str]:
    yield prompt


def test_a_function_declares_what_its_signature_names_or_its_params_list() -> None:
    d = iface.describe(_complete)
    assert declared(d, "completion") == {"max_tokens", "echo", "logprobs"}
    assert declared({**d, "openai": {"completion": "m", "params": ["max_tokens"]}},
                    "completion") == {"max_tokens"}

    def kw(messages: list[Any], **params: Any) -> Iterator[str]:
        yield ""

    assert declared(iface.describe(kw), "chat") == frozenset()  # **kwargs declares nothing


def test_undeclared_parameters_are_refused_by_name_and_neutral_ones_are_not_set() -> None:
    accepts = frozenset({"max_tokens", "echo", "logprobs", "logit_bias"})
    got = function_kwargs({"model": "m", "prompt": "x", "max_tokens": 0, "echo": True,
                           "logprobs": 1, "n": 1, "presence_penalty": 0, "best_of": None,
                           "logit_bias": {"7": -100}, "stream": False}, "completion",
                          accepts, "m")
    assert got == {"max_tokens": 0, "echo": True, "logprobs": 1, "logit_bias": {7: -100.0}}
    for param, value in [("n", 2), ("presence_penalty", 0.1), ("suffix", "!"), ("top_k", 3),
                         ("tools", [{"type": "function"}])]:
        with pytest.raises(HTTPError) as e:
            function_kwargs({"model": "m", param: value}, "completion", accepts, "m")
        assert (e.value.status, e.value.param, e.value.code) == (400, param,
                                                                  "unsupported_parameter")
    for param, value in [("logprobs", 21), ("logit_bias", {"x": 1}), ("max_tokens", -1),
                         ("echo", "yes")]:
        with pytest.raises(HTTPError) as e:
            function_kwargs({param: value}, "completion", accepts | {param}, "m")
        assert (e.value.param, e.value.code) == (param, "invalid_value")
    with pytest.raises(HTTPError) as e:  # chat: max_tokens from 1, logprobs a bool
        function_kwargs({"max_tokens": 0}, "chat", frozenset({"max_tokens"}), "m")
    assert function_kwargs({"logprobs": False, "top_logprobs": 0}, "chat", frozenset(), "m") == {}


def test_prompt_and_input_forms() -> None:
    assert oc.prompts({"prompt": "a"}) == ["a"]
    assert oc.prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    assert oc.prompts({"prompt": [1, 2]}) == [[1, 2]]
    assert oc.prompts({"prompt": [[1], [2, 3]]}) == [[1], [2, 3]]
    for bad in ([], [1, "a"], 5, None, [[1], "a"], [True]):
        with pytest.raises(HTTPError) as e:
            oc.prompts({"prompt": bad})
        assert e.value.param == "prompt"
    assert oe.inputs({"input": [[4, 5]]}) == [[4, 5]]
    with pytest.raises(HTTPError):
        oe.inputs({"input": ["ok", ""]})


def test_completion_items_build_openais_legacy_logprobs() -> None:
    part = oc.PromptCalls(first=0, n=1)
    part.add(json.dumps({"text": "The GPU", "tokens": ["The", " GPU"],
                         "token_logprobs": [None, -1.5],
                         "top_logprobs": [None, {" GPU": -1.5}]}).encode())
    part.add(b'" runs"')  # a bare text piece (no logprobs asked of it)
    part.add(json.dumps({"text": "!", "tokens": ["!"], "token_logprobs": [-0.5],
                         "top_logprobs": [{"!": -0.5}], "finish_reason": "length",
                         "usage": {"prompt_tokens": 2, "completion_tokens": 2}}).encode())
    out = oc.body_of({"id": "x"}, [part], logprobs=True)
    c = out["choices"][0]
    assert c["text"] == "The GPU runs!" and c["finish_reason"] == "length"
    assert c["logprobs"] == {"tokens": ["The", " GPU", "!"], "token_logprobs": [None, -1.5, -0.5],
                             "top_logprobs": [None, {" GPU": -1.5}, {"!": -0.5}],
                             "text_offset": [0, 3, 12]}
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    with pytest.raises(HTTPError):
        part.add(b'{"tokens": ["a"], "token_logprobs": [1, 2]}')
    with pytest.raises(HTTPError):
        part.add(b'{"text": "a", "index": 3}')


def test_embeddings_in_float_and_base64() -> None:
    emb, tokens = oe.item(b'{"embedding": [0.5, -1.0], "tokens": 3}', 0, "base64", None)
    assert struct.unpack("<2f", base64.b64decode(emb["embedding"])) == (0.5, -1.0) and tokens == 3
    assert oe.item(b"[1, 2]", 1, "float", 2)[0] == {"object": "embedding", "index": 1,
                                                    "embedding": [1.0, 2.0]}
    with pytest.raises(HTTPError):
        oe.item(b"[1, 2]", 0, "float", 3)  # asked for 3 dimensions


def test_openai_error_shape_and_no_traceback() -> None:
    res = p.Result("i", False, "", "bad", p.ResultMeta(error_type="KeyError",
                                                        traceback='File "/srv/x.py", line 1'))
    err = from_result(res)
    assert err.openai() == {"message": "KeyError: bad", "type": "server_error", "param": None,
                            "code": "key_error"}
    load = from_result(p.Result("i", False, "ModelLoadError", "model m raised ImportError: no\n"
                                "Traceback (most recent call last):\n  File \"/srv/a.py\", line 2"))
    assert load.message == "model m raised ImportError: no" and "/srv" not in load.openai_body().decode()
    assert public('x\n  File "/a.py", line 3, in f\ny') == "x\ny"
    types = {s: HTTPError(s, "K", "m").openai()["type"] for s in (400, 401, 403, 404, 429, 503)}
    assert types == {400: "invalid_request_error", 401: "authentication_error",
                     403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
                     503: "server_error"}
    assert HTTPError(429, "QueueFull", "m").openai()["code"] == "queue_full"


def test_the_model_decorators() -> None:
    from gpufn.api.chat import model_names, openai_interface

    @gpufn.completion_model("tiny", params=["max_tokens", "echo"])
    @gpufn.gpu
    def complete(prompt: str, **params: Any) -> Iterator[str]:
        yield prompt

    @gpufn.embedding_model("enc")
    @gpufn.gpu(batch_size=4)
    def embed(input: list[str], dimensions: list[int | None]) -> list[list[float]]:
        return [[1.0] for _ in input]

    assert model_names(complete) == {"completion": "tiny"}
    assert openai_interface(complete) == {"completion": "tiny", "params": ["max_tokens", "echo"]}
    assert openai_interface(embed) == {"embedding": "enc"}
    with pytest.raises(gpufn.InvalidSpec, match="does not accept"):
        gpufn.completion_model("m", params=["echo"])(gpufn.gpu(_complete_fixed))
    with pytest.raises(gpufn.InvalidSpec, match="a list of parameter names"):
        gpufn.chat_model("m", params="tools")
    with pytest.raises(gpufn.InvalidSpec, match="returns one embedding"):
        gpufn.embedding_model("m")(gpufn.gpu(_complete))
    with pytest.raises(gpufn.InvalidSpec, match="generator"):
        gpufn.completion_model("m")(gpufn.gpu(lambda prompt: "x"))


def _complete_fixed(prompt: str) -> Iterator[str]:
    yield prompt
