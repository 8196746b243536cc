"""Rich rendering of scheduler status for `gpufn status` (pure: dict in, renderables out)."""

from __future__ import annotations

import shutil
from datetime import datetime
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpufn.wire.units import format_bytes

_STATE_STYLE = {"ready": "green", "starting": "yellow", "restarting": "yellow", "failed": "red",
                "gone": "dim"}


def key_column(t: Table, header: str) -> None:
    """A column that names what a row is (a device, a function, a user): never cut with
    an ellipsis at narrow widths, folded onto more lines instead."""
    t.add_column(header, overflow="fold")


def narrow() -> bool:
    """A terminal under 100 columns (COLUMNS=80): tables leave out their decorations."""
    return shutil.get_terminal_size().columns < 100


def memory_bar(used: int, capacity: int, width: int = 10) -> str:
    """A text bar (markup) for a device's memory: green, yellow over 70%, red over 90%."""
    frac = min(1.0, used / capacity) if capacity else 0.0
    filled = round(frac * width)
    color = "red" if frac > 0.9 else "yellow" if frac > 0.7 else "green"
    return f"[{color}]{'█' * filled}[/][dim]{'░' * (width - filled)}[/]"


def devices_table(status: dict[str, Any]) -> Table:
    t = Table(title="devices", title_justify="left")
    bar = not narrow()  # the memory bar repeats the percentage: left out under 100 columns
    key_column(t, "device")
    for col in ("name", "state", *(("memory",) if bar else ()), "used / total"):
        t.add_column(col)
    key_column(t, "running")
    for col in ("done", "restarts"):
        t.add_column(col, justify="right", no_wrap=True)
    for d in status.get("devices", []):
        running = ", ".join(f"{r['function']} {r['id']} ({r['seconds']:.1f}s)"
                            for r in d.get("running", [])) or "-"
        state = d["state"]
        style = _STATE_STYLE.get(state, "")
        pct = 100.0 * d["used"] / d["capacity"] if d["capacity"] else 0.0
        t.add_row(d["key"], d["name"], f"[{style}]{state}[/]" if style else state,
                  *((memory_bar(d["used"], d["capacity"]),) if bar else ()),
                  f"{format_bytes(d['used'])} / {format_bytes(d['capacity'])} ({pct:.0f}%)",
                  running, str(d.get("completed", 0)), str(d.get("restarts", 0)))
    return t


def models_table(status: dict[str, Any]) -> Table | None:
    rows = [(d["key"], m) for d in status.get("devices", []) for m in d.get("models", [])]
    if not rows:
        return None
    t = Table(title="models", title_justify="left")
    key_column(t, "device")
    key_column(t, "model")
    for col in ("state", "bytes", "users", "in use", "uses"):
        t.add_column(col)
    shown: set[str] = set()
    for key, m in rows:
        if m.get("shards"):  # a sharded model: one row, its gang and each rank's bytes
            if m["key"] in shown:
                continue
            shown.add(m["key"])
            parts = [(k, s) for k, s in rows if s["key"] == m["key"]]
            key = " + ".join(k for k, _ in parts)
            size = " + ".join(format_bytes(s["nbytes"]) for _, s in parts)
        else:
            size = format_bytes(m["nbytes"])
        t.add_row(key, m["name"], m["state"], size, ", ".join(m.get("users", [])),
                  str(m.get("in_use", 0)), str(m.get("uses", 0)))
    return t


def _app_versions(functions: list[dict[str, Any]], key: str) -> str:
    """Which apps and versions use a model ("demo v1, v2"); "-" for ad-hoc functions only."""
    by_app: dict[str, set[int]] = {}
    for f in functions:
        if key in f.get("model_keys", ()) and f.get("app"):
            by_app.setdefault(f["app"], set()).add(int(f.get("version") or 0))
    return "; ".join(f"{app} " + ", ".join(f"v{v}" for v in sorted(vs))
                     for app, vs in sorted(by_app.items())) or "-"


def model_counters_table(status: dict[str, Any]) -> Table | None:
    recs = status.get("models", [])
    if not recs:
        return None
    functions = status.get("functions", [])
    apps = any(f.get("app") for f in functions)
    t = Table(title=f"model pool (policy: {status.get('policy', '?')})", title_justify="left")
    key_column(t, "model")
    if apps:
        key_column(t, "app")
    # Under 100 columns the host-memory counters are left out: the model keeps its room.
    cols = ("bytes", "loads", "mean load", *(() if narrow() else (
        "restores", "mean restore", "offloads")), "evictions", "failures")
    for col in cols:
        t.add_column(col, justify="right")

    def secs(v: Any) -> str:
        return f"{v * 1000:.0f} ms" if isinstance(v, (int, float)) else "-"

    for r in recs:
        name = r["name"]
        if r.get("count", 1) > 1:
            name += f" (TP={r['count']}" + (f" on {', '.join(r['gang'])})" if r.get("gang") else ")")
        where = (_app_versions(functions, r.get("key", "")),) if apps else ()
        per = " per device" if r.get("count", 1) > 1 else ""
        cells = {"bytes": format_bytes(r["bytes"]) + per, "loads": str(r["loads"]),
                 "mean load": secs(r["mean_load_s"]), "restores": str(r["restores"]),
                 "mean restore": secs(r["mean_restore_s"]), "offloads": str(r["offloads"]),
                 "evictions": str(r["evictions"]), "failures": str(r["failures"])}
        t.add_row(name, *where, *(cells[c] for c in cols))
    return t


def functions_table(status: dict[str, Any]) -> Table | None:
    fns = status.get("functions", [])
    if not fns:
        return None
    apps = any(f.get("app") for f in fns)
    t = Table(title="functions", title_justify="left")
    for col in ("function", *(("app",) if apps else ())):
        key_column(t, col)
    for col in (*(("version",) if apps else ()), "queued", "calls", "mean run time"):
        t.add_column(col)
    order = sorted(fns, key=lambda f: (f.get("app") or "", f["name"], f.get("version") or 0))
    for f in order:
        ewma = f.get("runtime_ewma")
        where = ((f.get("app") or "-", f"v{f['version']}" if f.get("app") else "-") if apps else ())
        t.add_row(f["name"], *where, str(f["queued"]), str(f["calls"]),
                  f"{ewma * 1000:.1f} ms" if isinstance(ewma, (int, float)) else "-")
    return t


def queue_table(status: dict[str, Any]) -> Table | None:
    rows = status.get("queue_by_priority", [])
    if not rows:
        return None
    t = Table(title="queue by priority", title_justify="left")
    t.add_column("priority", justify="right")
    key_column(t, "function")
    t.add_column("queued", justify="right")
    for r in rows:
        name = f"{r['app']}.{r['function']}" if r.get("app") else r["function"]
        t.add_row(str(r["priority"]), name, str(r["queued"]))
    return t


def hosts_table(status: dict[str, Any]) -> Table | None:
    hosts = status.get("hosts", [])
    if not hosts:
        return None
    t = Table(title="hosts", title_justify="left")
    key_column(t, "host")
    for col in ("connected", "devices", "workers"):
        t.add_column(col)
    for h in hosts:
        workers = ", ".join(f"{n} {state}" for state, n in sorted(h["workers"].items()))
        t.add_row(h["host"], "[green]yes[/]" if h["connected"] else "[red]no[/]",
                  str(h["devices"]), workers)
    return t


def status_view(status: dict[str, Any]) -> Group:
    parts: list[Any] = [devices_table(status)]
    for extra in (hosts_table(status), models_table(status), model_counters_table(status),
                  functions_table(status), queue_table(status)):
        if extra is not None:
            parts.append(extra)
    c = status.get("counters", {})
    if status.get("draining"):
        parts.append("[yellow]draining: shutting down once running calls finish[/]")
    for row in status.get("capped", []):  # calls waiting at their user's device cap
        parts.append(Text(row["why"], style="yellow"))
    you = status.get("you")
    who = (f" · you: {you['user']}" + (" (admin: every call)" if you["admin"] else
                                       " (your calls only)")) if you else ""
    fields = [f"queued {status.get('queued', 0)}", f"running {status.get('running', 0)}",
              f"clients {status.get('clients', 0)}", *(f"{k} {v}" for k, v in c.items() if v)]
    parts.append(Text(" · ".join(fields) + who))
    return Group(*parts)


def users_table(users: list[dict[str, Any]]) -> Table:
    """`gpufn token list`: users and what they may do (tokens are never shown)."""
    t = Table(title="users", title_justify="left")
    key_column(t, "user")
    for col in ("may", "max priority", "max devices", "connections", "created"):
        t.add_column(col, justify="right" if col == "connections" else "left")
    for u in users:
        may = ("everything (the cluster's token)" if u.get("admin") else
               "call, operate" if u.get("operator") else "call")
        created = (datetime.fromtimestamp(u["created"]).strftime("%Y-%m-%d %H:%M")
                   if u.get("created") else "-")
        limit = {None: "-"}
        t.add_row(Text(u["name"]), may, limit.get(u.get("max_priority"), str(u.get("max_priority"))),
                  limit.get(u.get("max_devices"), str(u.get("max_devices"))),
                  str(u.get("connections", 0)), created)
    return t


def usage_table(rows: list[dict[str, Any]], by: str, since: str) -> Table:
    t = Table(title=f"usage by {by} (since {since})", title_justify="left")
    key_column(t, {"app": "app", "user": "user"}.get(by, "function"))
    for col in ("calls", "device-s", "device-h", "mean wait"):  # short: the key keeps room
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("outcomes")
    for r in rows:
        if by == "function":
            name = f"{r['app']}.{r['function']}" if r["app"] else r["function"]
        else:
            name = r[by] or "(ad hoc)" if by == "app" else r[by] or "?"
        outcomes = ", ".join(f"{n} {o}" for o, n in sorted(r["outcomes"].items()))
        t.add_row(name, str(r["calls"]), f"{r['device_seconds']:.1f}",
                  f"{r['device_seconds'] / 3600:.3f}",
                  f"{r['mean_queue_wait_seconds'] * 1000:.1f} ms", outcomes)
    return t


def log_line(line: dict[str, Any], when: str) -> str:
    """One line of `gpufn logs` (markup-free: output is printed as it was written)."""
    name = f"{line['app']}.{line['function']}" if line["app"] else line["function"]
    return f"{when} [{name} {line['invocation_id']}] {line['text']}"
