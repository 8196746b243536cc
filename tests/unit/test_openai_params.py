"""Every OpenAI parameter either reaches the model function, checked, or is refused by name:
the declared-parameter rule, neutral values, each value check at its bounds, the route's own
checks, the `max_completion_tokens` alias and the cross checks (gpufn/http/openai_params.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("starlette")

from gpufn.http import openai_params as op
from gpufn.http.errors import HTTPError

pytestmark = pytest.mark.timeout(30)

EVERYTHING = frozenset({*op.CHECKS, "max_tokens", "logprobs", "top_k", "metadata"})


def kwargs(route: str, **body: Any) -> dict[str, Any]:
    return op.function_kwargs(body, route, EVERYTHING, "m")


def refused(route: str, param: str, value: Any, code: str = "invalid_value") -> HTTPError:
    with pytest.raises(HTTPError) as e:
        op.function_kwargs({param: value}, route, EVERYTHING, "m")
    assert (e.value.status, e.value.type, e.value.param, e.value.code) == (
        400, "invalid_request_error", param, code)
    return e.value


@pytest.mark.parametrize("param, low, high", [
    ("temperature", 0, 2), ("top_p", 0, 1), ("presence_penalty", -2, 2),
    ("frequency_penalty", -2, 2)])
def test_numbers_are_taken_within_their_bounds_as_floats(param: str, low: float,
                                                         high: float) -> None:
    for v in (low, high, (low + high) / 2 + 0.25):
        if v in op.NEUTRAL.get(param, ()):
            continue
        got = kwargs("chat", **{param: v})[param]
        assert got == v and type(got) is float
    for v in (low - 0.001, high + 0.001, math.nan, math.inf, -math.inf, True, "1", [1]):
        err = refused("chat", param, v)
        if not isinstance(v, str):
            assert f"{param} must be a number from {low:g} to {high:g}, got {v!r}" in err.message


@pytest.mark.parametrize("route, param, low, high", [
    ("chat", "seed", -(2**63), 2**64 - 1), ("chat", "n", 1, 128), ("completion", "best_of", 1, 128),
    ("chat", "top_logprobs", 0, 20), ("embedding", "dimensions", 1, 65536),
    ("chat", "max_tokens", 1, 2**31 - 1), ("completion", "max_tokens", 0, 2**31 - 1),
    ("completion", "logprobs", 0, 20)])
def test_integers_are_taken_within_their_bounds(route: str, param: str, low: int,
                                                high: int) -> None:
    extra = {"logprobs": True} if param == "top_logprobs" else {}
    for v in (low, high):
        if v in op.NEUTRAL.get(param, ()) or v in op.NEUTRAL_BY_ROUTE[route].get(param, ()):
            continue
        body = {param: v, **extra}
        if param == "best_of":
            body["n"] = min(v, 2) if v > 1 else 1
        got = op.function_kwargs(body, route, EVERYTHING, "m")[param]
        assert got == v and type(got) is int
    for v in (low - 1, high + 1, 2.0, True, "3"):
        err = refused(route, param, v)
        assert f"{param} must be an integer from {low} to {high}, got {v!r}" in err.message


def test_stop_is_a_string_or_up_to_four_non_empty_strings() -> None:
    assert kwargs("chat", stop="\n")["stop"] == ["\n"]
    assert kwargs("chat", stop=["a", "b", "c", "d"])["stop"] == ["a", "b", "c", "d"]
    for v in ("", ["a", ""], ["a"] * 5, [1], 3, {"a": 1}):
        assert "at most 4 non-empty strings" in refused("chat", "stop", v).message


def test_logit_bias_maps_token_ids_to_a_bias_from_minus_to_plus_100() -> None:
    got = kwargs("completion", logit_bias={"50256": -100, 7: 100, "3": 0.5})["logit_bias"]
    assert got == {50256: -100.0, 7: 100.0, 3: 0.5}
    assert all(type(k) is int and type(b) is float for k, b in got.items())
    assert "keys are token ids (digits), got 'x'" in refused("chat", "logit_bias", {"x": 1}).message
    assert "got '-1'" in refused("chat", "logit_bias", {"-1": 1}).message
    refused("chat", "logit_bias", {"1": 100.5})
    refused("chat", "logit_bias", {"1": -101})
    assert "map token ids to biases" in refused("chat", "logit_bias", [1]).message


def test_flags_objects_tools_and_formats() -> None:
    assert kwargs("completion", echo=True) == {"echo": True}
    assert kwargs("chat", parallel_tool_calls=False) == {"parallel_tool_calls": False}
    assert "echo must be true or false, got 1" in refused("completion", "echo", 1).message
    refused("chat", "parallel_tool_calls", "no")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert kwargs("chat", tools=tools)["tools"] == tools
    assert "a list of tool objects" in refused("chat", "tools", [tools[0], "x"]).message
    refused("chat", "tools", {"type": "function"})
    for choice in ("none", "auto", "required", {"type": "function"}):
        assert kwargs("chat", tool_choice=choice)["tool_choice"] == choice
    assert '"none", "auto", "required"' in refused("chat", "tool_choice", "always").message
    for fmt in ("json_object", "json_schema"):
        assert kwargs("chat", response_format={"type": fmt}) == {"response_format": {"type": fmt}}
    refused("chat", "response_format", {"type": "yaml"})
    refused("chat", "response_format", "json_object")
    assert kwargs("chat", metadata={"a": "b"}) == {"metadata": {"a": "b"}}  # unchecked: as sent
    assert kwargs("chat", top_k=5) == {"top_k": 5}  # not OpenAI's: passed as it came
    assert op.CHECKS["stream_options"]("stream_options", {"a": 1}) == {"a": 1}
    with pytest.raises(HTTPError, match="stream_options must be an object, got list"):
        op.CHECKS["stream_options"]("stream_options", [])


def test_null_and_neutral_values_count_as_not_sent() -> None:
    body = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
            "logit_bias": {}, "echo": False, "suffix": "", "tools": [],
            "parallel_tool_calls": True, "store": False, "metadata": {},
            "response_format": {"type": "text"}, "temperature": None}
    assert op.function_kwargs(body, "completion", frozenset(), "m") == {}
    assert op.function_kwargs({"logprobs": False, "top_logprobs": 0}, "chat", frozenset(),
                              "m") == {}
    # neutral by type as well as value: True is not n=1, 0.0 is presence_penalty 0 only as an int
    assert not op.is_set("chat", "n", 1) and op.is_set("chat", "n", True)
    assert op.is_set("chat", "presence_penalty", 0.0) and not op.is_set("chat", "echo", False)
    assert op.is_set("completion", "logprobs", False)  # only chat's logprobs is a flag
    assert op.is_set("chat", "top_k", 0) and not op.is_set("embedding", "user", None)


def test_what_the_gateway_handles_never_reaches_the_function() -> None:
    for route, names in op.HANDLED.items():
        body = {name: "x" for name in names}
        assert op.function_kwargs(body, route, frozenset(), "m") == {}
    refused("embedding", "stream", True, "unsupported_parameter")  # not handled there


def test_an_undeclared_parameter_is_named_with_what_the_model_handles() -> None:
    with pytest.raises(HTTPError) as e:
        op.function_kwargs({"temperature": 0.5}, "chat", frozenset({"top_p", "max_tokens"}),
                           "tiny")
    assert e.value.param == "temperature" and e.value.code == "unsupported_parameter"
    assert e.value.message == (
        "tiny does not handle the parameter 'temperature' (it handles: max_tokens, top_p); "
        "leave it out, or deploy a model function that declares it")
    with pytest.raises(HTTPError, match=r"\(it handles: none\)"):
        op.function_kwargs({"temperature": 0.5}, "chat", frozenset(), "tiny")


def test_max_completion_tokens_is_chats_newer_name_for_max_tokens() -> None:
    accepts = frozenset({"max_tokens"})
    assert op.function_kwargs({"max_completion_tokens": 9}, "chat", accepts, "m") == {
        "max_tokens": 9}
    assert op.function_kwargs({"max_completion_tokens": 9, "max_tokens": None}, "chat",
                              accepts, "m") == {"max_tokens": 9}
    assert op.function_kwargs({"max_completion_tokens": 9, "max_tokens": 4}, "chat",
                              accepts, "m") == {"max_tokens": 4}
    with pytest.raises(HTTPError) as e:  # only chat knows the alias
        op.function_kwargs({"max_completion_tokens": 9}, "completion", accepts, "m")
    assert e.value.param == "max_completion_tokens"
    body = {"max_completion_tokens": 9}
    op.function_kwargs(body, "chat", accepts, "m")
    assert body == {"max_completion_tokens": 9}  # the request's own body is left alone


def test_cross_checks() -> None:
    with pytest.raises(HTTPError, match="top_logprobs needs logprobs: true") as e:
        kwargs("chat", top_logprobs=3)
    assert e.value.param == "top_logprobs"
    assert kwargs("chat", top_logprobs=3, logprobs=True) == {"top_logprobs": 3, "logprobs": True}
    assert kwargs("completion", top_logprobs=3) == {"top_logprobs": 3}  # chat's rule only
    with pytest.raises(HTTPError, match="best_of must be at least n") as e:
        kwargs("completion", best_of=2, n=3)
    assert e.value.param == "best_of"
    assert kwargs("completion", best_of=3, n=3) == {"best_of": 3, "n": 3}
    assert kwargs("completion", best_of=2) == {"best_of": 2}


def test_declared_parameters_come_from_the_params_list_or_the_signature() -> None:
    params = [{"name": "messages", "kind": "POSITIONAL_OR_KEYWORD"},
              {"name": "temperature", "kind": "KEYWORD_ONLY"},
              {"name": "args", "kind": "VAR_POSITIONAL"}, {"name": "kw", "kind": "VAR_KEYWORD"},
              {"name": "pos", "kind": "POSITIONAL_ONLY"}]
    assert op.declared({"params": params}, "chat") == {"temperature"}  # its data param is not one
    assert op.declared({"params": params}, "completion") == {"messages", "temperature"}
    assert op.declared({"params": params, "openai": {"params": ["n", 3]}}, "chat") == {"n", "3"}
    assert op.declared({"params": params, "openai": {"params": "n"}}, "chat") == {"temperature"}
    assert op.declared({"openai": None}, "embedding") == frozenset()
