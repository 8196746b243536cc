"""`gpufn run FILE.py::FUNCTION` on a served cluster sends the file's code and the local
modules next to it by value, as `gpufn deploy` does: the workers (started in a folder of
their own) have neither file. examples/deploy/app.py::embed uses its sibling textfeatures."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpufn
from gpufn.client import default as client_mod

from .served import Served, gpufn_cmd

pytestmark = pytest.mark.timeout(240)

APP = Path(__file__).resolve().parents[2] / "examples" / "deploy" / "app.py"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("run-sibling"), devices=1)
    try:
        s.start()  # inside: a failed start is stopped too
        yield s
    finally:
        s.stop()


def test_run_sends_the_files_local_modules_as_deploy_does(served: Served) -> None:
    r = subprocess.run([*gpufn_cmd(), "run", f"{APP}::embed", "'hello gpus'", "--json"],
                       env=served.env(), cwd=served.home / "cwd", capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = json.loads(r.stdout.splitlines()[-1])["result"]
    assert isinstance(ran, list) and len(ran) == 16
    # The same file deployed, called by name: the same code, so the same value.
    gpufn.connect(served.address, token=served.token)
    try:
        gpufn.deploy(APP, name="demo")
        assert gpufn.lookup("demo", "embed").remote("hello gpus") == ran
    finally:
        client_mod._shutdown_default()
