"""Loaded by every Python process that bench/lease_hops.py starts (PYTHONPATH): in the
worker only, it times the steps of its main loop that a leased call passes through and
writes their medians to $GPUFN_BENCH_HOPS_DIR every half second."""

from __future__ import annotations

import os
import sys

if "gpufn.worker" in sys.orig_argv and os.environ.get("GPUFN_BENCH_HOPS_DIR"):
    import collections
    import statistics
    import threading
    import time
    from typing import Any

    from gpufn.worker import process as _wp

    _acc: dict[str, collections.deque[float]] = collections.defaultdict(
        lambda: collections.deque(maxlen=20000))

    def _timed(cls: Any, name: str, key: str) -> None:
        inner = getattr(cls, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                _acc[key].append(time.perf_counter() - t)
        setattr(cls, name, wrapper)

    from gpufn.net import sockets as _sockets
    from gpufn.wire import protocol as _p

    _timed(_wp.WorkerProcess, "_direct_receive", "receive, decode, run, answer")
    _timed(_wp.WorkerProcess, "_run_leased", "of which: run (inline, leased)")
    _timed(_p, "encode_batch", "of which: answer encoded")
    _timed(_sockets, "send", "of which: answer sent (zmq)")
    _timed(_wp.WorkerProcess, "_step_leases", "after: lease step (next call, reports)")
    _timed(_wp.WorkerProcess, "_flush", "after: the loop's other output")

    def _dump() -> None:
        out = os.path.join(os.environ["GPUFN_BENCH_HOPS_DIR"], f"worker-{os.getpid()}.txt")
        while True:
            time.sleep(0.5)
            lines = [f"{k}\t{statistics.median(list(v)) * 1e6:.1f}\t{len(v)}\n"
                     for k, v in list(_acc.items()) if v]
            with open(out + ".tmp", "w") as f:
                f.writelines(lines)
            os.replace(out + ".tmp", out)

    threading.Thread(target=_dump, daemon=True).start()
