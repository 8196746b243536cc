"""A client process for the result-cache tests: maps a slow function over N items with
@gpu(cache=DIR) on its own one-device embedded cluster; every computation leaves a file
in LOG_DIR named <item>.<tag>.<unique>, so the test counts what was computed where."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["GPUFN_CPU_DEVICES"] = "1"
os.environ["GPUFN_PROGRESS"] = "0"

import gpufn

cache_dir, log_dir, n, tag = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
barrier = int(sys.argv[5]) if len(sys.argv) > 5 else 0
os.environ["CACHE_TEST_LOG"] = f"{log_dir}:{tag}"  # the workers inherit it


@gpufn.gpu(cache=cache_dir)
def work(i: int) -> int:
    import os
    import secrets
    import time

    where, who = os.environ["CACHE_TEST_LOG"].rsplit(":", 1)
    time.sleep(0.1)
    with open(os.path.join(where, f"{i}.{who}.{secrets.token_hex(4)}"), "w"):
        pass
    return i * i


client = gpufn.connect()
while not any(d["state"] == "ready" for d in client.status()["devices"]):
    time.sleep(0.05)
pids = [p.pid for p in (client.cluster.scheduler, client.cluster.supervisor) if p is not None]
pids += [d["pid"] for d in client.status()["devices"] if d.get("pid")]
(log_dir / f"pids.{tag}").write_text(json.dumps(pids))
if barrier:  # start together with the other client(s)
    (log_dir / f"ready.{tag}").touch()
    while len(list(log_dir.glob("ready.*"))) < barrier:
        time.sleep(0.01)
total = sum(work.map(range(n)))
print(json.dumps({"sum": total, **work.cache_info()}), flush=True)
