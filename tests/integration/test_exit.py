"""Calls made while the interpreter exits are refused with a clear error; no cluster is
started for them, nothing prints a traceback and no gpufn process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import atexit
    import threading

    def late_call():  # registered before gpufn's handler, so it runs after it (LIFO)
        try:
            echo.remote(2)
        except Exception as e:
            print(f"late: {type(e).__name__}: {e}", flush=True)
        else:
            print("late: ran", flush=True)

    atexit.register(late_call)

    import gpufn

    @gpufn.gpu
    def echo(x):
        return x

    first = threading.Event()

    def loop():
        while True:
            try:
                echo.remote(1)
                first.set()
            except gpufn.GpufnError:
                pass

    threading.Thread(target=loop, daemon=True).start()
    assert first.wait(120), "no call completed"
    print("main exits", flush=True)
""")


def _marked_pids(mark: str) -> list[int]:
    """Processes whose environment carries this test's marker (the script and its cluster)."""
    needle = f"GPUFN_TEST_EXIT_MARK={mark}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:
            continue
    return out


@pytest.mark.timeout(240)
def test_calls_during_interpreter_exit_are_refused_cleanly(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    env = dict(os.environ, GPUFN_TEST_EXIT_MARK=mark, GPUFN_CPU_DEVICES="1",
               GPUFN_LOG_DIR=str(tmp_path))
    env.pop("GPUFN_ADDRESS", None)
    script = tmp_path / "exiting.py"
    script.write_text(SCRIPT)
    try:
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                           text=True, timeout=180, cwd=tmp_path)
        deadline = time.monotonic() + 20  # orphans notice their parent is gone within ~0.5 s
        while _marked_pids(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _marked_pids(mark)
    finally:
        for pid in _marked_pids(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert r.returncode == 0, r.stdout + r.stderr
    assert "main exits" in r.stdout, r.stdout + r.stderr
    assert "late: ConnectionLost: the interpreter is exiting" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert not left, f"gpufn processes left behind: {left}"


@pytest.mark.timeout(60)
def test_scheduler_whose_starter_is_gone_stops_quietly(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.close(r)  # the starter stopped waiting for the address (it exited meanwhile)
    sock = tmp_path / "sched.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufn.scheduler", "--ready-fd", str(w), "--ipc", str(sock)],
        pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    os.close(w)
    try:
        out, err = proc.communicate(timeout=50)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert not sock.exists()


SPMD_SCRIPT = textwrap.dedent("""
    import gpufn

    @gpufn.gpu(count=2, spmd=False)
    def whole(x):
        return x + 1

    print("result", whole.remote(1), flush=True)
""")


@pytest.mark.timeout(180)
def test_a_script_that_ran_a_device_set_call_exits_without_warnings(tmp_path: Path) -> None:
    """The spmd=False helper (and multiprocessing's resource tracker it started) stop with
    their worker, as what they are: the supervisor finds no call's leftovers at exit."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update(GPUFN_TEST_EXIT_MARK=mark, GPUFN_CPU_DEVICES="2", GPUFN_HOME=str(tmp_path / "h"),
               GPUFN_LOG_DIR=str(tmp_path))
    script = tmp_path / "device_set.py"
    script.write_text(SPMD_SCRIPT)
    try:
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                           text=True, timeout=150, cwd=tmp_path)
        deadline = time.monotonic() + 20
        while _marked_pids(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _marked_pids(mark)
    finally:
        for pid in _marked_pids(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert r.returncode == 0 and "result 2" in r.stdout, r.stdout + r.stderr
    assert "left running" not in r.stderr and "WARNING" not in r.stderr, r.stderr
    assert not left, f"gpufn processes left behind: {left}"
