"""`POST /v1/embeddings` waits for one call per input: what happens to the others when one
fails or the HTTP client leaves (each unanswered call is cancelled on its worker, none left
running for nobody), on a real event loop with the gateway tests' stand-in connection."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from gpufn.http import calls, openai_routes
from gpufn.http.errors import HTTPError
from gpufn.wire import protocol as p
from tests.unit.test_http_gateway import Conn, Receive, entry, result, settle

pytestmark = pytest.mark.timeout(30)


def _waiting(n: int) -> tuple[Conn, list[p.Submit], Coroutine[Any, Any, list[p.Result]]]:
    """A stand-in connection, `n` inputs' Submits, and the route's wait for their results."""
    conn = Conn()
    subs = [p.Submit(conn.new_id(), "f", {}) for _ in range(n)]
    return conn, subs, openai_routes._results(entry(conn), subs, "app.embed")


def test_every_inputs_result_comes_back_in_input_order() -> None:
    async def go() -> None:
        conn, subs, waiting = _waiting(3)
        task = asyncio.ensure_future(waiting)
        await settle()
        for i in (2, 0, 1):  # answered out of order
            conn.submitted[subs[i].invocation_id].set_result(result(subs[i].invocation_id, [i]))
            await settle()
        assert [r.invocation_id for r in await task] == [s.invocation_id for s in subs]
        assert conn.cancels == []

    asyncio.run(go())


def test_a_failed_input_answers_its_error_at_once_and_cancels_the_unanswered() -> None:
    async def go() -> None:
        conn, subs, waiting = _waiting(3)
        task = asyncio.ensure_future(waiting)
        await settle()
        conn.submitted[subs[0].invocation_id].set_result(result(subs[0].invocation_id, [0.0]))
        conn.submitted[subs[1].invocation_id].set_result(
            result(subs[1].invocation_id, ok=False, kind="ValueError", message="bad input"))
        with pytest.raises(HTTPError, match="bad input"):
            await asyncio.wait_for(task, 5)  # not waiting for the third
        assert [inv for inv, _ in conn.cancels] == [subs[2].invocation_id]
        assert "another input of its request failed" in conn.cancels[0][1]

    asyncio.run(go())


def test_a_client_that_leaves_cancels_every_unanswered_call() -> None:
    async def go() -> None:
        conn, subs, waiting = _waiting(3)
        receive = Receive()
        await receive()  # the body was read
        task = asyncio.ensure_future(calls.until_gone(waiting, receive))
        await settle()
        conn.submitted[subs[1].invocation_id].set_result(result(subs[1].invocation_id, [1.0]))
        await settle()
        receive.gone.set()
        with pytest.raises(calls.ClientGone):
            await asyncio.wait_for(task, 5)
        assert sorted(inv for inv, _ in conn.cancels) == [subs[0].invocation_id,
                                                           subs[2].invocation_id]
        assert all("disconnected" in why for _, why in conn.cancels)
        assert not any(conn.submitted[s.invocation_id].cancelled() for s in subs)

    asyncio.run(go())


# --------------------------------------------------------------------------- the pieces


def test_input_forms_and_their_bound() -> None:
    from gpufn.http import openai_embeddings as oe

    assert oe.inputs({"input": "a"}) == ["a"]
    assert oe.inputs({"input": [0, 7]}) == [[0, 7]]
    assert oe.inputs({"input": ["a", "b"]}) == ["a", "b"]
    assert oe.inputs({"input": [[1], [2, 3]]}) == [[1], [2, 3]]
    assert len(oe.inputs({"input": ["a"] * oe.MAX_INPUTS})) == oe.MAX_INPUTS
    with pytest.raises(HTTPError, match="at most 2048 inputs per request, got 2049") as e:
        oe.inputs({"input": ["a"] * (oe.MAX_INPUTS + 1)})
    assert e.value.param == "input"
    for bad in ("", [], [""], [-1], [1, "a"], [[1], []], [True], [[True]], [1.5], None, 3):
        with pytest.raises(HTTPError, match="input must be a non-empty string") as e:
            oe.inputs({"input": bad})
        assert (e.value.status, e.value.param) == (400, "input")


def test_encoding_format_is_float_or_base64() -> None:
    from gpufn.http import openai_embeddings as oe

    assert oe.encoding({}) == "float" and oe.encoding({"encoding_format": None}) == "float"
    assert oe.encoding({"encoding_format": "base64"}) == "base64"
    with pytest.raises(HTTPError, match="'float' or 'base64', got 'int8'") as e:
        oe.encoding({"encoding_format": "int8"})
    assert e.value.param == "encoding_format"


@pytest.mark.parametrize("value, why", [
    (b"[]", "no embedding"), (b'"x"', "no embedding"), (b"[1, true]", "no embedding"),
    (b'[1, "2"]', "no embedding"), (b"[1, NaN]", "no embedding"), (b"[Infinity]", "no embedding"),
    (b'{"embedding": null}', "no embedding"), (b'{"vector": [1]}', "no embedding"),
    (b'{"embedding": [1], "tokens": -1}', "'tokens': -1, not a count"),
    (b'{"embedding": [1], "tokens": true}', "'tokens': True, not a count"),
    (b'{"embedding": [1], "tokens": 1.5}', "'tokens': 1.5, not a count"),
])
def test_a_bad_embedding_is_the_models_fault_and_says_so(value: bytes, why: str) -> None:
    from gpufn.http import openai_embeddings as oe

    with pytest.raises(HTTPError) as e:
        oe.item(value, 0, "float", None)
    assert why in e.value.message and e.value.status == 500
    assert (e.value.type, e.value.code) == ("BadEmbedding", "bad_model_output")
    assert e.value.message.startswith("an embedding model returned ")


def test_an_embedding_with_its_tokens_and_dimensions() -> None:
    from gpufn.http import openai_embeddings as oe

    emb, tokens = oe.item(b'{"embedding": [1, 2.5], "tokens": 0}', 3, "float", 2)
    assert emb == {"object": "embedding", "index": 3, "embedding": [1.0, 2.5]} and tokens == 0
    assert all(type(x) is float for x in emb["embedding"])
    assert oe.item(b"[0.25]", 0, "float", None)[1] == 0  # a bare list counts no tokens
    assert oe.item(b'{"embedding": [0.25]}', 0, "float", None)[1] == 0  # nor a dict without
    with pytest.raises(HTTPError, match="2 dimensions where 1 were asked for"):
        oe.item(b"[1, 2]", 0, "float", 1)
