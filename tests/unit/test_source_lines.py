"""A pickled function carries only the source lines of the code it ships, not its whole
file (a file of 1,000 functions was sent, stored and loaded 1,000 times over: 56 KiB per
two-line function), and remote tracebacks still show those lines."""

from __future__ import annotations

import importlib.util
import linecache
import sys
import traceback
from pathlib import Path
from types import ModuleType

import pytest

from gpufn.wire import serialization as ser

pytestmark = pytest.mark.timeout(60)

HEAD = '''
class Checker:
    def check(self, x):
        if x < 0:
            raise ValueError("negative input: line of Checker.check")
        return x


def helper(x):
    return Checker().check(x) * 2


def target(x):
    return helper(x) + 1

'''


def _module(tmp_path: Path, n: int) -> ModuleType:
    body = HEAD + "".join(f"\ndef f{i}(x):\n    return x + {i}\n" for i in range(n))
    path = tmp_path / f"srclines_{n}.py"
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # not in sys.modules: pickled by value, as an app file is
    return mod


def _size(frames: list[object]) -> int:
    return sum(len(bytes(f)) for f in frames)  # type: ignore[call-overload]


def test_a_function_carries_its_lines_not_its_file(tmp_path: Path) -> None:
    small, big = _module(tmp_path, 1), _module(tmp_path, 1000)
    _, frames_small = ser.dump_code(small.f0, "f0")
    _, frames_big = ser.dump_code(big.f0, "f0")
    assert Path(big.__file__).stat().st_size > 30_000
    # The same two-line function costs about the same in a file 1,000 times larger.
    assert _size(frames_big) < _size(frames_small) + 512, (_size(frames_small), _size(frames_big))
    _, _, lines = ser.loads(frames_big)
    # `def f0` and its return, nothing else.
    assert [lines[n] for n in sorted(lines)] == ["def f0(x):\n", "    return x + 0\n"]
    _, frames = ser.dump_code(big.target, "target")
    _, _, lines = ser.loads(frames)
    assert "".join(lines[n] for n in sorted(lines)) == "def target(x):\n    return helper(x) + 1\n"


def test_remote_traceback_shows_the_shipped_lines(tmp_path: Path) -> None:
    mod = _module(tmp_path, 50)
    _, frames_t = ser.dump_code(mod.target, "target")
    _, frames_f = ser.dump_code(mod.f7, "f7")
    path = mod.__file__
    assert path is not None
    Path(path).unlink()  # as on a worker host, where the file does not exist
    linecache.clearcache()
    target, f7 = ser.load_code(frames_t), ser.load_code(frames_f)  # two of one file: merged
    assert f7(1) == 8
    try:
        target(-1)
    except ValueError:
        tb = traceback.format_exc()
    else:
        raise AssertionError("no error")
    assert "return helper(x) + 1" in tb, tb  # the shipped function's own line
    n7 = (HEAD + "".join(f"\ndef f{i}(x):\n    return x + {i}\n" for i in range(50))
          ).splitlines().index("def f7(x):") + 2
    assert linecache.getline(path, n7).strip() == "return x + 7"  # f7's, kept beside them
    sys.modules.pop(Path(path).stem, None)
