"""What an abusive or unlucky HTTP client meets, against a real `gpufn serve --http-port`:
a body without Content-Length past the size limit (413 while it streams, the gateway's
memory bounded), bodies together past the budget (503 with Retry-After), half-open and slow
connections (closed), a stalled body (408), NaN and deep JSON (400), malformed query
parameters (400 naming them); each user sees only their own recent errors; a spawned call
survives a `kill -9` of the gateway, and of the whole head."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import gpufn  # noqa: E402

from ..conftest import shutdown_default, wait_ready  # noqa: E402
from . import _raw_http as raw  # noqa: E402
from ._head import TOKEN, Head, free_port  # noqa: E402
from ._waits import wait_for  # noqa: E402
from .http_served import APP, ServedGateway  # noqa: E402
from .served import gpufn_cmd  # noqa: E402

pytestmark = pytest.mark.timeout(180)

LIMIT = 16 * raw.MiB
BUDGET = 20 * raw.MiB
READ_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    s = ServedGateway(tmp_path_factory.mktemp("http-faults"), GPUFN_MAX_PAYLOAD="16MiB",
                      GPUFN_HTTP_BODY_BUDGET="20MiB", GPUFN_HTTP_READ_TIMEOUT=str(READ_TIMEOUT))
    s.start()
    try:
        client = s.client()
        try:
            s.wait_ready(client)
            gpufn.deploy(APP, name="t", client=client)
        finally:
            client.close()
        yield s
    finally:
        s.stop()


@pytest.fixture
def http(served: ServedGateway) -> Iterator[Any]:
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"},
                      timeout=60) as c:
        yield c


def gateway(served: ServedGateway) -> int:
    assert served.proc is not None
    return raw.gateway_pid(served.proc.pid)


# --------------------------------------------------------------------------- bodies


def test_a_chunked_body_past_the_limit_is_413_and_never_buffered(served: ServedGateway) -> None:
    pid = gateway(served)
    raw.reset_peak(pid)
    before = raw.memory_kib(pid, "VmHWM")
    chunk = b"%x\r\n" % raw.MiB + b"x" * raw.MiB + b"\r\n"
    sent = 0
    start = time.monotonic()
    with raw.connect(served.url) as s:
        s.sendall(raw.head("POST", "/v1/apps/t/echo", served.token, Transfer_Encoding="chunked",
                           Content_Type="application/json"))
        while sent < 200 * raw.MiB and not raw.readable(s):  # a 200 MiB body, 1 MiB a piece
            try:
                s.sendall(chunk)
            except ConnectionError:
                break
            sent += raw.MiB
        status, _, body = raw.response(s)
    took = time.monotonic() - start
    grew = (raw.memory_kib(pid, "VmHWM") - before) / 1024
    assert status == 413, body
    err = json.loads(body)["error"]
    assert err["type"] == "PayloadTooLarge" and "GPUFN_MAX_PAYLOAD" in err["message"]
    # Answered while the body still came: what was sent is the limit and the sockets' buffers.
    assert sent < 64 * raw.MiB, f"{sent / raw.MiB:.0f} MiB were sent before the answer"
    assert grew < 48, f"the gateway's peak memory grew by {grew:.0f} MiB for a refused body"
    assert took < 30
    print(f"413 after {sent / raw.MiB:.0f} MiB sent, {took:.1f}s; gateway peak +{grew:.1f} MiB")


def test_bodies_past_the_budget_together_are_503_with_retry_after(
        served: ServedGateway, http: Any) -> None:
    size = 12 * raw.MiB  # each under the 16 MiB limit; two pass the 20 MiB budget
    first = raw.connect(served.url)
    try:
        first.sendall(raw.head("POST", "/v1/apps/t/echo", served.token,
                               Content_Length=str(size)) + b'{"args": ["')
        time.sleep(0.5)  # the gateway holds the first body's share
        with raw.connect(served.url) as second:
            second.sendall(raw.head("POST", "/v1/apps/t/echo", served.token,
                                    Content_Length=str(size)))
            status, headers, body = raw.response(second, 10)
        assert status == 503, body
        assert headers["retry-after"] == "1" and "GPUFN_HTTP_BODY_BUDGET" in body.decode()
        assert post_ok(http), "a small body still fits the budget"
    finally:
        first.close()  # its share is given back once the gateway sees it gone
    payload = json.dumps({"args": ["x" * (size - 100), 1]}).encode()

    def admitted() -> Any:
        r = httpx.post(f"{served.url}/v1/apps/t/echo", content=payload, timeout=60,
                       headers={"Authorization": f"Bearer {served.token}"})
        return r if r.status_code != 503 else None
    r = wait_for(admitted, 30, "the budget to be given back", interval=0.2)
    assert r.status_code == 400 and "too many positional" in r.text, r.text  # read whole


def post_ok(http: Any) -> bool:
    r = http.post("/v1/apps/t/echo", json={"args": ["small"]})
    return bool(r.status_code == 200 and r.json()["result"]["x"] == "small")


def test_half_open_and_slow_connections_are_closed(served: ServedGateway) -> None:
    slack = 4.0
    with raw.connect(served.url) as idle:  # connected, never a byte
        took = raw.closed_within(idle, READ_TIMEOUT + slack)
        assert took is not None, "a connection that sent nothing was kept open"
    with raw.connect(served.url) as slow:  # a head a byte at a time (slowloris)
        head = raw.head("GET", "/v1/apps", served.token)
        took = raw.sent_until_closed(slow, (bytes([b]) for b in head), 0.2)
        assert took is not None and took < READ_TIMEOUT + slack, "the slow head was kept"
        assert took >= READ_TIMEOUT * 0.9
    with raw.connect(served.url) as stalled:  # a head, then part of its body, then nothing
        stalled.sendall(raw.head("POST", "/v1/apps/t/echo", served.token, Content_Length="100")
                        + b'{"args": [')
        start = time.monotonic()
        status, headers, body = raw.response(stalled, READ_TIMEOUT + slack)
        assert status == 408 and json.loads(body)["error"]["type"] == "RequestTimeout", body
        assert headers.get("connection") == "close"
        assert raw.closed_within(stalled, slack) is not None
        assert READ_TIMEOUT * 0.9 <= time.monotonic() - start < READ_TIMEOUT + slack


@pytest.mark.parametrize("body, why", [
    (b'{"args": [NaN]}', "NaN is not a JSON number"),
    (b'{"args": [1, Infinity]}', "Infinity is not a JSON number"),
    (b'{"kwargs": {"x": -Infinity}}', "-Infinity is not a JSON number"),
    (b'{"args": [' + b"[" * 10_000 + b"]" * 10_000 + b"]}", "nested too deeply"),
])
def test_json_the_gateway_cannot_take_is_the_clients_error(
        served: ServedGateway, http: Any, body: bytes, why: str) -> None:
    r = http.post("/v1/apps/t/echo", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert post_ok(http)  # the same connection goes on
    assert "RecursionError" not in served.log() and "Exception in ASGI" not in served.log()


@pytest.mark.parametrize("query, name", [
    ("priority=high", "priority"), ("priority=1.5", "priority"), ("priority=1e3", "priority"),
    ("priority=99999999999", "priority"), ("priority=1&priority=2", "priority"),
    ("timeout=soon", "timeout"), ("timeout=nan", "timeout"), ("timeout=inf", "timeout"),
    ("timeout=0", "timeout"), ("timeout=-1", "timeout"), ("version=0", "version"),
    ("version=v2", "version"), ("version=99999999999999999999", "version"),
])
def test_a_bad_query_parameter_is_400_naming_it_and_its_form(
        http: Any, query: str, name: str) -> None:
    for route in ("/v1/apps/t/noop", "/v1/apps/t/noop/spawn"):
        r = http.post(f"{route}?{query}")
        assert r.status_code == 400, (query, r.text)
        err = r.json()["error"]
        assert err["type"] == "InvalidSpec" and f"query parameter {name}" in err["message"]
        assert "invalid literal" not in err["message"], err
        assert f"e.g. ?{name}=" in err["message"] or "give it once" in err["message"], err
    assert http.post("/v1/apps/t/noop?priority=-3&timeout=2.5&version=1").status_code == 200


# --------------------------------------------------------------------------- errors by user


def _token(served: ServedGateway, name: str) -> str:
    r = subprocess.run([*gpufn_cmd(), "token", "create", name], env=served.env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_each_user_sees_only_their_own_errors(served: ServedGateway, http: Any) -> None:
    tokens = {name: _token(served, name) for name in ("alice", "bob")}
    for name, tok in tokens.items():
        with httpx.Client(base_url=served.url, timeout=60,
                          headers={"Authorization": f"Bearer {tok}"}) as h:
            r = h.post("/v1/apps/t/fail", json={"args": [f"secret of {name}"]})
            assert r.status_code == 500
            assert h.post("/v1/apps/t/noop?priority=high").status_code == 400
    assert httpx.post(f"{served.url}/v1/apps/t/noop", timeout=30).status_code == 401

    def errors(token: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{served.url}/v1/status", timeout=60,
                      headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
        return list(r.json()["gateway"]["errors"])

    for name, tok in tokens.items():
        seen = errors(tok)
        text = json.dumps(seen)
        other = "bob" if name == "alice" else "alice"
        assert f"secret of {name}" in text and "priority" in text, seen
        assert f"secret of {other}" not in text and "AuthenticationError" not in text, seen
    everything = json.dumps(errors(served.token))  # the admin: every user's, and the 401
    assert "secret of alice" in everything and "secret of bob" in everything
    assert "AuthenticationError" in everything


# --------------------------------------------------------------------------- spawned calls


def test_another_users_delete_is_refused_and_the_call_keeps_running(
        served: ServedGateway, http: Any) -> None:
    call_id = http.post("/v1/apps/t/sleepy/spawn", json={"args": [60]}).json()["call_id"]
    wait_for(lambda: http.get(f"/v1/calls/{call_id}").json()["state"] == "running", 30,
             "the call to run")
    dave = {"Authorization": f"Bearer {_token(served, 'dave')}"}
    r = httpx.delete(f"{served.url}/v1/calls/{call_id}", headers=dave, timeout=30)
    assert r.status_code in (403, 404), r.text
    r = httpx.delete(f"{served.url}/v1/calls/nosuchcall", headers=dave, timeout=30)
    assert r.status_code == 404, r.text
    time.sleep(1.0)
    assert http.get(f"/v1/calls/{call_id}").json()["state"] == "running"
    assert http.delete(f"/v1/calls/{call_id}").json()["cancelled"] is True  # its owner may


def test_a_spawned_call_survives_a_kill_of_the_gateway(served: ServedGateway, http: Any) -> None:
    call_id = http.post("/v1/apps/t/sleepy/spawn", json={"args": [3]}).json()["call_id"]
    done = http.post("/v1/apps/t/echo/spawn", json={"args": ["kept"]}).json()["call_id"]
    wait_for(lambda: http.get(f"/v1/calls/{done}").json()["state"] == "done", 30,
             "the short call to end")
    wait_for(lambda: http.get(f"/v1/calls/{call_id}").json()["state"] == "running", 30,
             "the long call to run")
    kill_gateway(served, http)  # `gpufn serve` starts another on the same port
    view = http.get(f"/v1/calls/{call_id}").json()
    assert view["state"] in ("running", "done"), view  # found again, not 404
    view = wait_for(lambda: (v := http.get(f"/v1/calls/{call_id}").json())["state"] == "done"
                    and v, 60, "the long call's result")
    assert view["result"] == 3
    kept = http.get(f"/v1/calls/{done}").json()
    assert kept["state"] == "done" and kept["result"]["x"] == "kept"
    # Another user's call is refused (403 once this gateway has it, else unknown: 404).
    carol = {"Authorization": f"Bearer {_token(served, 'carol')}"}
    r = httpx.get(f"{served.url}/v1/calls/{call_id}", headers=carol, timeout=30)
    assert r.status_code == 403 and "result" not in r.json(), r.text
    assert http.get("/v1/calls/nosuchcall").status_code == 404
    # A call found again is cancelled like one spawned here.
    long = http.post("/v1/apps/t/sleepy/spawn", json={"args": [60]}).json()["call_id"]
    wait_for(lambda: http.get(f"/v1/calls/{long}").json()["state"] == "running", 30, "it to run")
    kill_gateway(served, http)
    r = httpx.get(f"{served.url}/v1/calls/{long}", headers=carol, timeout=30)
    assert r.status_code == 404 and "result" not in r.json(), r.text
    r = httpx.delete(f"{served.url}/v1/calls/{long}", headers=carol, timeout=30)
    assert r.status_code == 404, r.text
    r = http.delete(f"/v1/calls/{long}")
    assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
    view = wait_for(lambda: (v := http.get(f"/v1/calls/{long}").json())["state"] != "running"
                    and v, 30, "the cancel")
    assert view["state"] == "cancelled", view


def kill_gateway(served: ServedGateway, http: Any) -> None:
    """`kill -9` the gateway child and wait for `gpufn serve` to start the next one."""
    old = gateway(served)
    os.kill(old, signal.SIGKILL)

    def back() -> bool:
        try:
            return gateway(served) != old and http.get("/healthz").status_code == 200
        except (httpx.TransportError, AssertionError):
            return False
    wait_for(back, 60, "the gateway to be started again", interval=0.2)


# --------------------------------------------------------------------------- head restart


def _on_disk(head: Head, table: str, call_id: str) -> bool:
    try:
        with sqlite3.connect(head.home / "state" / "results.sqlite") as db:
            return db.execute(f"SELECT 1 FROM {table} WHERE id=?", (call_id,)).fetchone() is not None
    except sqlite3.Error:
        return False


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    shutdown_default()
    h = Head(tmp_path / "head")
    h.serve_args = ("--http-port", str(free_port()))
    try:
        yield h
    finally:
        h.close()


@pytest.mark.timeout(300)
def test_a_spawned_call_survives_a_restart_of_the_head(head: Head) -> None:
    head.start()
    client = gpufn.Client(head.address, TOKEN)
    try:
        wait_ready(client)
        gpufn.deploy(APP, name="t", client=client)
    finally:
        client.close()
    url = f"http://127.0.0.1:{head.serve_args[1]}"
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=60) as http:
        wait_for(lambda: _healthy(http), 60, "the gateway to listen", interval=0.2)
        done = http.post("/v1/apps/t/echo/spawn", json={"args": ["kept"]}).json()["call_id"]
        long = http.post("/v1/apps/t/sleepy/spawn", json={"args": [4]}).json()["call_id"]
        wait_for(lambda: _on_disk(head, "results", done), 30, "the ended call's kept result")
        wait_for(lambda: _on_disk(head, "calls", long), 30, "the running call to be noted")
        assert http.get(f"/v1/calls/{long}").json()["state"] == "running"
        head.kill(signal.SIGKILL)  # serve, its scheduler and its gateway; the workers stay
        head.start()
        wait_for(lambda: _healthy(http), 60, "the new gateway to listen", interval=0.2)
        view = wait_for(lambda: (v := http.get(f"/v1/calls/{long}").json()).get("state") == "done"
                        and v, 90, "the running call's result after the restart")
        assert view["result"] == 4
        kept = http.get(f"/v1/calls/{done}").json()
        assert kept["state"] == "done" and kept["result"]["x"] == "kept", kept
    head.shutdown()


def _healthy(http: Any) -> bool:
    try:
        return bool(http.get("/healthz").status_code == 200)
    except httpx.TransportError:
        return False
