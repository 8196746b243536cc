"""One of many client processes of `test_scale`: connect, wait for the gate file, make N
calls at once, check every result, print one JSON line (bad results, own peak RSS)."""

from __future__ import annotations

import json
import os
import sys
import time

import gpufn

from .funcs import echo


def main() -> None:
    address, token, k, n, gate = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    out: dict[str, object] = {"k": k}
    try:
        gpufn.connect(address, token=token)
        print(json.dumps({"k": k, "ready": True}), flush=True)
        while not os.path.exists(gate):
            time.sleep(0.05)
        t0 = time.monotonic()
        calls = [echo.spawn((k, i)) for i in range(n)]
        got = [c.get(timeout=600) for c in calls]
        out["bad"] = sum(1 for i, g in enumerate(got) if tuple(g) != (k, i))
        out["seconds"] = time.monotonic() - t0
    except BaseException as e:  # reported to the test, which fails on it
        out["error"] = repr(e)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
