"""`POST /v1/embeddings` waits for one call per input: what happens to the others when one
fails or the HTTP client leaves (each unanswered call is cancelled on its worker, none left
running for nobody), on a real event loop with the gateway tests' stand-in connection."""

from __future__ import annotations

import asyncio

import pytest

from gpufn.http import calls, openai_routes
from gpufn.http.errors import HTTPError
from gpufn.wire import protocol as p
from tests.unit.test_http_gateway import Conn, Receive, entry, result, settle

pytestmark = pytest.mark.timeout(30)


def _subs(conn: Conn, n: int) -> list[p.Submit]:
    return [p.Submit(conn.new_id(), "f", {}) for _ in range(n)]


def test_every_inputs_result_comes_back_in_input_order() -> None:
    async def go() -> None:
        conn = Conn()
        subs = _subs(conn, 3)
        task = asyncio.ensure_future(openai_routes._results(entry(conn), subs, "app.embed"))
        await settle()
        for i in (2, 0, 1):  # answered out of order
            conn.submitted[subs[i].invocation_id].set_result(result(subs[i].invocation_id, [i]))
            await settle()
        assert [r.invocation_id for r in await task] == [s.invocation_id for s in subs]
        assert conn.cancels == []

    asyncio.run(go())


def test_a_failed_input_answers_its_error_at_once_and_cancels_the_unanswered() -> None:
    async def go() -> None:
        conn = Conn()
        subs = _subs(conn, 3)
        task = asyncio.ensure_future(openai_routes._results(entry(conn), subs, "app.embed"))
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
        conn = Conn()
        subs = _subs(conn, 3)
        receive = Receive()
        await receive()  # the body was read
        task = asyncio.ensure_future(calls.until_gone(
            openai_routes._results(entry(conn), subs, "app.embed"), receive))
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
