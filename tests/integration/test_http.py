"""The HTTP gateway against a real `gpufn serve --http-port`: JSON calls, SSE streams,
cancel on disconnect, spawned calls, every error status, metrics, curl. Real HTTP
clients (httpx, curl in a subprocess) only; one served cluster for the module."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import gpufn  # noqa: E402

from .http_served import APP, ServedGateway  # noqa: E402
from .served import gpufn_cmd  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    s = ServedGateway(tmp_path_factory.mktemp("http"), GPUFN_MAX_QUEUE_PER_FUNCTION="4")
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


def post(http: Any, fn: str, *args: Any, **kwargs: Any) -> Any:
    return http.post(f"/v1/apps/t/{fn}", json={"args": list(args), "kwargs": kwargs})


def events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event name, data) of each Server-Sent Event."""
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def wait_for(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.02)
    return path.read_text()


# --------------------------------------------------------------------------- JSON calls


def test_apps_lists_functions_with_parameters(http: Any) -> None:
    r = http.get("/v1/apps")
    assert r.status_code == 200
    (app,) = [a for a in r.json()["apps"] if a["name"] == "t"]
    assert app["version"] == 1 and app["state"] == "active"
    fns = {f["name"]: f for f in app["functions"]}
    echo = fns["echo"]
    assert [(p["name"], p["kind"]) for p in echo["params"]] == [
        ("x", "POSITIONAL_OR_KEYWORD"), ("scale", "KEYWORD_ONLY"), ("note", "KEYWORD_ONLY")]
    assert echo["params"][1]["default"] == 1 and echo["params"][1]["annotation"] == "int"
    assert echo["returns"] == "dict[str, Any]" and echo["doc"] == "Its arguments back, as JSON."
    assert fns["count"]["streams"] and not echo["streams"]
    assert echo["url"] == "/v1/apps/t/echo"


def test_json_call_returns_the_result_and_the_call_id(http: Any) -> None:
    r = post(http, "echo", {"a": [1, 2.5, None, True, "é"]}, scale=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["result"] == {"x": {"a": [1, 2.5, None, True, "é"]}, "scale": 3, "note": ""}
    assert body["call_id"] and r.headers["x-gpufn-call-id"] == body["call_id"]
    assert post(http, "noop").json()["result"] is None
    # An empty body is a call without arguments; priority and timeout are call options.
    r = http.post("/v1/apps/t/noop?priority=5&timeout=30")
    assert r.status_code == 200 and r.json()["result"] is None
    r = http.post("/v1/apps/t/echo?version=1", json={"kwargs": {"x": 7}})
    assert r.json()["result"]["x"] == 7


def test_nested_calls_and_gangs_and_batches(http: Any, served: ServedGateway) -> None:
    # gather=True on a gang of two: every rank's value, in rank order.
    r = post(http, "ranks")
    assert r.status_code == 200, r.text
    assert r.json()["result"] == [0, 1]
    # spmd=False: one helper process over both devices, JSON in and out there too.
    r = post(http, "whole", 3)
    assert r.status_code == 200 and r.json()["result"] == {"x": 3, "devices": 2}, r.text
    r = post(http, "whole", 3, as_tensor=True)
    assert r.status_code == 500 and r.json()["error"]["type"] == "NotJSONSerializable", r.text
    # One batch may hold JSON callers (HTTP) and pickle callers (Python): each gets its own.
    client = served.client()
    try:
        double = gpufn.lookup("t", "double")
        with client_as_default(client):
            py_calls = [double.spawn(i) for i in range(2)]
            with httpx.Client(base_url=served.url, timeout=60,
                              headers={"Authorization": f"Bearer {served.token}"}) as h:
                import concurrent.futures as cf

                with cf.ThreadPoolExecutor(2) as pool:
                    rs = list(pool.map(lambda i: post(h, "double", 10 + i), range(2)))
            assert [c.get(timeout=60) for c in py_calls] == [0, 2]
        assert [r.json().get("result") for r in rs] == [20, 22], [r.text for r in rs]
        assert any((c.result_meta().get("batch_size") or 1) > 1 for c in py_calls)
    finally:
        client.close()


class client_as_default:
    """Use this client as gpufn's default connection for the block."""

    def __init__(self, client: gpufn.Client) -> None:
        self.client = client

    def __enter__(self) -> None:
        from gpufn.client import default

        self.saved = default._default
        default._default = self.client

    def __exit__(self, *exc: Any) -> None:
        from gpufn.client import default

        default._default = self.saved


# --------------------------------------------------------------------------- errors


def test_no_token_or_a_wrong_one_is_401_and_nothing_runs(served: ServedGateway,
                                                         tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    body = {"args": [str(marker)]}
    with httpx.Client(base_url=served.url, timeout=30) as h:
        for headers in ({}, {"Authorization": "Bearer wrong-token"},
                        {"Authorization": f"Basic {served.token}"}):
            r = h.post("/v1/apps/t/touch", json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["type"] == "AuthenticationError"
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/apps", "/v1/status", "/v1/models"):
            assert h.get(path).status_code == 401
        time.sleep(0.5)
        assert not marker.exists()
        r = h.post("/v1/apps/t/touch", json=body, headers={"Authorization": f"Bearer {served.token}"})
        assert r.status_code == 200 and marker.read_text() == "ran"


@pytest.mark.parametrize("body, why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"args": 5}', '"args" must be a list'),
    (b'{"kwargs": []}', '"kwargs" must be an object'),
    (b'{"args": [], "extra": 1}', "unknown field"),
])
def test_malformed_body_is_400(http: Any, body: bytes, why: str) -> None:
    r = http.post("/v1/apps/t/echo", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_arguments_that_do_not_bind_are_400_before_anything_runs(http: Any) -> None:
    r = post(http, "echo")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadArguments" and "missing a required argument: 'x'" in err["message"]
    assert "t.echo(x: Any, *, scale: int=1, note: str='')" in err["message"]
    assert "too many positional" in post(http, "echo", 1, 2).json()["error"]["message"]
    assert "unexpected keyword" in post(http, "echo", 1, nope=2).json()["error"]["message"]
    for query in ("priority=high", "timeout=-1", "version=0", "colour=red"):
        r = http.post(f"/v1/apps/t/noop?{query}")
        assert r.status_code == 400, (query, r.text)


def test_unknown_app_function_version_or_route_is_404(http: Any) -> None:
    r = post(http, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "NotFound" and "echo" in err["message"] and "t" in err["apps"]
    r = http.post("/v1/apps/nosuchapp/echo", json={})
    assert r.status_code == 404 and "t" in r.json()["error"]["apps"]
    r = http.post("/v1/apps/t/echo?version=9", json={"args": [1]})
    assert r.status_code == 404 and "no version 9" in r.json()["error"]["message"]
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound"
    assert http.get("/v1/apps/t/echo").status_code == 405


def test_remote_exception_and_non_json_result_are_500_naming_the_type(
        served: ServedGateway, http: Any) -> None:
    r = post(http, "fail", "no luck")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "ValueError" and err["message"] == "no luck" and err["remote"]
    # no traceback (it names server paths) in the answer: the gateway's log has it
    assert "traceback" not in err and "raise ValueError(message)" not in r.text
    assert r.headers["x-request-id"] in served.log()
    assert "raise ValueError(message)" in served.log()
    r = post(http, "tensor")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "NotJSONSerializable" and "torch.Tensor" in err["message"]


# --------------------------------------------------------------------------- streaming


def test_sse_streams_each_value_then_end(served: ServedGateway, http: Any) -> None:
    with http.stream("POST", "/v1/apps/t/count", json={"args": [5]},
                     headers={"Accept": "text/event-stream"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = list(events(r.iter_lines()))
    assert got[:5] == [("message", str(i)) for i in range(5)]
    assert got[5][0] == "end" and json.loads(got[5][1])["items"] == 5
    # Without Accept: text/event-stream, every value as one list.
    assert post(http, "count", 4).json()["result"] == [0, 1, 2, 3]
    # A plain function asked for as a stream: its value as one event.
    with http.stream("POST", "/v1/apps/t/echo", json={"args": [1]},
                     headers={"Accept": "text/event-stream"}) as r:
        got = list(events(r.iter_lines()))
    assert json.loads(got[0][1])["x"] == 1 and got[1][0] == "end"


def test_an_exception_mid_stream_arrives_as_an_error_event(http: Any) -> None:
    with http.stream("POST", "/v1/apps/t/count", json={"args": [10], "kwargs": {"fail_at": 3}},
                     headers={"Accept": "text/event-stream"}) as r:
        got = list(events(r.iter_lines()))
    assert got[:3] == [("message", "0"), ("message", "1"), ("message", "2")]
    name, data = got[3]
    assert name == "error" and len(got) == 4
    assert json.loads(data)["type"] == "RuntimeError" and json.loads(data)["message"] == "boom at 3"
    with http.stream("POST", "/v1/apps/t/tensors", json={"args": [3]},
                     headers={"Accept": "text/event-stream"}) as r:
        got = list(events(r.iter_lines()))
    assert got[0] == ("message", "1") and got[1][0] == "error"
    assert json.loads(got[1][1])["type"] == "NotJSONSerializable"


def running_ids(served: ServedGateway) -> set[str]:
    client = served.client()
    try:
        return {r["id"] for d in client.status()["devices"] for r in d["running"]}
    finally:
        client.close()


def test_closing_the_sse_connection_cancels_the_remote_generator(
        served: ServedGateway, http: Any, tmp_path: Path) -> None:
    marker = tmp_path / "finally"
    with http.stream("POST", "/v1/apps/t/count", headers={"Accept": "text/event-stream"},
                     json={"args": [100000], "kwargs": {"delay": 0.02, "marker": str(marker)}}) as r:
        call_id = r.headers["x-gpufn-call-id"]
        seen = []
        for _, data in events(r.iter_lines()):
            seen.append(int(data))
            if len(seen) == 3:
                break
    # The connection is closed: the generator's finally ran on its worker, the call ended.
    assert seen == [0, 1, 2]
    assert wait_for(marker) == "finally"
    deadline = time.monotonic() + 10
    while call_id in running_ids(served):
        assert time.monotonic() < deadline, "the cancelled stream still runs"
        time.sleep(0.05)


def test_disconnecting_from_a_plain_call_cancels_it(served: ServedGateway, tmp_path: Path) -> None:
    marker = tmp_path / "finally"
    with httpx.Client(base_url=served.url, timeout=1.0,
                      headers={"Authorization": f"Bearer {served.token}"}) as h, \
            pytest.raises(httpx.ReadTimeout):
        post(h, "sleepy", 60, marker=str(marker))
    assert wait_for(marker) == "finally"  # interrupted long before its 60 s


# --------------------------------------------------------------------------- spawned calls


def test_spawn_get_and_delete(http: Any) -> None:
    r = http.post("/v1/apps/t/echo/spawn", json={"args": ["later"]})
    assert r.status_code == 202
    call_id = r.json()["call_id"]
    deadline = time.monotonic() + 30
    while (view := http.get(f"/v1/calls/{call_id}").json())["state"] != "done":
        assert view["state"] in ("queued", "running", "pending") and time.monotonic() < deadline
        time.sleep(0.05)
    assert view["result"]["x"] == "later" and view["function"] == "t.echo"
    long = http.post("/v1/apps/t/sleepy/spawn", json={"args": [60]}).json()["call_id"]
    deadline = time.monotonic() + 30
    while http.get(f"/v1/calls/{long}").json()["state"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = http.delete(f"/v1/calls/{long}")
    assert r.status_code == 200 and r.json()["cancelled"] is True
    while (view := http.get(f"/v1/calls/{long}").json())["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert view["state"] == "cancelled" and view["error"]["type"] == "Cancelled"
    assert http.delete(f"/v1/calls/{long}").json()["cancelled"] is False
    r = http.get("/v1/calls/nosuchcall")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound"
    r = http.post("/v1/apps/t/count/spawn", json={"args": [3]})
    assert r.status_code == 400 and "event-stream" in r.json()["error"]["message"]


def test_queue_full_is_429(served: ServedGateway, http: Any) -> None:
    # blocker runs one at a time per device (2 devices); the queue holds 4 per function.
    ids = []
    for _ in range(8):
        r = http.post("/v1/apps/t/blocker/spawn", json={"args": [60]})
        assert r.status_code == 202
        ids.append(r.json()["call_id"])
    client = served.client()
    try:
        views = [http.get(f"/v1/calls/{i}").json() for i in ids]
        deadline = time.monotonic() + 60
        while sum(v["state"] == "failed" for v in views) < 2:  # 2 run, 4 wait, 2 refused
            assert time.monotonic() < deadline, views
            time.sleep(0.1)
            views = [http.get(f"/v1/calls/{i}").json() for i in ids]
        refused = [v for v in views if v["state"] == "failed"]
        assert {v["error"]["type"] for v in refused} == {"QueueFull"}
        queued = {q["function"]: q["queued"] for q in client.status()["queue_by_priority"]}
        assert queued.get("blocker") == 4, queued  # full, so the next call is refused at once
        r = http.post("/v1/apps/t/blocker", json={"args": [60]}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "QueueFull"
    finally:
        client.close()
        for i in ids:
            http.delete(f"/v1/calls/{i}")


def test_timeout_is_504(http: Any) -> None:
    r = http.post("/v1/apps/t/sleepy?timeout=0.5", json={"args": [30]})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "Timeout"


# --------------------------------------------------------------------------- operations


def test_curl_json_call_and_stream(served: ServedGateway) -> None:
    auth = f"Authorization: Bearer {served.token}"
    out = subprocess.run(["curl", "-sS", "-X", "POST", f"{served.url}/v1/apps/t/echo", "-H", auth,
                          "-H", "Content-Type: application/json", "-d", '{"args": ["curl"]}'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["result"]["x"] == "curl", out.stderr
    out = subprocess.run(["curl", "-sSN", "-X", "POST", f"{served.url}/v1/apps/t/count", "-H", auth,
                          "-H", "Accept: text/event-stream", "-d", '{"args": [3]}'],
                         capture_output=True, text=True, timeout=60)
    assert list(events(iter(out.stdout.splitlines())))[:3] == [
        ("message", "0"), ("message", "1"), ("message", "2")]
    assert "event: end" in out.stdout
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                          f"{served.url}/v1/apps"], capture_output=True, text=True, timeout=60)
    assert out.stdout == "401"


def test_request_metrics_on_the_scheduler_endpoint(served: ServedGateway, http: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    call_id = post(http, "noop").json()["call_id"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics",
                                  timeout=30).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    reqs = [s for s in fams["gpufn_http_requests"].samples if s.name == "gpufn_http_requests_total"]
    by = {(s.labels["route"], s.labels["status"]): s.value for s in reqs}
    assert by[("/v1/apps/{app}/{function}", "200")] >= 1
    assert by.get(("/v1/apps/{app}/{function}", "401"), 0) >= 0
    lat = fams["gpufn_http_request_duration_seconds"].samples
    assert any(s.name.endswith("_count") and s.labels["route"] == "/v1/apps/{app}/{function}"
               and s.value >= 1 for s in lat)
    assert call_id not in body and "/v1/apps/t/" not in body  # no names or ids in labels
    assert fams["gpufn_calls"].samples  # the scheduler's own metrics are still there


def test_idle_connections_are_closed(served: ServedGateway) -> None:
    from gpufn.cluster.gateway import GatewayProcess

    # A gateway of its own that forgets idle tokens after 2 s (the module's keeps them 300 s,
    # so that no test here passes because a connection was closed for being idle).
    gw = GatewayProcess(served.address, "127.0.0.1", 0, env={"GPUFN_HTTP_CLIENT_IDLE": "2"})
    url = gw.start()
    client = served.client()
    try:
        before = client.status()["clients"]
        with httpx.Client(base_url=url, timeout=30,
                          headers={"Authorization": f"Bearer {served.token}"}) as h:
            assert post(h, "noop").status_code == 200
            assert client.status()["clients"] == before + 1
            deadline = time.monotonic() + 30
            while client.status()["clients"] > before:
                assert time.monotonic() < deadline, "the gateway kept its idle connection"
                time.sleep(0.2)
            assert post(h, "noop").status_code == 200  # and connects again on the next request
    finally:
        client.close()
        gw.stop()


def test_tls_gateway_and_restart_after_a_crash(served: ServedGateway, tmp_path: Path) -> None:
    import os
    import signal

    from gpufn.cluster.gateway import GatewayProcess, refusal

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                           str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                           "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True, timeout=60)
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr.decode()[-200:]}")
    key.chmod(0o644)
    assert "chmod 600" in (refusal("0.0.0.0", cert, key) or "")
    key.chmod(0o600)
    assert refusal("0.0.0.0", cert, key) is None
    gw = GatewayProcess(served.address, "127.0.0.1", 0, cert, key)
    url = gw.start()
    try:
        assert url.startswith("https://127.0.0.1:")
        import ssl

        with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(cert)), timeout=30,
                          headers={"Authorization": f"Bearer {served.token}"}) as h:
            assert post(h, "echo", "tls").json()["result"]["x"] == "tls"
            assert gw.proc is not None
            first = gw.proc.pid
            os.kill(first, signal.SIGKILL)  # the gateway dies: serve starts it again, same port
            deadline = time.monotonic() + 60
            while True:
                try:
                    if post(h, "echo", 2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the gateway was not restarted"
                time.sleep(0.2)
            assert gw.proc.pid != first
        with httpx.Client(base_url=url.replace("https", "http"), timeout=10) as plain, \
                pytest.raises(httpx.TransportError):
            plain.get("/healthz")  # no plaintext on a TLS port
    finally:
        gw.stop()


def test_an_off_loopback_gateway_without_tls_is_refused(tmp_path: Path) -> None:
    from .served import gpufn_cmd, serve_env

    r = subprocess.run([*gpufn_cmd(), "serve", "--port", "0", "--http-port", "0", "--http-host",
                        "0.0.0.0", "--no-workers"], env=serve_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "must use TLS" in r.stderr and "--http-cert" in r.stderr, r.stderr
    assert not (tmp_path / "cluster.json").exists()  # refused before anything started


# --------------------------------------------------------------------------- OpenAI


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello GPUs"}]


@pytest.fixture(scope="module")
def llm(served: ServedGateway) -> Iterator[Any]:
    """examples/openai_chat.py deployed as `llm`, and the official OpenAI client."""
    openai = pytest.importorskip("openai")
    client = served.client()
    try:
        gpufn.deploy(EXAMPLES / "openai_chat.py", name="llm", client=client)
    finally:
        client.close()
    yield openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.token, max_retries=0)


def test_openai_models_and_streamed_chat_equal_remote_gen(served: ServedGateway, llm: Any) -> None:
    import sys

    sys.path.insert(0, str(EXAMPLES))
    try:
        import openai_chat
    finally:
        sys.path.remove(str(EXAMPLES))
    models = [m.id for m in llm.models.list().data]
    assert "tiny-llama" in models
    chunks = list(llm.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                              max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(streamed.split()) == 12
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(openai_chat.prompt_ids(MESSAGES))
    # The same greedy generation through the Python client's .remote_gen of the deployment.
    client = served.client()
    try:
        with client_as_default(client):
            pieces = list(gpufn.lookup("llm", "chat").remote_gen(MESSAGES, max_tokens=12))
    finally:
        client.close()
    assert "".join(x for x in pieces if isinstance(x, str)) == streamed
    # And the sharded (TP=2) model generates what one process generates.
    local = openai_chat.generate(openai_chat.build_model(), MESSAGES, max_tokens=12)
    assert "".join(x for x in local if isinstance(x, str)) == streamed
    # Not streamed: the joined stream, with the usage.
    answer = llm.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=12)
    assert answer.choices[0].message.content == streamed
    assert answer.choices[0].finish_reason == "length" and answer.usage.total_tokens == (
        answer.usage.prompt_tokens + 12)


def test_openai_parameters_reach_the_function(llm: Any) -> None:
    def text(**kw: Any) -> Any:
        return llm.chat.completions.create(model="tiny-llama", messages=MESSAGES, **kw).choices[0]

    greedy = text(max_tokens=8).message.content
    sampled = text(max_tokens=8, temperature=1.5, top_p=0.9, seed=7).message.content
    assert sampled == text(max_tokens=8, temperature=1.5, top_p=0.9, seed=7).message.content
    assert sampled != greedy  # sampling at temperature 1.5 over 512 tokens: not the argmax path
    third = greedy.split()[2]
    stopped = text(max_tokens=8, stop=[" " + third])
    assert stopped.message.content == " ".join(greedy.split()[:2])
    assert stopped.finish_reason == "stop"


def test_openai_errors(llm: Any, http: Any) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as nf:
        llm.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert "tiny-llama" in str(nf.value)
    with pytest.raises(openai.BadRequestError):
        llm.chat.completions.create(model="tiny-llama", messages=[])
    r = http.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": MESSAGES,
                                                "temperature": 9})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(llm.base_url), api_key="wrong", max_retries=0).models.list()


def test_curl_chat_completion_stream(served: ServedGateway, llm: Any) -> None:
    body = json.dumps({"model": "tiny-llama", "messages": MESSAGES, "stream": True,
                       "max_tokens": 4})
    out = subprocess.run(["curl", "-sSN", f"{served.url}/v1/chat/completions", "-H",
                          f"Authorization: Bearer {served.token}", "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=120)
    datas = [d for _, d in events(iter(out.stdout.splitlines()))]
    assert datas[-1] == "[DONE]", out.stdout
    pieces = [json.loads(d)["choices"][0]["delta"].get("content", "") for d in datas[:-1]]
    assert len("".join(pieces).split()) == 4


# --------------------------------------------------------------------------- dashboard


def chrome(tmp_path: Path) -> Any:
    """Headless Chromium driven by Selenium (Debian's chromium and chromium-driver)."""
    import shutil

    pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("Chromium is not installed here (apt-get install chromium chromium-driver; "
                    ".ci/run installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1400,1000",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_dashboard_in_a_real_browser(served: ServedGateway, http: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    post(http, "fail", "shown on the dashboard")  # a recent error
    browser = chrome(tmp_path)
    try:
        wait = WebDriverWait(browser, 30)
        browser.get(served.url + "/")
        wait.until(lambda b: b.find_element(By.ID, "login").is_displayed())
        browser.find_element(By.ID, "token").send_keys("wrong-token")
        browser.find_element(By.CSS_SELECTOR, "#login-form button").click()
        wait.until(lambda b: "refused" in b.find_element(By.ID, "login-error").text)
        browser.find_element(By.ID, "token").send_keys(served.token)
        browser.find_element(By.CSS_SELECTOR, "#login-form button").click()
        wait.until(lambda b: b.execute_script("return document.body.dataset.rendered") == "1")
        devices = browser.find_elements(By.CSS_SELECTOR, "#devices tbody tr[data-device]")
        assert len(devices) == 2 and "/ 8.0 GiB" in devices[0].text and "free" in devices[0].text
        app = browser.find_element(By.CSS_SELECTOR, '#apps tbody tr[data-app="t"]')
        assert "v1" in app.text and "echo" in app.text and "active" in app.text
        assert "ready: 2" in browser.find_element(By.ID, "hosts").text
        assert "shown on the dashboard" in browser.find_element(By.ID, "errors").text
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"dashboard screenshot: {shot}")
        # The token lives in the tab's session: a reload stays signed in, and it refreshes.
        before = browser.find_element(By.ID, "updated").text
        browser.refresh()
        wait.until(lambda b: b.execute_script("return document.body.dataset.rendered") == "1")
        assert not browser.find_element(By.ID, "login").is_displayed()
        wait.until(lambda b: b.find_element(By.ID, "updated").text != before)
        assert browser.execute_script("return localStorage.length") == 0
    finally:
        browser.quit()


def test_a_call_to_a_stopped_app_is_503_app_stopped(served: ServedGateway, http: Any) -> None:
    client = served.client()
    try:
        gpufn.deploy(APP, name="halted", client=client)
    finally:
        client.close()
    first = post_to(http, "halted", "echo", 1)
    assert first.status_code == 200, first.text
    out = subprocess.run([*gpufn_cmd(), "app", "stop", "halted"], env=served.env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for _ in range(2):  # the first answer, and one the gateway may have cached
        r = post_to(http, "halted", "echo", 1)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "AppStopped", r.text


def post_to(http: Any, app: str, fn: str, *args: Any) -> Any:
    return http.post(f"/v1/apps/{app}/{fn}", json={"args": list(args)})


def test_sse_of_200_values_delivers_every_one_then_end(http: Any) -> None:
    with http.stream("POST", "/v1/apps/t/count", json={"args": [200]},
                     headers={"Accept": "text/event-stream"}) as r:
        assert r.status_code == 200
        got = list(events(r.iter_lines()))
    assert got[:200] == [("message", str(i)) for i in range(200)]
    assert len(got) == 201 and got[200][0] == "end", got[195:]
    assert json.loads(got[200][1])["items"] == 200


def test_disconnecting_from_a_plain_call_asked_as_a_stream_cancels_it(
        served: ServedGateway, tmp_path: Path) -> None:
    marker = tmp_path / "finally"
    with httpx.Client(base_url=served.url, timeout=60,
                      headers={"Authorization": f"Bearer {served.token}"}) as h, \
            h.stream("POST", "/v1/apps/t/sleepy", headers={"Accept": "text/event-stream"},
                     json={"args": [60], "kwargs": {"marker": str(marker),
                                                    "started": str(tmp_path / "started")}}) as r:
        assert r.status_code == 200
        call_id = r.headers["x-gpufn-call-id"]
        assert wait_for(tmp_path / "started") == "started"  # it runs (perhaps under a lease)
    # left before its value: the call is cancelled on its worker, long before its 60 s
    assert wait_for(marker) == "finally"
    deadline = time.monotonic() + 10
    while call_id in running_ids(served):
        assert time.monotonic() < deadline, "the abandoned call still runs"
        time.sleep(0.05)


def test_spawned_and_streamed_calls_outlive_the_idle_connection_reaper(
        served: ServedGateway) -> None:
    """A gateway that closes a token's connection after 1 s idle: a stream of 4 s, and a
    spawned call of 4 s with no request meanwhile, hold the connection (they are in
    flight), and both end well."""
    from gpufn.cluster.gateway import GatewayProcess

    gw = GatewayProcess(served.address, "127.0.0.1", 0, env={"GPUFN_HTTP_CLIENT_IDLE": "1"})
    url = gw.start()
    client = served.client()
    try:
        before = client.status()["clients"]
        with httpx.Client(base_url=url, timeout=60,
                          headers={"Authorization": f"Bearer {served.token}"}) as h:
            with h.stream("POST", "/v1/apps/t/count", headers={"Accept": "text/event-stream"},
                          json={"args": [8], "kwargs": {"delay": 0.5}}) as r:
                got = list(events(r.iter_lines()))
            assert got[:8] == [("message", str(i)) for i in range(8)], got
            assert got[8][0] == "end", got
            spawned = h.post("/v1/apps/t/sleepy/spawn", json={"args": [4]})
            assert spawned.status_code == 202, spawned.text
            call_id = spawned.json()["call_id"]
            time.sleep(3)  # no request: only the call in flight keeps the connection
            assert client.status()["clients"] == before + 1, "the gateway's connection closed"
            time.sleep(3)
            deadline = time.monotonic() + 30
            while (view := h.get(f"/v1/calls/{call_id}").json())["state"] != "done":
                assert view["state"] in ("queued", "running", "pending"), view
                assert time.monotonic() < deadline, view
                time.sleep(0.2)
            assert view["result"] == 4
    finally:
        client.close()
        gw.stop()


def test_draining_is_503(served: ServedGateway, http: Any) -> None:
    """Last: it shuts the served cluster down."""
    spawned = http.post("/v1/apps/t/sleepy/spawn", json={"args": [8]}).json()["call_id"]
    deadline = time.monotonic() + 30
    while http.get(f"/v1/calls/{spawned}").json()["state"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client = served.client()
    try:
        client.drain(30, "test")
    finally:
        client.close()
    r = post(http, "noop")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "ConnectionLost" and "shutting down" in r.json()["error"]["message"]
