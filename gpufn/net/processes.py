"""Process plumbing: is a pid alive (and still the same process), follow a parent's exit
(a watch thread, or Linux's parent-death signal)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from gpufn.wire.pids import alive, same, start_time

__all__ = ["alive", "same", "set_pdeathsig", "start_time", "watch_parent"]


def watch_parent(parent_pid: int, on_exit: Any) -> None:
    """Call `on_exit` when the process that started us is gone (we were re-parented)."""
    if parent_pid <= 0:
        return

    def loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                on_exit()
                return
            threading.Event().wait(0.5)

    threading.Thread(target=loop, name="gpufn-parent-watch", daemon=True).start()


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Linux: deliver `sig` to this process when its parent thread exits (preexec_fn)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:
        pass
