"""Socket settings shared by every gpufn process (explicit high-water marks, no linger)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import zmq

from gpufn import config

RECONNECT_MS = 100
RECONNECT_MAX_MS = 2000


def configure(sock: zmq.Socket[Any], *, router: bool = False) -> None:
    hwm = config.high_water_mark()
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    if router:
        # Refuse rather than drop: a full or unknown peer raises, and the shell retries
        # later or reports the peer unreachable.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer that reconnects under its identity (half-open TCP, a restarted process
        # with the same pid in a container) takes the identity over instead of being ignored.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    else:
        sock.setsockopt(zmq.IMMEDIATE, 0)
        # Reconnect to a scheduler that went away with bounded exponential backoff.
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)


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
