"""Shared memory nearly full: with GPUFN_SHM_DIR on a small tmpfs, arguments and results of
64 MiB and more that do not fit there travel through the sockets instead, every result is
right, the fallback is said in the log, and no payload file is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


def _mount(path: Path, mib: int) -> str | None:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=1777", "f2shm",
                        str(path)], capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"mount failed: {r.stderr.strip()}"


@pytest.fixture()
def small_tmpfs(tmp_path: Path) -> Iterator[Any]:
    mounted: list[Path] = []

    def make(size_mib: int, filler_mib: int) -> Path:
        path = tmp_path / f"shm{len(mounted)}"
        path.mkdir()
        why = _mount(path, size_mib)
        if why is not None:
            pytest.skip(why)
        mounted.append(path)
        with open(path / "filler", "wb") as f:  # what others put there: nearly full
            f.write(b"\0" * filler_mib * MiB)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _run(shm_dir: Path, home: Path, *sizes: int) -> tuple[dict[str, Any], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update(GPUFN_SHM_DIR=str(shm_dir), GPUFN_CPU_DEVICES="1", GPUFN_HOME=str(home),
               GPUFN_PROGRESS="0", PYTHONPATH=str(REPO), GPUFN_LOG_DIR=str(home / "logs"))
    r = subprocess.run([sys.executable, "-m", "tests.integration._shm_full_client",
                        *map(str, sizes)], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _logs(home: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (home / "logs").glob("*.log"))


def test_no_room_at_all_every_payload_through_the_sockets(small_tmpfs: Any, tmp_path: Path) -> None:
    shm_dir = small_tmpfs(96, 40)  # 56 MiB free: no 64 MiB file fits
    out, err = _run(shm_dir, tmp_path / "home", 64, 96)
    assert out["ok"] == [True] * 4 and out["files_seen"] == 0, out
    said = err + _logs(tmp_path / "home")
    assert "could not take" in said and "through the socket" in said, said[-3000:]
    assert sorted(os.listdir(shm_dir)) == ["filler"]


def test_room_for_some_files_the_rest_through_the_sockets(small_tmpfs: Any, tmp_path: Path) -> None:
    shm_dir = small_tmpfs(160, 40)  # 120 MiB free: one 64 MiB file fits, not two
    out, err = _run(shm_dir, tmp_path / "home", 64, 64, 100)
    assert out["ok"] == [True] * 6 and out["files_seen"] >= 1, out
    said = err + _logs(tmp_path / "home")
    assert "could not take" in said, said[-3000:]  # the 100 MiB ones did not fit
    assert sorted(os.listdir(shm_dir)) == ["filler"]
