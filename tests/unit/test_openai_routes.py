"""The OpenAI routes themselves (gpufn/http/openai_routes.py) over a stand-in gateway and the
gateway tests' stand-in connection: models listed and looked up, the request checked before
any call, chat and completions answered whole and streamed, embeddings in order, a client
that leaves answered 499 with its calls cancelled. The same routes over a real scheduler and
the `openai` client: tests/integration/test_openai_clients.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("starlette")

from starlette.requests import Request

from gpufn.http import openai_routes as routes
from gpufn.http.errors import HTTPError
from gpufn.http.pool import Entry
from gpufn.wire import interface as iface
from gpufn.wire import protocol as p
from tests.unit.test_http_gateway import Conn, Receive, _item, entry, result, settle

pytestmark = pytest.mark.timeout(30)


def _chat(messages: list[Any], *, temperature: float = 1.0, max_tokens: int = 16) -> Any:
    yield ""


def _complete(prompt: str, *, n: int = 1, max_tokens: int = 16,
              logprobs: int | None = None) -> Any:
    yield ""


def _embed(input: str, dimensions: int | None = None) -> list[float]:
    return []


def _chat_n(messages: list[Any], n: int = 1) -> Any:
    yield ""


def _fn(name: str, fn: Any, **openai: Any) -> dict[str, Any]:
    return {"name": name, "interface": {**iface.describe(fn), "openai": openai}}


CHAT = _fn("chat", _chat, chat="tiny")
COMPLETE = _fn("complete", _complete, completion="tiny")
EMBED = _fn("embed", _embed, embedding="enc")


class Gateway:
    """What the routes use of the gateway: the caller's entry and its parsed body."""

    def __init__(self, e: Entry, body: Any) -> None:
        self.e, self.body_ = e, body
        self.read = 0

    async def entry(self, request: Request) -> Entry:
        return self.e

    async def body(self, request: Request) -> Any:
        return self.body_

    def done_reading(self, request: Request) -> None:
        self.read += 1


def setup(body: Any, apps: list[dict[str, Any]] | None = None
          ) -> tuple[routes.OpenAIRoutes, Gateway, Conn, Request, Receive]:
    conn = Conn()
    conn.replies[p.AppCommand] = {"apps": apps if apps is not None else [
        {"name": "llm", "version": 2, "state": "active", "created": 7,
         "functions": [CHAT, COMPLETE, EMBED]}]}
    gw = Gateway(entry(conn), body)
    receive = Receive()
    request = Request({"type": "http", "method": "POST", "path": "/v1/x", "headers": [],
                       "query_string": b"", "path_params": {}}, receive)
    return routes.OpenAIRoutes(gw), gw, conn, request, receive


async def answer(coro: Any) -> tuple[int, Any]:
    resp = await coro
    return resp.status_code, json.loads(resp.body) if resp.body else None


async def streamed(resp: Any) -> list[Any]:
    out = []
    async for chunk in resp.events:
        body = chunk[len(b"data: "):-2]
        out.append(body.decode() if body == b"[DONE]" else json.loads(body))
    return out


def test_models_are_listed_and_looked_up_with_their_roles_and_params() -> None:
    async def go() -> None:
        r, _, _, request, _ = setup({})
        status, body = await answer(r.models(request))
        assert status == 200 and body["object"] == "list"
        ids = {m["id"]: m for m in body["data"]}
        assert set(ids) == {"tiny", "enc"}
        tiny = ids["tiny"]
        assert (tiny["object"], tiny["owned_by"], tiny["created"]) == ("model", "llm", 7)
        assert tiny["gpufn"] == {"app": "llm", "version": 2,
                                 "roles": {"chat": "chat", "completion": "complete"},
                                 "params": {"chat": ["max_tokens", "temperature"],
                                            "completion": ["logprobs", "max_tokens", "n"]}}
        request.scope["path_params"] = {"model": "enc"}
        status, body = await answer(r.model(request))
        assert status == 200 and body["id"] == "enc" and body["gpufn"]["roles"] == {
            "embedding": "embed"}
        request.scope["path_params"] = {"model": "nope"}
        with pytest.raises(HTTPError) as e:
            await r.model(request)
        assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
        assert "no model 'nope' is deployed; models: enc, tiny" in e.value.message

    asyncio.run(go())


@pytest.mark.parametrize("body, param, why", [
    ([1], "", "the body must be a JSON object"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "model must name a chat model"),
    ({"model": "", "messages": []}, "model", "model must name a chat model"),
    ({"model": "tiny", "messages": []}, "messages", "messages must be a non-empty list"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant, tool, function, "
     "got None"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     "got 'robot'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": None}]}, "messages[0].content",
     "must be a string or a list of text parts, got NoneType"),
    ({"model": "tiny", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[1].content",
     "only text parts"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content", "only text parts"),
    ({"model": "tiny", "messages": [{"role": "user", "content": ["hi"]}]},
     "messages[0].content", "got ['str']"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream",
     "stream must be true or false, got 'yes'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}, "top_p",
     "does not handle the parameter 'top_p'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, "temperature",
     "from 0 to 2"),
    ({"model": "enc", "messages": [{"role": "user", "content": "hi"}]}, "model",
     "'enc' is an embedding model, not a chat model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream_options": 3},
     "stream_options", "stream_options must be an object"),
])
def test_a_bad_chat_request_is_refused_before_any_call(body: Any, param: str, why: str) -> None:
    async def go() -> None:
        r, gw, conn, request, _ = setup(body)
        with pytest.raises(HTTPError) as e:
            await r.chat(request)
        assert e.value.status in (400, 404) and e.value.param == param
        assert why in e.value.message
        assert conn.submitted == {} and not gw.read

    if isinstance(body, dict) and body.get("stream_options") is not None:
        body["stream"] = True
    asyncio.run(go())


def test_a_completion_with_bad_stream_options_is_refused_before_any_call() -> None:
    async def go() -> None:
        r, gw, conn, request, _ = setup({"model": "tiny", "prompt": ["a", "b"], "stream": True,
                                         "stream_options": [1]})
        with pytest.raises(HTTPError) as e:
            await r.completions(request)
        assert e.value.status == 400 and e.value.param == "stream_options"
        assert conn.submitted == {} and not gw.read

    asyncio.run(go())


def test_chat_n_other_than_1_is_refused() -> None:
    async def go() -> None:
        conn_fn = _fn("chat", _chat_n, chat="tiny")
        r, _, conn, request, _ = setup(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2},
            [{"name": "a", "version": 1, "functions": [conn_fn]}])
        with pytest.raises(HTTPError, match="n must be 1: one choice per chat request"):
            await r.chat(request)
        assert conn.submitted == {}

    asyncio.run(go())


def _values(conn: Conn, inv: str, values: list[Any], ok: bool = True, **res: Any) -> None:
    q = conn.streams[inv]
    for i, v in enumerate(values):
        q.put(_item(inv, i, v))
    conn.submitted[inv].set_result(result(inv, ok=ok, **res))


def test_chat_answered_whole_with_its_message_usage_and_finish() -> None:
    async def go() -> None:
        msgs = [{"role": "user", "content": "hi"}]
        r, gw, conn, request, _ = setup({"model": "tiny", "messages": msgs, "temperature": 0.5,
                                         "top_p": None})
        task = asyncio.ensure_future(answer(r.chat(request)))
        await settle()
        (inv, _), = conn.submitted.items()
        _values(conn, inv, ["Hel", {"text": "lo", "finish_reason": "length",
                                    "usage": {"prompt_tokens": 3, "completion_tokens": 2}}])
        status, body = await asyncio.wait_for(task, 5)
        assert status == 200 and gw.read == 1
        assert body["id"] == f"chatcmpl-{inv}" and body["object"] == "chat.completion"
        assert body["model"] == "tiny" and isinstance(body["created"], int)
        assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                            "content": "Hello"},
                                    "logprobs": None, "finish_reason": "length"}]
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert gw.e.inflight == 0

    asyncio.run(go())


def test_chat_streamed_starts_with_the_role_and_ends_with_usage_and_done() -> None:
    async def go() -> None:
        r, gw, conn, request, _ = setup({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                         "stream": True,
                                         "stream_options": {"include_usage": True}})
        resp = await r.chat(request)
        reader = asyncio.ensure_future(streamed(resp))
        await settle()
        (inv, _), = conn.submitted.items()
        _values(conn, inv, ["a", {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}])
        events = await asyncio.wait_for(reader, 5)
        assert events[-1] == "[DONE]"
        deltas = [e["choices"][0]["delta"] for e in events[:-2]]
        assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {}]
        assert events[-3]["choices"][0]["finish_reason"] == "stop"
        assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == 2
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        assert gw.e.inflight == 0

    asyncio.run(go())


def test_a_chat_whose_client_leaves_is_cancelled_and_answered_499() -> None:
    async def go() -> None:
        r, gw, conn, request, receive = setup({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        await receive()  # the body was read
        task = asyncio.ensure_future(r.chat(request))
        await settle()
        receive.gone.set()
        resp = await asyncio.wait_for(task, 5)
        assert resp.status_code == 499
        (inv, _), = conn.submitted.items()
        assert [i for i, _ in conn.cancels] == [inv] and gw.e.inflight == 0

    asyncio.run(go())


def test_completions_one_call_a_prompt_n_choices_each() -> None:
    async def go() -> None:
        r, _, conn, request, _ = setup({"model": "tiny", "prompt": ["a", "b"], "n": 2})
        task = asyncio.ensure_future(answer(r.completions(request)))
        await settle(20)
        (i0, _), (i1, _) = conn.submitted.items()
        _values(conn, i1, [{"text": "B1", "index": 1}])
        _values(conn, i0, [{"text": "A0", "index": 0}])
        status, body = await asyncio.wait_for(task, 5)
        assert status == 200 and body["id"] == f"cmpl-{i0}"
        assert [(c["index"], c["text"]) for c in body["choices"]] == [
            (0, "A0"), (1, ""), (2, ""), (3, "B1")]
        assert body["usage"] is None

    asyncio.run(go())


def test_completions_streamed_and_a_failed_call_as_its_error() -> None:
    async def go() -> None:
        r, _, conn, request, _ = setup({"model": "tiny", "prompt": "a", "stream": True})
        events_task = asyncio.ensure_future(streamed(await r.completions(request)))
        await settle()
        (inv, _), = conn.submitted.items()
        _values(conn, inv, ["x"])
        events = await asyncio.wait_for(events_task, 5)
        assert events[0]["choices"][0]["text"] == "x" and events[-1] == "[DONE]"

        r, _, conn, request, _ = setup({"model": "tiny", "prompt": "a"})
        task = asyncio.ensure_future(r.completions(request))
        await settle(20)
        (inv, _), = conn.submitted.items()
        _values(conn, inv, [], ok=False, kind="ValueError", message="prompt too long")
        with pytest.raises(HTTPError, match="prompt too long"):
            await asyncio.wait_for(task, 5)

    asyncio.run(go())


def test_embeddings_one_call_an_input_every_declared_parameter_sent() -> None:
    async def go() -> None:
        r, gw, conn, request, _ = setup({"model": "enc", "input": ["a", "b"],
                                         "encoding_format": "float"})
        task = asyncio.ensure_future(answer(r.embeddings(request)))
        await settle()
        subs = list(conn.submitted)
        assert len(subs) == 2 and gw.read == 1
        conn.submitted[subs[1]].set_result(result(subs[1], {"embedding": [2.0], "tokens": 4}))
        conn.submitted[subs[0]].set_result(result(subs[0], [1.0]))
        status, body = await asyncio.wait_for(task, 5)
        assert status == 200
        assert body == {"object": "list", "model": "enc",
                        "data": [{"object": "embedding", "index": 0, "embedding": [1.0]},
                                 {"object": "embedding", "index": 1, "embedding": [2.0]}],
                        "usage": {"prompt_tokens": 4, "total_tokens": 4}}
        assert gw.e.inflight == 0

    asyncio.run(go())


def test_embeddings_whose_client_leaves_are_cancelled_and_answered_499() -> None:
    async def go() -> None:
        r, gw, conn, request, receive = setup({"model": "enc", "input": ["a", "b", "c"]})
        await receive()
        task = asyncio.ensure_future(r.embeddings(request))
        await settle()
        receive.gone.set()
        resp = await asyncio.wait_for(task, 5)
        assert resp.status_code == 499 and gw.e.inflight == 0
        assert sorted(i for i, _ in conn.cancels) == sorted(conn.submitted)

    asyncio.run(go())


def test_only_the_openai_paths_are_openai() -> None:
    for path in ("/v1/models", "/v1/models/", "/v1/models/tiny", "/v1/chat/completions",
                 "/v1/completions/", "/v1/embeddings"):
        assert routes.is_openai(path), path
    for path in ("/v1/apps", "/v1/call/a/f", "/v1/modelsx", "/v1/chat"):
        assert not routes.is_openai(path), path


# --------------------------------------------------------------------------- what a chat yields


def test_a_chat_items_tool_calls_logprobs_and_usage() -> None:
    done = routes.Completion()
    delta = done.add(json.dumps({"tool_calls": [{"id": "a"}, {"id": "b"}]}).encode())
    assert delta == {"tool_calls": [{"index": 0, "id": "a"}, {"index": 1, "id": "b"}]}
    assert done.add(json.dumps({"tool_calls": [{"id": "c"}]}).encode()) == {
        "tool_calls": [{"index": 2, "id": "c"}]}
    assert done.add(json.dumps({"tool_calls": "x", "text": ""}).encode()) == {}  # not a list
    assert done.add(json.dumps({"tool_calls": []}).encode()) == {}
    assert done.finish == "tool_calls"
    assert done.message() == {"role": "assistant", "content": None,
                              "tool_calls": [{"id": "a"}, {"id": "b"}, {"id": "c"}]}
    done.add(b'"and text"')
    assert done.message()["content"] == "and text"
    done.add(json.dumps({"logprobs": [{"token": "a"}]}).encode())
    assert done.add(json.dumps({"logprobs": [{"token": "b"}]}).encode()) == {
        "logprobs": [{"token": "b"}]}
    assert done.logprobs == [{"token": "a"}, {"token": "b"}]
    done.add(json.dumps({"usage": {"prompt_tokens": 3}}).encode())
    assert done.usage == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    done.add(json.dumps({"usage": {"completion_tokens": 2}}).encode())
    assert done.usage == {"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2}
    for bad, why in ((b"[1]", "not list"), (b'{"text": 3}', "'text' must be a string")):
        with pytest.raises(HTTPError, match=why) as e:
            done.add(bad)
        assert (e.value.status, e.value.type) == (500, "BadChatItem")


def test_a_model_without_its_creation_time_says_0() -> None:
    async def go() -> None:
        r, _, _, request, _ = setup({}, [{"name": "a", "version": 1, "functions": [EMBED]}])
        _, body = await answer(r.models(request))
        assert body["data"][0]["created"] == 0

    asyncio.run(go())


def test_answers_keep_non_ascii_text_as_it_is() -> None:
    async def go() -> None:
        r, _, conn, request, _ = setup({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        task = asyncio.ensure_future(r.chat(request))
        await settle()
        (inv, _), = conn.submitted.items()
        _values(conn, inv, ["café"])
        assert "café".encode() in (await asyncio.wait_for(task, 5)).body

        r, _, conn, request, _ = setup({"model": "tiny", "prompt": "a"})
        task = asyncio.ensure_future(r.completions(request))
        await settle(20)
        (inv, _), = conn.submitted.items()
        _values(conn, inv, ["naïve"])
        resp = await asyncio.wait_for(task, 5)
        body = json.loads(resp.body)
        assert "naïve".encode() in resp.body and len(body["choices"]) == 1  # n: 1 by default
        assert body["choices"][0]["logprobs"] is None  # not asked for

    asyncio.run(go())


def test_completions_logprobs_when_asked() -> None:
    async def go() -> None:
        r, _, conn, request, _ = setup({"model": "tiny", "prompt": "a", "logprobs": 0})
        task = asyncio.ensure_future(r.completions(request))
        await settle(20)
        (inv, _), = conn.submitted.items()
        _values(conn, inv, [{"text": "x", "tokens": ["x"], "token_logprobs": [-0.5]}])
        body = json.loads((await asyncio.wait_for(task, 5)).body)
        assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]

    asyncio.run(go())


def test_a_failed_chat_stream_ends_with_an_openai_error_event() -> None:
    async def go() -> None:
        r, gw, conn, request, _ = setup({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                         "stream": True})
        resp = await r.chat(request)
        chunks: list[bytes] = []

        async def read() -> None:
            async for c in resp.events:
                chunks.append(c)

        reader = asyncio.ensure_future(read())
        await settle()
        (inv, _), = conn.submitted.items()
        _values(conn, inv, ["a"], ok=False, kind="ValueError", message="melted")
        await asyncio.wait_for(reader, 5)
        assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
        events = [json.loads(c[6:-2]) for c in chunks]
        assert [e["choices"][0]["index"] for e in events[:-1]] == [0, 0]
        assert "melted" in events[-1]["error"]["message"] and gw.e.inflight == 0

    asyncio.run(go())


def test_completions_a_failed_prompt_cancels_the_others_and_a_client_that_leaves_gets_499() -> None:
    async def go() -> None:
        r, gw, conn, request, _ = setup({"model": "tiny", "prompt": ["a", "b"]})
        task = asyncio.ensure_future(r.completions(request))
        await settle(20)
        (i0, _), (i1, _) = conn.submitted.items()
        _values(conn, i0, [], ok=False, kind="ValueError", message="bad prompt")
        with pytest.raises(HTTPError, match="bad prompt"):
            await asyncio.wait_for(task, 5)
        assert [i for i, _ in conn.cancels] == [i1] and gw.e.inflight == 0

        r, gw, conn, request, receive = setup({"model": "tiny", "prompt": ["a", "b"]})
        await receive()
        task = asyncio.ensure_future(r.completions(request))
        await settle(20)
        receive.gone.set()
        resp = await asyncio.wait_for(task, 5)
        assert resp.status_code == 499 and sorted(i for i, _ in conn.cancels) == sorted(
            conn.submitted) and gw.e.inflight == 0

    asyncio.run(go())


def test_chat_messages_reach_the_function_with_string_contents() -> None:
    """OpenAI's text content parts are joined into one string (a chat template reads a
    string; a list went into the prompt as its Python repr); an assistant's null content
    (a tool call) and a message's other fields are kept."""
    from gpufn.http.openai_routes import messages_of

    calls = {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]}
    got = messages_of({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                     {"type": "text", "text": "world"}], "name": "ann"},
        calls, {"role": "tool", "content": "42", "tool_call_id": "t1"}]})
    assert got == [{"role": "user", "content": "Hello, world", "name": "ann"}, calls,
                   {"role": "tool", "content": "42", "tool_call_id": "t1"}]
