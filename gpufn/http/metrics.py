"""Request counts by route and status, and latency, for the scheduler's Prometheus endpoint.

The gateway is its own process: it writes its metrics as prometheus-client's multiprocess
files into the folder `gpufn serve` gives it (PROMETHEUS_MULTIPROC_DIR), and the
scheduler's exporter reads that folder on each scrape (scheduler/metrics.py). Without the
folder, or without prometheus-client, nothing is counted. Routes are labelled by their
template (`/v1/apps/{app}/{function}`), never by a path that holds names or ids.
"""

from __future__ import annotations

import os
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0, 60.0, 300.0)


class _Recorder:
    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.requests = Counter("gpufn_http_requests", "HTTP requests by route, method and "
                                "status.", ["route", "method", "status"])
        self.latency = Histogram("gpufn_http_request_duration_seconds", "HTTP request time "
                                 "from its arrival to the end of its answer (of a stream: its "
                                 "last event).", ["route", "method"], buckets=BUCKETS)

    def record(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)


def recorder() -> _Recorder | None:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        return _Recorder()
    except ImportError:
        return None


class RequestMetrics:
    """ASGI middleware: time and count every HTTP request."""

    def __init__(self, app: ASGIApp, rec: Any) -> None:
        self.app = app
        self.rec = rec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.rec is None:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.rec.record(template, scope.get("method", ""), status, time.perf_counter() - t0)
