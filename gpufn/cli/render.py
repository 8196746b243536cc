"""Rich rendering of scheduler status for `gpufn status` (pure: dict in, renderables out)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table

from gpufn.spec import format_bytes

_STATE_STYLE = {"ready": "green", "starting": "yellow", "restarting": "yellow", "failed": "red",
                "gone": "dim"}


def devices_table(status: dict[str, Any]) -> Table:
    t = Table(title="devices", title_justify="left")
    for col in ("device", "name", "state", "memory used / total", "running", "done", "restarts"):
        t.add_column(col, justify="right" if col in ("done", "restarts") else "left")
    for d in status.get("devices", []):
        running = ", ".join(f"{r['function']} {r['id'][-8:]} ({r['seconds']:.1f}s)"
                            for r in d.get("running", [])) or "-"
        state = d["state"]
        style = _STATE_STYLE.get(state, "")
        pct = 100.0 * d["used"] / d["capacity"] if d["capacity"] else 0.0
        t.add_row(d["key"], d["name"], f"[{style}]{state}[/]" if style else state,
                  f"{format_bytes(d['used'])} / {format_bytes(d['capacity'])} ({pct:.0f}%)",
                  running, str(d.get("completed", 0)), str(d.get("restarts", 0)))
    return t


def models_table(status: dict[str, Any]) -> Table | None:
    rows = [(d["key"], m) for d in status.get("devices", []) for m in d.get("models", [])]
    if not rows:
        return None
    t = Table(title="models", title_justify="left")
    for col in ("device", "model", "state", "bytes", "users", "in use", "uses"):
        t.add_column(col)
    for key, m in rows:
        t.add_row(key, m["name"], m["state"], format_bytes(m["nbytes"]), ", ".join(m.get("users", [])),
                  str(m.get("in_use", 0)), str(m.get("uses", 0)))
    return t


def model_counters_table(status: dict[str, Any]) -> Table | None:
    recs = status.get("models", [])
    if not recs:
        return None
    t = Table(title=f"model pool (policy: {status.get('policy', '?')})", title_justify="left")
    for col in ("model", "bytes", "loads", "mean load", "restores", "mean restore", "offloads",
                "evictions", "failures"):
        t.add_column(col, justify="left" if col == "model" else "right")

    def secs(v: Any) -> str:
        return f"{v * 1000:.0f} ms" if isinstance(v, (int, float)) else "-"

    for r in recs:
        t.add_row(r["name"], format_bytes(r["bytes"]), str(r["loads"]), secs(r["mean_load_s"]),
                  str(r["restores"]), secs(r["mean_restore_s"]), str(r["offloads"]),
                  str(r["evictions"]), str(r["failures"]))
    return t


def functions_table(status: dict[str, Any]) -> Table | None:
    fns = status.get("functions", [])
    if not fns:
        return None
    t = Table(title="functions", title_justify="left")
    for col in ("function", "queued", "calls", "mean run time"):
        t.add_column(col)
    for f in fns:
        ewma = f.get("runtime_ewma")
        t.add_row(f["name"], str(f["queued"]), str(f["calls"]),
                  f"{ewma * 1000:.1f} ms" if isinstance(ewma, (int, float)) else "-")
    return t


def status_view(status: dict[str, Any]) -> Group:
    parts: list[Any] = [devices_table(status)]
    for extra in (models_table(status), model_counters_table(status), functions_table(status)):
        if extra is not None:
            parts.append(extra)
    c = status.get("counters", {})
    parts.append(
        f"queued {status.get('queued', 0)} · running {status.get('running', 0)} · clients "
        f"{status.get('clients', 0)} · " + " · ".join(f"{k} {v}" for k, v in c.items() if v)
    )
    return Group(*parts)
