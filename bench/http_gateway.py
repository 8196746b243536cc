"""What the HTTP gateway adds to a call, measured in one run against its floor.

    python bench/http_gateway.py [--quick]

Starts `gpufn serve --http-port 0` (2 simulated devices) in a temporary home, deploys a
no-op, and interleaves, round by round:

- latency (one caller, keep-alive, sequential calls): an HTTP no-op call through the
  gateway; a bare uvicorn route that calls nothing (the same uvicorn, httptools and
  uvloop, the same httpx client: the HTTP floor); a Python-client no-op `.remote()` (the
  call-path floor). The gateway's p50 is compared with the sum of the two floors'
  (target: within 1.5x);
- throughput: requests/s of 64 concurrent httpx clients against the gateway, and the
  Python client's `.map` rate over the same number of no-ops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

import gpufn

APP = textwrap.dedent('''
    import gpufn

    @gpufn.gpu
    def noop():
        return None
''')

BARE = textwrap.dedent('''
    import sys
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def noop(request):
        await request.body()
        return Response(b'{"result":null,"call_id":"0000000000000000"}', media_type="application/json")

    app = Starlette(routes=[Route("/v1/apps/b/noop", noop, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                access_log=False, lifespan="off")
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def http_latency(url: str, token: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as h:
        for _ in range(max(20, n // 10)):  # warm: connection, caches
            h.post("/v1/apps/b/noop", json={})
        for _ in range(n):
            t = time.perf_counter()
            r = h.post("/v1/apps/b/noop", json={})
            out.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
    return out


def python_latency(fn: Any, n: int) -> list[float]:
    for _ in range(max(20, n // 10)):
        fn.remote()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn.remote()
        out.append(time.perf_counter() - t)
    return out


async def _load(url: str, token: str, total: int, clients: int) -> float:
    per = total // clients
    hs = [httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"})
          for _ in range(clients)]
    try:
        async def one(h: httpx.AsyncClient, k: int) -> None:
            for _ in range(k):
                r = await h.post("/v1/apps/b/noop", json={})
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one(h, 2) for h in hs))  # connect and warm
        t = time.perf_counter()
        await asyncio.gather(*(one(h, per) for h in hs))
        return per * clients / (time.perf_counter() - t)
    finally:
        await asyncio.gather(*(h.aclose() for h in hs))


def map_rate(fn: Any, total: int) -> float:
    list(fn.starmap([()] * 50))  # warm
    t = time.perf_counter()
    out = list(fn.starmap([()] * total))
    assert len(out) == total
    return total / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000, help="sequential calls per round and path")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3200, help="requests of the concurrent run")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="300 calls, 2 rounds, 1,280 requests")
    a = ap.parse_args()
    if a.quick:
        a.calls, a.rounds, a.requests = 300, 2, 1280
    home = Path(tempfile.mkdtemp(prefix="gpufn-bench-http-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env.update(GPUFN_HOME=str(home), GPUFN_PROGRESS="0")
    (home / "app.py").write_text(APP)
    serve = subprocess.Popen([sys.executable, "-m", "gpufn.cli.main", "serve", "--port", "0",
                              "--http-port", "0", "--cpu-devices", "2", "--json"], env=env,
                             stdout=subprocess.PIPE, text=True, cwd=home)
    bare_port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE, str(bare_port)], env=env)
    client = None
    try:
        assert serve.stdout is not None
        info = json.loads(serve.stdout.readline())
        token = json.loads((home / "cluster.json").read_text())["token"]
        client = gpufn.connect(info["address"], token=token)
        while not all(d["state"] == "ready" for d in client.status()["devices"]):
            time.sleep(0.1)
        gpufn.deploy(home / "app.py", name="b")
        fn = gpufn.lookup("b", "noop")
        bare_url = f"http://127.0.0.1:{bare_port}"
        for _ in range(100):
            try:
                httpx.post(bare_url + "/v1/apps/b/noop", json={})
                break
            except httpx.TransportError:
                time.sleep(0.1)
        rows: dict[str, list[float]] = {"gateway": [], "bare uvicorn": [], "python client": []}
        p99: dict[str, list[float]] = {k: [] for k in rows}
        rates: dict[str, list[float]] = {"gateway, 64 httpx clients": [], "python .map": []}
        for r in range(a.rounds):
            for name, run in (("bare uvicorn", lambda: http_latency(bare_url, "x", a.calls)),
                              ("python client", lambda: python_latency(fn, a.calls)),
                              ("gateway", lambda: http_latency(info["http"], token, a.calls))):
                xs = run()
                rows[name].append(statistics.median(xs) * 1e6)
                p99[name].append(pct(xs, 0.99) * 1e6)
            rates["gateway, 64 httpx clients"].append(
                asyncio.run(_load(info["http"], token, a.requests, a.clients)))
            rates["python .map"].append(map_rate(fn, a.requests))
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
        print(f"\nno-op call latency, {a.calls} sequential calls x {a.rounds} rounds "
              "(median of rounds; min in brackets), microseconds")
        print(f"{'path':<16}{'p50':>16}{'p99':>16}")
        for name in rows:
            print(f"{name:<16}{statistics.median(rows[name]):>10.0f} ({min(rows[name]):.0f})"
                  f"{statistics.median(p99[name]):>10.0f} ({min(p99[name]):.0f})")
        floor = statistics.median(rows["bare uvicorn"]) + statistics.median(rows["python client"])
        ratio = statistics.median(rows["gateway"]) / floor
        print(f"gateway p50 / (bare uvicorn + python client) = {ratio:.2f}x "
              f"(target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'})")
        print(f"\nthroughput, {a.requests} no-ops (median of rounds; min in brackets)")
        for name, xs in rates.items():
            print(f"{name:<28}{statistics.median(xs):>8.0f} calls/s ({min(xs):.0f})")
        print(f"gateway / python .map = {statistics.median(rates['gateway, 64 httpx clients']) / statistics.median(rates['python .map']):.2f}x")
    finally:
        if client is not None:
            client.close()
        bare.terminate()
        serve.terminate()
        bare.wait(10)
        serve.wait(30)


if __name__ == "__main__":
    main()
