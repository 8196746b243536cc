"""The public API keeps the user function's signature for type checkers (one mypy run)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each line that mypy must flag ends with "# E"; each reveal_type names what it must show.
SNIPPET = textwrap.dedent('''
    from __future__ import annotations

    import gpufn

    @gpufn.gpu
    def square(x: int) -> int:
        return x * x

    @gpufn.gpu(memory="1GiB", retries=2)
    def greet(name: str, *, excited: bool = False) -> str:
        return name + ("!" if excited else "")

    ok_int: int = square.remote(3)
    ok_str: str = greet.remote("ada", excited=True)
    ok_call: gpufn.FunctionCall[str] = greet.spawn("ada")
    ok_get: str = ok_call.get(timeout=5)
    ok_opts: gpufn.Function[[int], int] = square.with_options(priority=3)
    reveal_type(square.remote(1))  # R: int
    reveal_type(greet.spawn("y"))  # R: gpufn.api.calls.FunctionCall[str]
    reveal_type(greet.spawn("y").get())  # R: str
    reveal_type(square.map([1, 2]))  # R: typing.Iterator[int]
    reveal_type(square.starmap([(1,)]))  # R: typing.Iterator[int]
    reveal_type(square.local(2))  # R: int
    reveal_type(square(2))  # R: int
    reveal_type(greet.with_options(timeout=1).remote("z"))  # R: str

    async def main() -> None:
        reveal_type(await square.remote.aio(2))  # R: int
        reveal_type(await square.spawn(1).get.aio())  # R: int
        async for v in square.map.aio([1]):
            reveal_type(v)  # R: int

    square.remote("no")  # E
    greet.remote(1)  # E
    greet.spawn("a", excited="yes")  # E
    square.remote(1, 2)  # E
    square.local("x")  # E
    bad: str = square.remote(1)  # E
''')


@pytest.mark.timeout(300)
def test_public_api_is_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    monkeypatch.chdir(ROOT)  # mypy finds the gpufn sources from the repository root
    out, err, _ = api.run([
        str(snippet), "--config-file", str(ROOT / "pyproject.toml"), "--follow-imports=silent",
        "--cache-dir", str(tmp_path / "cache"), "--show-error-codes", "--no-pretty",
        "--hide-error-context", "--no-error-summary",
    ])
    assert not err, err
    errors: dict[int, list[str]] = {}
    revealed: dict[int, str] = {}
    for line in out.splitlines():
        m = re.match(r".*snippet\.py:(\d+): (error|note): (.*)$", line)
        assert m, f"unexpected mypy output: {line}"
        no, kind, text = int(m[1]), m[2], m[3]
        if kind == "error":
            errors.setdefault(no, []).append(text)
        elif text.startswith("Revealed type is"):
            revealed[no] = text.split('"')[1].replace("builtins.", "")  # spelt either way by mypy versions

    lines = SNIPPET.splitlines()
    expect_errors = {i + 1 for i, s in enumerate(lines) if s.rstrip().endswith("# E")}
    expect_reveal = {i + 1: s.split("# R: ")[1].strip() for i, s in enumerate(lines) if "# R: " in s}
    assert set(errors) == expect_errors, (
        f"mypy errors on lines {sorted(errors)}, expected {sorted(expect_errors)}:\n{out}")
    assert revealed == expect_reveal, out
