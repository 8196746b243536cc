"""A client host's driver: reads JSON job requests on stdin, runs each in a thread, and
prints one JSON line per finished job (`{"id", "ok", "value" | "error", "message"}`)."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from tests.multihost import jobs

_out = threading.Lock()


def _reply(obj: dict[str, Any]) -> None:
    line = json.dumps(obj, default=str)
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _run(req: dict[str, Any]) -> None:
    t0 = time.monotonic()
    try:
        value = getattr(jobs, f"job_{req['job']}")(**req.get("args", {}))
        _reply({"id": req["id"], "ok": True, "value": value, "elapsed": time.monotonic() - t0})
    except BaseException as e:  # reported to the test, which decides
        _reply({"id": req["id"], "ok": False, "error": type(e).__name__, "message": str(e),
                "elapsed": time.monotonic() - t0})


def main() -> None:
    import gpufn

    gpufn.connect()  # fail early if the head is unreachable
    _reply({"id": "ready", "ok": True})
    for line in sys.stdin:
        if line.strip():
            threading.Thread(target=_run, args=(json.loads(line),), daemon=True).start()


if __name__ == "__main__":
    main()
