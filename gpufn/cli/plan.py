"""`gpufn plan CONFIG.json --devices 8 --device-memory 80GiB`: the TP x PP layouts of a model
that fit, with memory per device and communication per token; refuses when none fits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from gpufn.cli.common import fail
from gpufn.exceptions import InvalidSpec
from gpufn.parallel import capacity as planner
from gpufn.wire.units import parse_memory

console = Console()


def _gib(n: float) -> str:
    return f"{n / planner.GiB:.1f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _row(lay: planner.Layout) -> dict[str, Any]:
    return {"tp": lay.tp, "pp": lay.pp, "devices": lay.devices, "fits": lay.fits,
            "weights_gib": round(lay.weights / planner.GiB, 2),
            "kv_cache_gib": round(lay.kv_cache / planner.GiB, 2),
            "activations_gib": round(lay.activations / planner.GiB, 2),
            "headroom_gib": round(lay.headroom / planner.GiB, 2),
            "allreduce_bytes_per_token": round(lay.allreduce_bytes_per_token),
            "p2p_bytes_per_token": round(lay.p2p_bytes_per_token)}


def plan(
    config: Path = typer.Argument(..., help="A Hugging Face config.json (decoder-only transformer)."),
    devices: int = typer.Option(8, help="Devices available."),
    device_memory: str = typer.Option("80GiB", help="Memory of each device, e.g. 80GiB."),
    dtype: str = typer.Option("bf16", help=f"Weight dtype: {', '.join(planner.BYTES)}."),
    kv_dtype: str | None = typer.Option(None, help="KV cache dtype [the weights' dtype; bf16 for 8/4-bit weights]."),
    context: int | None = typer.Option(None, help="Tokens per sequence [the model's maximum, at most 8192]."),
    batch: int = typer.Option(1, help="Sequences held in the KV cache at once."),
    reserve: float = typer.Option(0.1, help="Fraction of each device kept for the runtime (CUDA context, NCCL, fragmentation)."),
    show_all: bool = typer.Option(False, "--all", help="List the layouts that do not fit too."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the TP x PP layouts of a model that fit, and recommend one."""
    try:
        memory = parse_memory(device_memory, "--device-memory")
        kw: dict[str, Any] = dict(dtype=dtype, kv_dtype=kv_dtype, context=context, batch=batch,
                                  reserve=reserve)
        cfg, name = planner.read_config(config)
        result = planner.plan(cfg, devices=devices, device_memory=memory, name=name, **kw)
    except (planner.PlanError, InvalidSpec) as e:
        fail(str(e), 2)
    best = result.recommended
    shape = result.shape
    head = (f"{shape.name}: {shape.params / 1e9:.2f}B parameters, {shape.layers} layers, "
            f"{result.dtype} weights, KV cache {result.kv_dtype} for {result.batch} x "
            f"{result.context} tokens; {devices} x {_gib(memory)} GiB, "
            f"{result.reserve:.0%} reserved")
    needed = None if best else planner.devices_needed(cfg, device_memory=memory, **kw)
    if as_json:
        out: dict[str, Any] = {
            "model": shape.name, "params": shape.params, "devices": devices,
            "device_memory_gib": memory / planner.GiB, "dtype": result.dtype,
            "kv_dtype": result.kv_dtype, "context": result.context, "batch": result.batch,
            "layouts": [_row(lay) for lay in result.layouts if show_all or lay.fits],
            "recommended": _row(best) if best else None,
        }
        if best is None:
            out["missing_gib"] = round(result.missing_bytes / planner.GiB, 1)
            out["fits_on_devices"] = needed[0] if needed else None
        typer.echo(json.dumps(out, indent=2))
        if best is None:
            raise typer.Exit(1)
        return
    console.print(head, soft_wrap=True)
    shown = [lay for lay in result.layouts if show_all or lay.fits]
    if shown:
        # Every column whole at 80 columns (COLUMNS=80): no cell is cut, so no vertical rules.
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
        for col in ("TP", "PP", "devs", "weights", "KV", "activ.", "free", "AR/tok", "p2p/tok",
                    "fits"):
            table.add_column(col, no_wrap=True)
        for lay in shown:
            mark = "[bold green]recommended[/]" if lay is best else ("yes" if lay.fits else "[red]no[/]")
            table.add_row(str(lay.tp), str(lay.pp), str(lay.devices), _gib(lay.weights),
                          _gib(lay.kv_cache), _gib(lay.activations), _gib(lay.headroom),
                          _bytes(lay.allreduce_bytes_per_token), _bytes(lay.p2p_bytes_per_token),
                          mark)
        console.print(table)
        console.print("memory in GiB per device; AR/tok, p2p/tok: all-reduce and "
                      "point-to-point bytes per token", style="dim")
    if best is not None:
        replicas = devices // best.devices
        console.print(f"recommended: TP={best.tp} PP={best.pp} on {best.devices} device(s)"
                      + (f", {replicas} replicas on {devices}" if replicas > 1 else ""))
        return
    c = result.closest
    where = (f"; it fits on {needed[0]} x {_gib(memory)} GiB (TP={needed[1].tp} PP={needed[1].pp})"
             if needed else "")
    fail(f"{shape.name} does not fit on {devices} x {_gib(memory)} GiB: the closest layout "
         f"(TP={c.tp} PP={c.pp}) needs {_gib(c.need)} GiB per device of {_gib(c.usable)} GiB "
         f"usable, {_gib(result.missing_bytes)} GiB missing in all{where}", 1)


def register(app: typer.Typer) -> None:
    app.command()(plan)
