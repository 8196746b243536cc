"""The user docs run as written: every Python block of README.md and docs/*.md, top to bottom
per page (as a notebook would: one namespace, top-level `await` allowed), in a fresh
interpreter with no GPUFN_* setting, so on an embedded cluster of simulated devices. A block
that cannot run there (it needs a served cluster, or a GPU) carries a visible reason, an
HTML comment `<!-- docs-test: skip (why) -->` just before it or a first line `# docs-test:
skip (why)`, and is reported as skipped with that reason. Also: the `gpufn run` lines run,
and the deploy sample output lists the example app's functions."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_SKIP_BEFORE = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.*)\)\s*-->\s*$")
_SKIP_INSIDE = re.compile(r"^#\s*docs-test:\s*skip\s*\((.*)\)\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    code: str
    skip: str = ""  # why it is not run, as the page says

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    out = []
    for m in _FENCE.finditer(text):
        line = text[:m.start()].count("\n") + 1
        before = text[:m.start()].rstrip("\n").rpartition("\n")[2]
        first = m.group(2).partition("\n")[0]
        why = _SKIP_BEFORE.search(before) or _SKIP_INSIDE.match(first)
        out.append(Block(page, line, m.group(1), m.group(2), why.group(1) if why else ""))
    return out


PYTHON = [b for page in PAGES for b in blocks(page) if b.lang == "python"]
SKIPPED = [b for b in PYTHON if b.skip]

RUNNER = r'''
import ast, asyncio, inspect, json, sys, traceback
ns = {"__name__": "__main__"}
for b in json.load(open(sys.argv[1])):
    code = compile(b["code"], b["where"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    print(f"=== BLOCK {b['where']}", flush=True)
    try:
        if code.co_flags & inspect.CO_COROUTINE:
            asyncio.run(eval(code, ns))
        else:
            exec(code, ns)
    except BaseException:
        print(f"=== FAILED {b['where']}", flush=True)
        traceback.print_exc()
        sys.exit(1)
    print(f"\n=== OK {b['where']}", flush=True)
'''


def clean_env(tmp: Path) -> dict[str, str]:
    """A user's shell: no GPUFN_* setting (the suite's own are stripped), a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_") and k != "PYTHONPATH"}
    env.update({"HOME": str(tmp), "PYTHONUNBUFFERED": "1"})
    return env


def test_the_pages_have_python_blocks() -> None:
    assert len(PYTHON) >= 8 and any(b.page == "README.md" for b in PYTHON)


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.page == p and not b.skip for b in PYTHON)])
def test_python_blocks_run_as_written(page: str, tmp_path: Path) -> None:
    run = [{"where": b.where, "code": b.code} for b in PYTHON if b.page == page and not b.skip]
    (tmp_path / "blocks.json").write_text(json.dumps(run))
    (tmp_path / "run.py").write_text(RUNNER)
    r = subprocess.run([sys.executable, "run.py", "blocks.json"], cwd=tmp_path,
                       env=clean_env(tmp_path), capture_output=True, text=True, timeout=400)
    ok = re.findall(r"^=== OK (\S+)$", r.stdout, re.M)
    assert r.returncode == 0, f"{page}: a block failed\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert ok == [b["where"] for b in run], r.stdout
    print(f"DOCS {page}: ran {len(ok)} block(s): {', '.join(ok)}")


@pytest.mark.parametrize("block", SKIPPED, ids=[b.where for b in SKIPPED])
def test_blocks_that_cannot_run_here_say_why(block: Block) -> None:
    assert len(block.skip) > 20, f"{block.where}: say why it cannot run here"
    pytest.skip(f"{block.where}: {block.skip}")


def _gpufn_lines(prefix: str) -> list[tuple[Block, str]]:
    out = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang == "bash":
                out += [(b, ln.split("  #")[0].strip()) for ln in b.code.splitlines()
                        if ln.startswith(prefix)]
    return out


RUN_LINES = _gpufn_lines("gpufn run ")


def test_there_is_a_gpufn_run_example() -> None:
    assert RUN_LINES


@pytest.mark.parametrize(("block", "line"), RUN_LINES, ids=[b.where for b, _ in RUN_LINES])
def test_the_gpufn_run_examples_run(block: Block, line: str, tmp_path: Path) -> None:
    """As written, from the repository's root (where the example paths point)."""
    argv = shlex.split(line)
    r = subprocess.run([sys.executable, "-m", "gpufn.cli.main", *argv[1:]], cwd=ROOT,
                       env=clean_env(tmp_path), capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, f"{block.where}: {line}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), r.stderr


def test_the_deploy_sample_output_lists_every_function_of_the_app() -> None:
    """The sample under `gpufn deploy examples/deploy/app.py` shows the app's functions."""
    (sample,) = [b for page in PAGES for b in blocks(page)
                 if b.lang == "bash" and b.code.startswith("gpufn deploy examples/deploy/app.py")]
    rows = [ln[2:].split() for ln in sample.code.splitlines()[1:] if ln.startswith("#  ")]
    shown = {r[0] for r in rows[2:] if r and not r[0].startswith("call:")}
    source = (ROOT / "examples" / "deploy" / "app.py").read_text()
    functions = set(re.findall(r"^@gpufn\.gpu(?:\(.*\))?\ndef (\w+)", source, re.M))
    assert shown == functions, (shown, functions)
