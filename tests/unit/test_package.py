"""The package surface: `gpufn.parallel` reachable lazily, runtime dependencies."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_parallel_is_an_attribute_imported_on_first_use() -> None:
    script = textwrap.dedent("""
        import sys
        import gpufn
        assert "torch" not in sys.modules, "import gpufn must not import torch"
        assert "gpufn.parallel" not in sys.modules
        tp = gpufn.parallel.tensor_parallel
        from gpufn.parallel.tensor import tensor_parallel
        assert tp is tensor_parallel and callable(tp)
        assert gpufn.parallel is sys.modules["gpufn.parallel"]
        assert gpufn.parallel.pipeline_parallel is not None
        try:
            gpufn.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("unknown attributes must raise AttributeError")
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=100, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_numpy_is_a_runtime_dependency() -> None:
    # Without numpy, `import torch` prints "Failed to initialize NumPy" in every user script.
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps


def test_the_http_extra_is_part_of_test() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {d.split(">")[0].split("[")[0] for d in extras["http"]}
    assert {"starlette", "uvicorn"} <= names
    assert "gpufn[http]" in extras["test"]
