"""Every example installs with `pip install -e ".[examples]"`: each third-party module an
example imports is gpufn's own dependency or comes with the `examples` extra."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
# import name -> the distribution that brings it
BROUGHT_BY = {"tokenizers": "transformers", "yaml": "pyyaml"}
LOCAL = {"gpufn", "textfeatures", "openai_chat", "openai_completions", "embeddings"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_examples_extra_covers_every_example_import() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    lists = [re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M),
             re.search(r"^examples = \[(.*?)\]", text, re.S | re.M)]
    assert all(lists), "pyproject.toml has no examples extra"
    wanted = {re.split(r"[<>=\[ ]", d)[0].lower()
              for m in lists if m for d in re.findall(r'"([^"]+)"', m.group(1))}
    missing = {}
    for path in sorted((ROOT / "examples").rglob("*.py")):
        for name in _imports(path) - LOCAL - set(sys.stdlib_module_names):
            dist = BROUGHT_BY.get(name, name).lower()
            if dist not in wanted:
                missing.setdefault(dist, []).append(path.name)
    assert not missing, f"add to the examples extra in pyproject.toml: {missing}"
