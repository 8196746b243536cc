"""Prometheus metrics for `gpufn serve --metrics-port N` (needs `pip install gpufn[metrics]`).

A scrape never touches the core from the HTTP thread: it asks the scheduler loop for a
`snapshot` (plain data read from the core's books between two event batches, within one
tick) and turns that into metric families. The hot path only keeps the usage meter's
counters. Names follow Triton's and vLLM's conventions; no label carries a call id or a pid.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books.usage import BOUNDS, Histogram
from gpufn.wire import config

if TYPE_CHECKING:
    from gpufn.scheduler.core import SchedulerCore

log = logging.getLogger("gpufn.scheduler")

SCRAPE_WAIT_S = 5.0


def deployments(core: SchedulerCore) -> list[tuple[str, str, str]]:
    """(app, version, code hash) of each deployed version, for `gpufn_deployment_info`.

    Hook for deployments: a deployment book on the core with `info_rows()` is used as it is;
    until one exists, the rows come from the function records that carry an app."""
    book = getattr(core, "deployments", None)
    if book is not None and hasattr(book, "info_rows"):
        return [(str(a), str(v), str(h)) for a, v, h in book.info_rows()]
    return sorted({(f.app, str(f.version), str(getattr(f, "code_hash", "")))
                   for f in core.functions.values() if f.app})


def snapshot(core: SchedulerCore) -> dict[str, Any]:
    """What one scrape reports, copied out of the core (call on the scheduler's thread)."""
    u = core.ops.usage
    devices = []
    for d in core.devices.values():
        resident = sum(1 for e in d.ledger.models.values() if e.state is Residency.RESIDENT)
        devices.append((d.info.node, d.key, d.ledger.used, d.ledger.capacity, resident))
    workers: dict[tuple[str, str], int] = {}
    for d in core.devices.values():
        workers[(d.info.node, d.state.value)] = workers.get((d.info.node, d.state.value), 0) + 1
    queue = []
    for (fid, prio), n in core.queue.depth_by_priority().items():
        f = core.functions.get(fid)
        queue.append((f.app if f else "", f.name if f else fid, str(prio), n))
    models = core.models.counters()

    def hists(h: dict[tuple[str, str], Histogram]) -> list[tuple[tuple[str, str], list[int], float]]:
        return [(k, list(v.counts), v.total) for k, v in h.items()]

    return {
        "calls": [((a, f, str(v), o), n) for (a, f, v, o), n in u.calls_total.items()],
        "device_seconds": list(u.device_seconds_total.items()),
        "queue_wait": hists(u.queue_wait), "duration": hists(u.duration),
        "queue": queue, "devices": devices, "workers": list(workers.items()),
        "loads": sum(m["loads"] for m in models),
        "evictions": sum(m["evictions"] for m in models),
        "deployments": deployments(core),
    }


def families(snap: dict[str, Any]) -> list[Any]:
    """Prometheus metric families for a snapshot."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    calls = CounterMetricFamily("gpufn_calls", "Calls that ended, by outcome.",
                                labels=["app", "function", "version", "outcome"])
    for labels, n in snap["calls"]:
        calls.add_metric(list(labels), n)
    dev_s = CounterMetricFamily("gpufn_device_seconds", "Device-seconds held by calls.",
                                labels=["app", "function"])
    for (a, f), s in snap["device_seconds"]:
        dev_s.add_metric([a, f], s)
    depth = GaugeMetricFamily("gpufn_queue_depth", "Queued calls.",
                              labels=["app", "function", "priority"])
    for a, f, prio, n in snap["queue"]:
        depth.add_metric([a, f, prio], n)
    out = [calls, dev_s, depth]
    for name, doc, key in (
        ("gpufn_queue_wait_seconds", "Time from submit to dispatch.", "queue_wait"),
        ("gpufn_call_duration_seconds", "Time from dispatch to the end of a call.", "duration"),
    ):
        h = HistogramMetricFamily(name, doc, labels=["app", "function"])
        for (a, f), counts, total in snap[key]:
            cum, buckets = 0, []
            for bound, c in zip([*map(str, BOUNDS), "+Inf"], counts, strict=True):
                cum += c
                buckets.append((bound, cum))
            h.add_metric([a, f], buckets, total)
        out.append(h)
    used = GaugeMetricFamily("gpufn_device_memory_used_bytes", "Device memory the scheduler "
                             "has placed (calls and models).", labels=["host", "device"])
    total = GaugeMetricFamily("gpufn_device_memory_total_bytes", "Device memory capacity.",
                              labels=["host", "device"])
    resident = GaugeMetricFamily("gpufn_models_resident", "Models resident on a device.",
                                 labels=["host", "device"])
    for host, key, u, cap, n in snap["devices"]:
        used.add_metric([host, key], u)
        total.add_metric([host, key], cap)
        resident.add_metric([host, key], n)
    workers = GaugeMetricFamily("gpufn_workers", "Device workers by state.", labels=["host", "state"])
    for (host, state), n in snap["workers"]:
        workers.add_metric([host, state], n)
    loads = CounterMetricFamily("gpufn_model_loads", "Model loads (loader runs).")
    loads.add_metric([], snap["loads"])
    evictions = CounterMetricFamily("gpufn_model_evictions", "Models evicted from a device.")
    evictions.add_metric([], snap["evictions"])
    info = GaugeMetricFamily("gpufn_deployment_info", "Deployed app versions (value 1).",
                             labels=["app", "version", "code_hash"])
    for row in snap["deployments"]:
        info.add_metric(list(row), 1)
    return [*out, used, total, resident, workers, loads, evictions, info]


class Exporter:
    """The HTTP endpoint; `collect` runs on its thread and waits for the loop's snapshot."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._snap: dict[str, Any] | None = None
        self.wanted = False  # read by the scheduler loop once per iteration
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        gateway = config.http_metrics_dir()
        if gateway is not None:  # the HTTP gateway's request counts, from its own process
            from prometheus_client.multiprocess import MultiProcessCollector

            MultiProcessCollector(self.registry, path=str(gateway))
        self.server, self.thread = start_http_server(port, host, registry=self.registry)
        self.port = self.server.server_port

    def fill(self, core: SchedulerCore) -> None:
        """On the scheduler's thread: answer a waiting scrape."""
        try:
            self._snap = snapshot(core)
        except Exception:  # a metrics bug must not take the scheduler down
            log.exception("metrics snapshot failed")
            self._snap = None
        self.wanted = False
        self._ready.set()

    def collect(self) -> list[Any]:
        with self._lock:
            self._ready.clear()
            self.wanted = True
            if not self._ready.wait(SCRAPE_WAIT_S) or self._snap is None:
                return []
            return families(self._snap)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
