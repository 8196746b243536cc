"""A full state disk (issue 29, defect 4), on a real `gpufn serve` whose state directory
is a 2 MiB tmpfs: once it is full, `gpufn deploy` fails at once with "no space left on
<the state dir>", 300 calls all succeed (the workers' logs and journals on that disk too,
as by default), the scheduler says once (not every second) that usage waits in memory,
and after space comes back and serve is killed (SIGKILL) and started again, `gpufn
usage` counts all 300 calls."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tmpfs import small_tmpfs

from ._head import TOKEN, Head
from ._waits import wait_for
from .test_deploy import write_app

pytestmark = pytest.mark.timeout(300)

CALLS = """
import faulthandler, sys
import gpufn

faulthandler.dump_traceback_later(150, exit=True)  # where it waits, if it hangs (CI once did)
address, token, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
gpufn.connect(address, token=token)
square = gpufn.lookup("disk", "square")
for i in range(n):
    assert square.remote(i) == i * i
    print(i, file=sys.stderr, flush=True)
print("ok")
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """tmp_path/head/state as a 2 MiB tmpfs (skipped, saying why, where it cannot be)."""
    with small_tmpfs(tmp_path / "head" / "state", "2m") as state:
        yield state


def fill(folder: Path) -> Path:
    """Write zeros into `folder` until its disk is full."""
    path = folder / "filler"
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * 4096
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return path


def test_a_full_state_disk_fails_deploys_and_keeps_usage(small_disk: Path,
                                                          tmp_path: Path) -> None:
    # the logs in the state dir, as by default: the workers' journals and logs fill up too
    head = Head(tmp_path / "head", devices=2, GPUFN_LOG_DIR=str(small_disk / "logs"))
    try:
        head.start()
        app = write_app(tmp_path / "app", "disk", "v1")
        first = head.gpufn("deploy", str(app))
        assert first.returncode == 0, first.stdout + first.stderr
        filler = fill(small_disk)

        app.write_text(app.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
        t0 = time.monotonic()
        refused = head.gpufn("deploy", str(app), timeout=60)
        took = time.monotonic() - t0
        assert refused.returncode != 0, refused.stdout
        said = " ".join((refused.stdout + refused.stderr).split())
        assert f"no space left on {small_disk}" in said, said
        assert took < 30, took

        # through the scheduler (no leases): each call is noted in its worker's journal
        calls = subprocess.run([sys.executable, "-c", CALLS, head.address, TOKEN, "300"],
                               env=head.env(GPUFN_LEASES="0"), cwd=head.home / "cwd",
                               capture_output=True,
                               text=True, timeout=180)
        assert calls.returncode == 0 and "ok" in calls.stdout, (
            calls.stdout + calls.stderr[-6000:] + "\n--- the head's log:\n" + head.log()[-6000:])
        time.sleep(2.5)  # the books' writes fail a few more times, once a second
        log = head.log()
        assert log.count("usage and logs") == 1, log[-3000:]
        assert "no space left on" in log and "Traceback" not in log, log[-3000:]

        filler.unlink()  # space is back: the next write takes everything kept
        wait_for(lambda: "usage and logs" in head.log() and "written again" in head.log(),
                 30, "the scheduler to write usage again")
        head.kill(signal.SIGKILL)  # nothing is saved at the end: only what was written
        head.start()
        usage = head.gpufn("usage", "--json")
        assert usage.returncode == 0, usage.stdout + usage.stderr
        rows = {r["function"]: r["calls"] for r in json.loads(usage.stdout)["rows"]}
        assert rows.get("square") == 300, rows
        again = head.gpufn("deploy", str(app))
        assert again.returncode == 0 and "v2" in again.stdout, again.stdout + again.stderr
        head.shutdown()
    finally:
        head.close()


def test_serve_on_a_full_state_disk_refuses_in_one_line(small_disk: Path,
                                                         tmp_path: Path) -> None:
    """Nothing half-written, no traceback, nothing left running; the start after space
    came back works."""
    fill(small_disk)
    head = Head(tmp_path / "head", devices=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufn.cli.main", "serve", "--port", str(head.port),
         "--cpu-devices", "1", "--token", TOKEN], env=head.env(), cwd=head.home / "cwd",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        pytest.fail("gpufn serve started on a full state disk")
    assert proc.returncode == 1, out + err
    assert len(err.strip().splitlines()) == 1 and "free space" in err, err
    assert "Traceback" not in out + err
    assert not (small_disk / "head.json").exists()
    assert not any(p.name.endswith(".tmp") for p in small_disk.iterdir())
    (small_disk / "filler").unlink()
    try:
        head.start()
        head.shutdown()
    finally:
        head.close()
