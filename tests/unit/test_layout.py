"""The rooms of the package and what each may import (DESIGN.md's layout table), checked by
walking every module's imports with `ast` (type-checking and function-local ones too)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"gpufn": "gpufn", "scheduler": "gpufn.scheduler", "memory_pool": "gpufn.memory_pool",
           "worker": "gpufn.worker"}

# room -> the rooms it may import (besides itself). "gpufn" is the facade's __init__ alone.
MAY_IMPORT: dict[str, set[str]] = {
    "gpufn": {"*"},
    "gpufn.exceptions": set(),
    "gpufn.wire": {"gpufn.exceptions"},
    "gpufn.net": {"gpufn.exceptions", "gpufn.wire"},
    "gpufn.cluster": {"gpufn.exceptions", "gpufn.wire", "gpufn.net"},
    "gpufn.client": {"gpufn.exceptions", "gpufn.wire", "gpufn.net", "gpufn.cluster"},
    "gpufn.runtime": {"gpufn.exceptions", "gpufn.wire"},
    "gpufn.api": {"gpufn.exceptions", "gpufn.wire", "gpufn.net", "gpufn.cluster", "gpufn.client",
                  "gpufn.runtime"},
    "gpufn.parallel": {"gpufn.exceptions", "gpufn.runtime"},
    "gpufn.engines": {"gpufn.exceptions", "gpufn.wire", "gpufn.runtime"},
    "gpufn.http": {"gpufn.exceptions", "gpufn.wire", "gpufn.net", "gpufn.cluster", "gpufn.client",
                   "gpufn.api"},
    "gpufn.cli": {"*"},
    "gpufn.memory_pool": {"gpufn.exceptions", "gpufn.wire"},
    "gpufn.scheduler": {"gpufn.exceptions", "gpufn.wire", "gpufn.net", "gpufn.memory_pool"},
    "gpufn.worker": {"gpufn.exceptions", "gpufn.wire", "gpufn.net", "gpufn.runtime",
                     "gpufn.memory_pool"},
}
NO_ZMQ = {"gpufn.exceptions", "gpufn.wire", "gpufn.runtime", "gpufn.parallel",
          "gpufn.memory_pool", "gpufn.engines"}


# Sub-rooms inside a room: sub-room -> the sibling sub-rooms it may import ("" is the room's
# top-level modules). Nothing imports upward: the order of each table is bottom to top.
SUBROOMS: dict[str, dict[str, set[str]]] = {
    "gpufn.scheduler": {
        "nouns": set(),
        "stores": {"nouns"},
        "books": {"nouns", "stores"},
        "placement": {"nouns", "stores", "books"},
        "calls": {"nouns", "stores", "books", "placement"},
        "peers": {"nouns", "stores", "books", "placement", "calls"},
        "desks": {"nouns", "stores", "books", "placement", "calls", "peers"},
        "": {"nouns", "stores", "books", "placement", "calls", "peers", "desks"},
    },
    "gpufn.worker": {
        "host": set(),
        "device_set": set(),
        "supervisor": {"host"},
        "": {"host", "device_set"},
    },
}


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = (path, is_pkg)
    return mods


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module `name` imports (a `from pkg import module` names the module)."""
    path, is_pkg = MODULES[name]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in MODULES else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    out.discard(name)
    return out


def room(module: str) -> str:
    if module == "gpufn":
        return "gpufn"
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_every_module_is_in_a_room() -> None:
    assert {room(m) for m in MODULES} <= set(MAY_IMPORT), set(map(room, MODULES)) - set(MAY_IMPORT)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_the_rooms(name: str) -> None:
    mine = room(name)
    allowed = MAY_IMPORT[mine]
    bad = []
    for dep in sorted(_imports(name)):
        if dep.split(".")[0] == "zmq" and mine in NO_ZMQ:
            bad.append(f"{dep} (this room never imports zmq)")
        if not (dep == "gpufn" or dep.startswith("gpufn.")):
            continue
        if dep not in MODULES:
            bad.append(f"{dep} (no such module)")
            continue
        theirs = room(dep)
        if theirs != mine and "*" not in allowed and theirs not in allowed:
            bad.append(f"{dep} (room {theirs})")
    assert not bad, f"{name} (room {mine}) may import only {sorted(allowed)}: " + ", ".join(bad)


def subroom(module: str) -> str:
    """The sub-room of `module` inside its room ("" for the room's top-level modules)."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 4 and ".".join(parts[:2]) in SUBROOMS else ""


def test_every_subroom_is_listed() -> None:
    for name in MODULES:
        top = room(name)
        if top in SUBROOMS:
            assert subroom(name) in SUBROOMS[top], f"{name}: sub-room {subroom(name)!r} is not in SUBROOMS"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if room(m) in SUBROOMS))
def test_subrooms_import_only_downward(name: str) -> None:
    mine, top = subroom(name), room(name)
    allowed = SUBROOMS[top][mine] | {mine}
    bad = [dep for dep in sorted(_imports(name))
           if dep in MODULES and dep != top and room(dep) == top and subroom(dep) not in allowed]
    assert not bad, f"{name} (sub-room {mine or 'top'}) may import only {sorted(allowed)}: {bad}"


def test_no_import_cycles() -> None:
    graph = {m: {d for d in _imports(m) if d in MODULES and d != "gpufn"} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_core_of_the_scheduler_loads_no_zmq_and_no_client() -> None:
    script = textwrap.dedent("""
        import sys
        import gpufn.scheduler.core, gpufn.worker.core
        bad = sorted(m for m in sys.modules if m == "zmq" or m.startswith(("zmq.",
                     "gpufn.client", "gpufn.api", "gpufn.cli")))
        print(bad)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=100, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_every_public_name_is_listed_and_loads() -> None:
    import gpufn

    table = gpufn._PUBLIC
    assert sorted(gpufn.__all__) == sorted(table)
    for name in gpufn.__all__:
        assert getattr(gpufn, name) is not None


@pytest.mark.timeout(120)
def test_the_http_gateway_is_imported_by_nothing_else() -> None:
    """`gpufn.http` (and its web framework) is a room of its own: the SDK, the CLI, the
    scheduler and the workers run without it (`gpufn serve` imports it only with --http-port)."""
    for folder in ("scheduler", "worker", "memory_pool", "gpufn/wire", "gpufn/net",
                   "gpufn/client", "gpufn/api", "gpufn/runtime", "gpufn/parallel"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert "gpufn.http" not in text and "starlette" not in text and "uvicorn" not in text, path
    script = textwrap.dedent("""
        import sys
        import gpufn, gpufn.cli.main, gpufn.scheduler.server, gpufn.worker.process
        import gpufn.api.deployment, gpufn.api.lookup, gpufn.api.chat
        gpufn.chat_model, gpufn.NotJSONSerializable
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("starlette", "uvicorn", "fastapi")
                     or m.startswith("gpufn.http"))
        print(bad)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=100, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_no_bench_or_example_script_shadows_a_standard_module() -> None:
    """`python bench/x.py` puts bench/ first on sys.path: a bench/http.py stood in for the
    standard library's `http` there, and `import torch` failed in every other bench."""
    for folder in ("bench", "examples", "scripts"):
        for path in (ROOT / folder).glob("*.py"):
            assert path.stem not in sys.stdlib_module_names, f"{path} shadows the stdlib {path.stem!r}"
