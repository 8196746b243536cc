"""GPUFN_SHM_DIR: where same-host payload files go; a bad value is refused naming the fix,
and processes given different folders never take each other for sharers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufn.exceptions import InvalidSpec
from gpufn.wire import config

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def test_default_and_relative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFN_SHM_DIR", raising=False)
    assert config.shm_dir() == "/dev/shm"
    monkeypatch.setenv("GPUFN_SHM_DIR", "shm")
    with pytest.raises(InvalidSpec, match="GPUFN_SHM_DIR='shm' must be an absolute path"):
        config.shm_dir()


def _host_id(shm_dir: str) -> tuple[str, str]:
    env = {**os.environ, "GPUFN_SHM_DIR": shm_dir, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", "from gpufn.wire import shm; print(shm.host_id())"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr


def test_the_folder_is_part_of_who_shares(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ida, idb = _host_id(str(a))[0], _host_id(str(b))[0]
    assert ida and idb and ida != idb  # a caller and a worker on different folders: sockets
    assert _host_id(str(a))[0] == ida
    missing, err = _host_id(str(tmp_path / "missing"))
    assert missing == "" and "GPUFN_SHM_DIR" in err and "not a folder" in err, err


def test_a_pooled_file_has_all_its_pages_when_made(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Its room beyond the first argument is allocated up front: a later, larger argument
    written into it (through a mapping) can never fault on a tmpfs that filled meanwhile."""
    from gpufn.wire import shm

    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    pool = shm.Pool(2**30)
    name = pool.write(memoryview(b"x" * (3 * 2**20 + 5)))
    st = os.stat(tmp_path / name)
    assert st.st_size == 4 * 2**20 and st.st_blocks * 512 >= st.st_size, st
    pool.done(name, reuse=False)
    assert not (tmp_path / name).exists()
