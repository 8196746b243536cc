"""A notebook run as a user runs it: nbclient executes tests/integration/notebook/calls.ipynb
on a real ipykernel against a real `gpufn serve` with the example app deployed, and the
cell outputs are checked: cell functions (and their prints), globals seen as they are at
call time, one progress bar without ipywidgets, a deployed function through lookup, a
local helper module, and a kernel interrupt that cancels the remote calls."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpufn
from gpufn.client import default as client_mod

from ..conftest import shutdown_default
from .served import Served

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[2]
FOLDER = Path(__file__).parent / "notebook"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    shutdown_default()
    s = Served(tmp_path_factory.mktemp("nbserve")).start()
    try:
        yield s
    finally:
        client_mod._shutdown_default()
        s.stop()


def _text(cell: Any) -> str:
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type == "error":
            out.append(f"{o.ename}: {o.evalue}")
        elif "data" in o:
            out.append(o.data.get("text/plain", ""))
    return "".join(out)


def _busy(client: gpufn.Client, name: str) -> int:
    st = client.status()
    running = sum(1 for d in st["devices"] for r in d["running"] if r["function"] == name)
    queued = sum(f["queued"] for f in st["functions"] if f["name"] == name)
    return running + queued


async def _wait(cond: Any, timeout: float) -> float:
    start = time.monotonic()
    while not await asyncio.to_thread(cond):
        assert time.monotonic() - start < timeout, "timed out waiting"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def test_notebook(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFN_ADDRESS", served.address)
    monkeypatch.setenv("GPUFN_TOKEN", served.token)
    client = gpufn.connect(served.address, token=served.token)
    gpufn.deploy(ROOT / "examples" / "deploy" / "app.py", name="demo", client=client)

    nb = nbformat.read(FOLDER / "calls.ipynb", as_version=4)
    runner = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(FOLDER)}})
    cells = {c.metadata["tags"][0]: c for c in nb.cells}
    cancel_s: list[float] = []

    async def run() -> None:
        async with runner.async_setup_kernel():
            for i, cell in enumerate(nb.cells):
                if cell.metadata["tags"][0] != "interrupt":
                    await runner.async_execute_cell(cell, i)
                    continue
                task = asyncio.create_task(runner.async_execute_cell(cell, i))
                await _wait(lambda: _busy(client, "slow_square") >= 2, 120)
                assert runner.km is not None
                await runner.km.interrupt_kernel()
                cancel_s.append(await _wait(lambda: _busy(client, "slow_square") == 0, 30))
                await task

    asyncio.run(run())
    text = {tag: _text(c) for tag, c in cells.items()}

    assert "connected" in text["connect"]
    # a cell function: its print comes back into the cell; the helper module went by value
    assert "remote print: hi" in text["cell-function"] and "HI!" in text["cell-function"]
    # a global changed after the first call is seen by the next one, as with .local()
    assert "first 2" in text["globals-1"]
    assert "second 11 11" in text["globals-2"], text["globals-2"]
    # one progress bar, updated in place, with no widget warning
    bars = [o for o in cells["progress"].outputs if o.output_type == "display_data"]
    assert len(bars) == 1, cells["progress"].outputs
    assert "12/12" in bars[0].data["text/plain"] and "<progress" in bars[0].data["text/html"]
    assert "sum 506" in text["progress"]
    assert "ipywidgets" not in text["progress"] and "Warning" not in text["progress"]
    # a deployed function, its nested calls, and its print
    assert "similarity('gpu box', 'gpu boxes') =" in text["deployed"], text["deployed"]
    assert "sim 0." in text["deployed"]
    # Ctrl-C: the remote calls were cancelled within 2 s, and the next cell works at once
    assert "KeyboardInterrupt" in text["interrupt"], text["interrupt"]
    print(f"remote calls cancelled {cancel_s[0]:.2f}s after the interrupt")
    assert cancel_s and cancel_s[0] <= 2.0, cancel_s
    assert "after 25 True" in text["after"], text["after"]


def test_example_notebook_runs_on_the_served_cluster_without_an_address(served: Served) -> None:
    """examples/deploy/notebook.ipynb, top to bottom, in a kernel with no GPUFN_ADDRESS (nor
    any GPUFN_* but the served cluster's GPUFN_HOME): `gpufn.connect()` finds the `gpufn
    serve` of that home, and `gpufn status` counts the notebook's calls there."""
    import json
    import subprocess

    from .served import gpufn_cmd

    client = gpufn.connect(served.address, token=served.token)
    gpufn.deploy(ROOT / "examples" / "deploy" / "app.py", name="demo", client=client)
    folder = ROOT / "examples" / "deploy"
    nb = nbformat.read(folder / "notebook.ipynb", as_version=4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env["GPUFN_HOME"] = str(served.home)
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}}).execute(env=env)
    outputs = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "similarity('self-hosted GPUs', 'a self-hosted GPU box') =" in outputs
    assert "(4, 16)" in outputs and "[0, 1, 4, 9, 16, 25, 36, 49]" in outputs
    connect = _text(nb.cells[1])
    assert served.address in connect and "cluster.json" in connect, connect
    assert "embedded" not in outputs
    st = subprocess.run([*gpufn_cmd(), "status", "--json"], env=served.env(), capture_output=True,
                        text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    calls = {f["name"]: f["calls"] for f in json.loads(st.stdout)["functions"] if f["app"] == "demo"}
    assert calls["similarity"] >= 1 and calls["embed"] >= 4 + 1 + 2, calls
    assert calls["slow_square"] >= 8, calls
