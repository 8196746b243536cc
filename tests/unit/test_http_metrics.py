"""The gateway's request metrics (gpufn/http/metrics.py) as the scheduler's exporter reads
them: prometheus-client's multiprocess files, written by a process of their own (the
gateway's, here a child running a Starlette app under the middleware), by route template,
method and status, with their latency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.timeout(60)

SCENARIO = textwrap.dedent('''
    import asyncio, json, sys
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient
    from gpufn.http.metrics import RequestMetrics, recorder

    lifespans = []

    async def call(request):
        return PlainTextResponse("ok")

    async def slow(request):
        await asyncio.sleep(0.06)
        return PlainTextResponse("slow")

    async def gone(request):
        return PlainTextResponse("no", status_code=404)

    async def boom(request):
        raise RuntimeError("boom")

    async def lifespan(app):
        lifespans.append("up")
        yield

    routes = [Route("/v1/apps/{app}/{function}", call, methods=["GET", "POST"]),
              Route("/slow", slow), Route("/v1/calls/{id}", gone), Route("/boom", boom)]
    rec = recorder()
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(RequestMetrics, rec=rec)])
    with TestClient(app, raise_server_exceptions=False) as client:
        client.get("/v1/apps/a/f"); client.get("/v1/apps/b/g"); client.post("/v1/apps/a/f")
        client.get("/slow"); client.get("/v1/calls/c-1"); client.get("/boom")
        client.get("/nowhere")
    bare = Starlette(routes=routes, middleware=[Middleware(RequestMetrics, rec=None)])
    with TestClient(bare) as client:
        assert client.get("/v1/apps/a/f").text == "ok"  # no recorder: passed through
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    samples = [[s.name, s.labels, s.value] for m in registry.collect() for s in m.samples]
    print(json.dumps({"samples": samples, "lifespans": lifespans, "rec": rec is not None}))
''')


def _run(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", SCENARIO], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("prom")
    return _run({**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)})


def _count(recorded: dict[str, Any], route: str, method: str, status: str) -> float:
    return sum(v for n, labels, v in recorded["samples"] if n == "gpufn_http_requests_total"
               and labels == {"route": route, "method": method, "status": status})


def test_requests_are_counted_by_route_template_method_and_status(recorded: dict[str, Any]) -> None:
    assert recorded["rec"] and recorded["lifespans"] == ["up"]
    route = "/v1/apps/{app}/{function}"
    assert _count(recorded, route, "GET", "200") == 2  # two apps, one template
    assert _count(recorded, route, "POST", "200") == 1
    assert _count(recorded, "/slow", "GET", "200") == 1
    assert _count(recorded, "/v1/calls/{id}", "GET", "404") == 1
    assert _count(recorded, "/boom", "GET", "500") == 1  # raised before any answer
    assert _count(recorded, "unmatched", "GET", "404") == 1
    names = {labels.get("route") for n, labels, _ in recorded["samples"]}
    assert not any(r and ("/a/" in r or "c-1" in r) for r in names), names  # never a path


def test_latency_is_the_whole_request(recorded: dict[str, Any]) -> None:
    def sample(name: str, route: str, **labels: str) -> float:
        return sum(v for n, lab, v in recorded["samples"] if n == name
                   and lab.get("route") == route and all(lab.get(k) == x for k, x in labels.items()))

    hist = "gpufn_http_request_duration_seconds"
    assert sample(f"{hist}_count", "/slow") == 1
    assert 0.06 <= sample(f"{hist}_sum", "/slow") < 5
    assert sample(f"{hist}_bucket", "/slow", le="0.05") == 0
    assert sample(f"{hist}_bucket", "/slow", le="+Inf") == 1
    assert sample(f"{hist}_count", "/v1/apps/{app}/{function}") == 3
    les = {lab["le"] for n, lab, _ in recorded["samples"] if n == f"{hist}_bucket"}
    # the buckets are the metric's contract (dashboards and alerts name them)
    assert les == {"0.0005", "0.001", "0.002", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25",
                   "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "60.0", "300.0", "+Inf"}


def test_without_the_folder_nothing_is_counted(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PROMETHEUS_MULTIPROC_DIR"] = ""
    out = subprocess.run([sys.executable, "-c", "from gpufn.http.metrics import recorder; "
                          "print(recorder() is None)"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
    # the folder given but prometheus-client not installed: nothing counted, nothing raised
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import sys; sys.modules['prometheus_client'] = None; "
                          "from gpufn.http.metrics import recorder; print(recorder() is None)"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
