"""The HTTP gateway's pure pieces: JSON payloads, recorded interfaces and argument binding,
error statuses, the caller check on spawned calls, chat request parsing, chat_model, and
the deployment store's interface column (also on a store written before it)."""

from __future__ import annotations

import inspect
import json
import math
import sqlite3
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

import gpufn
from gpufn.exceptions import NotJSONSerializable, SerializationError
from gpufn.wire import interface as iface
from gpufn.wire import jsonwire
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser

# --------------------------------------------------------------------------- JSON payloads


def test_json_payloads_describe_themselves() -> None:
    frames = jsonwire.dump_call([1, "é", None], {"k": [True, 2.5]})
    assert jsonwire.is_json(frames)
    assert jsonwire.load_call(frames) == ((1, "é", None), {"k": [True, 2.5]})
    pickled = ser.dumps((("x",), {}))
    assert not jsonwire.is_json(pickled) and not jsonwire.is_json([jsonwire.JSON_MARK])
    assert not jsonwire.is_json([pickled[0], b"{}"])
    with pytest.raises(SerializationError, match="not JSON"):
        jsonwire.value_text(pickled)  # a pickle is refused, never read
    text = jsonwire.value_text(jsonwire.dump_value({"a": "line\nbreak"}, "v"))
    assert b"\n" not in text and json.loads(text) == {"a": "line\nbreak"}


def test_values_json_cannot_hold_are_refused_naming_their_type() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(NotJSONSerializable, match=r"the value returned by f holds a torch\.Tensor"):
        jsonwire.dump_value({"t": torch.zeros(1)}, "the value returned by f")
    with pytest.raises(NotJSONSerializable, match="holds a set"):
        jsonwire.dump_value([{1, 2}], "x")
    with pytest.raises(NotJSONSerializable, match="NaN"):
        jsonwire.dump_value(math.nan, "x")
    with pytest.raises(NotJSONSerializable, match="keys"):
        jsonwire.dump_value({(1, 2): 3}, "x")
    with pytest.raises(SerializationError, match='"args"'):
        jsonwire.load_call([jsonwire.JSON_MARK, b'{"args": 3}'])
    assert issubclass(NotJSONSerializable, SerializationError)
    assert gpufn.NotJSONSerializable is NotJSONSerializable


# --------------------------------------------------------------------------- interfaces


_OPAQUE = object()  # a default JSON cannot hold


def sample(a: int, /, b: str, *rest: Any, c: float = 1.5, d: Any = _OPAQUE, **more: Any) -> list[int]:
    """Does things.

    More detail."""
    return []


def stream(n: int) -> Iterator[int]:
    yield n


def test_describe_records_kinds_defaults_and_annotations() -> None:
    d = iface.describe(sample, chat_model="m")
    assert [(x["name"], x["kind"]) for x in d["params"]] == [
        ("a", "POSITIONAL_ONLY"), ("b", "POSITIONAL_OR_KEYWORD"), ("rest", "VAR_POSITIONAL"),
        ("c", "KEYWORD_ONLY"), ("d", "KEYWORD_ONLY"), ("more", "VAR_KEYWORD")]
    c, dd = d["params"][3], d["params"][4]
    assert c["default"] == 1.5 and c["annotation"] == "float" and c["has_default"]
    assert "default" not in dd and dd["default_repr"].startswith("<object object")
    assert d["returns"] == "list[int]" and d["doc"] == "Does things."
    assert d["chat_model"] == "m" and not d["generator"]
    assert iface.describe(stream)["generator"]
    json.dumps(d)  # plain JSON all through


@pytest.mark.parametrize("args, kwargs", [
    ([], {}), ([1], {}), ([1, "b"], {}), ([1, "b", 3, 4], {"c": 2}), ([1], {"b": "x"}),
    ([], {"a": 1, "b": 2}), ([1, "b"], {"zz": 1}), ([1, 2], {"b": 3}), ([1, "b"], {"d": 0}),
])
def test_a_rebuilt_signature_binds_exactly_like_the_function(args: list[Any],
                                                             kwargs: dict[str, Any]) -> None:
    real = inspect.signature(sample)
    rebuilt = iface.signature(json.loads(json.dumps(iface.describe(sample))))
    assert (iface.bind_error(real, args, kwargs) is None) == (
        iface.bind_error(rebuilt, args, kwargs) is None)


def test_signature_text_reads_like_python() -> None:
    from gpufn.http.directory import signature_text

    assert signature_text(iface.describe(sample)).startswith(
        "a: int, /, b: str, *rest: Any, c: float=1.5, d: Any=<object object at ")
    assert signature_text(iface.describe(sample)).endswith(">, **more: Any")

    def kw(x: int, *, y: int = 2) -> None: ...

    assert signature_text(iface.describe(kw)) == "x: int, *, y: int=2"


# --------------------------------------------------------------------------- errors


def test_error_statuses() -> None:
    from gpufn.http.errors import STATUS, from_result

    assert {k: STATUS[k] for k in ("InvalidSpec", "AuthenticationError", "NotFound", "QueueFull",
                                   "ConnectionLost", "Timeout")} == {
        "InvalidSpec": 400, "AuthenticationError": 401, "NotFound": 404, "QueueFull": 429,
        "ConnectionLost": 503, "Timeout": 504}
    user = from_result(p.Result("i", False, "", "bad", p.ResultMeta(error_type="KeyError",
                                                                    traceback="tb")))
    assert (user.status, user.type, user.extra) == (500, "KeyError", {"remote": True})
    assert b"tb" not in user.body() and user.openai()["message"] == "KeyError: bad"
    ours = from_result(p.Result("i", False, "NotJSONSerializable", "holds a set"))
    assert (ours.status, ours.type) == (500, "NotJSONSerializable")
    assert json.loads(ours.body()) == {"error": {"type": "NotJSONSerializable",
                                                 "message": "holds a set"}}


def test_a_spawned_call_is_its_callers_alone() -> None:
    from gpufn.http.calls import SpawnBook, Spawned
    from gpufn.http.errors import HTTPError

    book = SpawnBook()
    book.calls["c1"] = Spawned("c1", "alice", "t.f", Future(), entry=None)  # type: ignore[arg-type]
    found = book.find("c1", "alice")
    assert found is not None and found.call_id == "c1"
    with pytest.raises(HTTPError) as other:
        book.find("c1", "bob")
    assert other.value.status == 403
    assert book.find("c2", "alice") is None  # not here: the gateway asks the scheduler


def test_the_scheduler_answer_to_an_unknown_attach_is_told_apart() -> None:
    from gpufn.http.calls import UNKNOWN_CALL, Spawned

    def spawned(res: p.Result) -> Spawned:
        fut: Future[p.Result] = Future()
        fut.set_result(res)
        return Spawned(res.invocation_id, "alice", "", fut, entry=None)  # type: ignore[arg-type]

    assert spawned(p.Result("c", False, "GpufnError", f"{UNKNOWN_CALL} c of yours: ...")).unknown()
    assert not spawned(p.Result("c", False, "GpufnError", "something else")).unknown()
    assert not spawned(p.Result("c", False, "NotFound", f"{UNKNOWN_CALL} c")).unknown()
    assert not spawned(p.Result("c", True, "", "")).unknown()
    # The scheduler's own answer to an Attach of an id it does not know is told apart.
    from .core_harness import Harness

    h = Harness(devices=1)
    h.start_worker(0)
    h.hello(b"gateway", p.Role.CLIENT)
    h.feed(b"gateway", p.Attach("nosuchcall"))
    assert spawned(h.results(b"gateway")["nosuchcall"]).unknown()


# --------------------------------------------------------------------------- chat


def test_chat_requests_become_keyword_arguments() -> None:
    from gpufn.http.errors import HTTPError
    from gpufn.http.openai_params import function_kwargs

    declared = frozenset({"max_tokens", "temperature", "top_p", "stop", "seed"})

    def chat_params(body: dict[str, Any]) -> dict[str, Any]:
        return function_kwargs(body, "chat", declared, "m")

    msgs = [{"role": "user", "content": "hi"}]
    assert chat_params({"messages": msgs}) == {}
    assert chat_params({"messages": msgs, "max_tokens": 5, "temperature": 0.5, "top_p": 1,
                        "stop": "x", "seed": 3, "user": "ignored"}) == {
        "max_tokens": 5, "temperature": 0.5, "top_p": 1.0, "stop": ["x"], "seed": 3}
    assert chat_params({"messages": msgs, "max_completion_tokens": 7})["max_tokens"] == 7
    for bad, param in (({"messages": msgs, "n": 2}, "n"),
                       ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
                       ({"messages": msgs, "temperature": 3}, "temperature"),
                       ({"messages": msgs, "stop": [1]}, "stop"),
                       ({"messages": msgs, "seed": "s"}, "seed")):
        with pytest.raises(HTTPError) as e:
            chat_params(bad)
        assert (e.value.status, e.value.param) == (400, param)


def test_completion_takes_text_pieces_usage_and_finish() -> None:
    from gpufn.http.errors import HTTPError
    from gpufn.http.openai_routes import Completion

    c = Completion()
    assert c.add(b'"Hel"') == {"content": "Hel"} and c.add(b'{"text": "lo"}') == {"content": "lo"}
    assert c.add(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}, '
                 b'"finish_reason": "length"}') == {}
    assert ("".join(c.text), c.finish) == ("Hello", "length")
    assert c.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    with pytest.raises(HTTPError):
        c.add(b"42")


def test_chat_model_marks_generator_functions_only() -> None:
    from gpufn.api.chat import chat_name

    @gpufn.chat_model("tiny")
    @gpufn.gpu
    def chat(messages: list[dict[str, Any]]) -> Iterator[str]:
        yield "x"

    assert chat_name(chat) == "tiny" and isinstance(chat, gpufn.Function)
    with pytest.raises(gpufn.InvalidSpec, match="generator"):
        gpufn.chat_model("m")(gpufn.gpu(lambda messages: "x"))
    with pytest.raises(gpufn.InvalidSpec, match=r"above @gpufn\.gpu"):
        gpufn.chat_model("m")(stream)  # type: ignore[type-var]
    with pytest.raises(gpufn.InvalidSpec, match="model name"):
        gpufn.chat_model("bad name!")


# --------------------------------------------------------------------------- the store


def test_the_store_keeps_interfaces_and_upgrades_an_older_file(tmp_path: Path) -> None:
    from gpufn.scheduler.stores.deployments import DeploymentStore, StoredFunction, Version

    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)  # the functions table as written before interfaces
    old.executescript("""
        CREATE TABLE functions (app TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL,
            function_id TEXT NOT NULL, code_id TEXT NOT NULL, spec TEXT NOT NULL,
            models TEXT NOT NULL, ncode INTEGER NOT NULL, frames TEXT NOT NULL,
            PRIMARY KEY (app, version, name));
        INSERT INTO functions VALUES ('a', 1, 'f', 'd1', 'c1', '{}', '[]', 0, '[]');""")
    old.commit()
    old.close()
    store = DeploymentStore(path)
    assert store.functions("a", 1)[0].interface == {}
    described = iface.describe(sample)
    store.add_version(Version("b", 1, 0.0, "h"),
                      [StoredFunction("b", 1, "g", "d2", "c2", {}, [], 0, (), described)])
    assert store.functions("b", 1)[0].interface == described
    assert store.function_by_id("d2").interface == described  # type: ignore[union-attr]
    store.close()


@pytest.mark.timeout(30)
def test_the_finished_spawned_calls_kept_are_bounded_by_count_and_by_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The oldest finished calls go first, past KEEP_CALLS or past KEEP_BYTES of results;
    a call still out is never dropped, and each holds its connection until it ends."""
    import asyncio

    from gpufn.http import calls
    from gpufn.http.pool import Entry

    monkeypatch.setattr(calls, "KEEP_CALLS", 3)
    monkeypatch.setattr(calls, "KEEP_BYTES", 1000)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        book = calls.SpawnBook()
        entry = Entry(client=None, owner="alice")  # type: ignore[arg-type]
        futures: dict[str, Future[p.Result]] = {}

        def spawn(call_id: str) -> None:
            futures[call_id] = Future()
            book.add(calls.Spawned(call_id, "alice", "t.f", futures[call_id], entry), loop)

        async def finish(call_id: str, nbytes: int) -> None:
            futures[call_id].set_result(p.Result(call_id, True, "", "", frames=(b"x" * nbytes,)))
            for _ in range(3):  # the done callback hops onto the loop
                await asyncio.sleep(0)

        spawn("out")  # never finishes here
        for i in range(5):
            spawn(f"c{i}")
        assert entry.inflight == 6
        for i in range(5):
            await finish(f"c{i}", 100)
        assert list(book.calls) == ["out", "c2", "c3", "c4"]  # by count: the last 3 finished
        assert book.finished_bytes == 300 and entry.inflight == 1
        spawn("big")
        await finish("big", 800)  # 1100 bytes finished: the oldest go until within 1000
        assert list(book.calls) == ["out", "c3", "c4", "big"]
        assert book.finished_bytes == 1000
        spawn("huge")
        await finish("huge", 2000)  # alone past the bytes: every finished one goes, itself too
        assert list(book.calls) == ["out"] and book.finished_bytes == 0
        assert entry.inflight == 1 and not futures["out"].done()
        book.forget("out")
        assert not book.calls

    asyncio.run(scenario())
