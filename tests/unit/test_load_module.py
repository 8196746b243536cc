"""Loading an app file for `gpufn deploy`: always the file as it is now."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gpufn.api.deployment import DeployError, load_module

pytestmark = pytest.mark.timeout(30)


def test_an_app_edited_within_the_same_second_and_size_loads_its_new_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's bytecode cache is keyed by the source's mtime in whole seconds and its
    size: the loader ran version 1 again for a same-sized version 2 written at once."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as on a fresh machine
    app = tmp_path / "edited_app.py"
    app.write_text('VERSION = "v1"\n')
    os.utime(app, (1_700_000_000, 1_700_000_000))
    import importlib.util
    spec = importlib.util.spec_from_file_location("edited_app", app)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # writes its .pyc
    assert load_module(app).VERSION == "v1"
    app.write_text('VERSION = "v2"\n')
    os.utime(app, (1_700_000_000, 1_700_000_000))  # the same second, the same size
    assert load_module(app).VERSION == "v2"
    assert sys.modules["edited_app"].VERSION == "v2"
    sys.modules.pop("edited_app", None)


def test_an_app_that_fails_to_load_names_its_line_and_leaves_the_old_module(
        tmp_path: Path) -> None:
    app = tmp_path / "broken_app.py"
    app.write_text("X = 1\n")
    good = load_module(app)
    app.write_text("X = (\n")
    with pytest.raises(DeployError, match=r"broken_app\.py failed to import: SyntaxError") as e:
        load_module(app)
    assert 'broken_app.py", line 1' in e.value.details and "X = (" in e.value.details
    assert sys.modules["broken_app"] is good
    sys.modules.pop("broken_app", None)
