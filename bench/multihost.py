"""`.map` across worker hosts in network namespaces: 1 host against 4, leases on and off.

A head (`gpufn serve --no-workers`), four worker hosts of one simulated device each and a
client host, each in its own network namespace on a bridge (tests/multihost/netns.py;
needs root and `ip`). For each round the client maps N calls of a function that holds its
device for `--work-ms` without using the CPU (as a GPU kernel does: a sleep) and N no-ops,
first with only host1's worker started, then with all four; the head's CPU time per call
is read from /proc over each map. With leases the head sees a grant per device and one
account per lease; without (`GPUFN_LEASE_SECONDS=0`) every call crosses it twice.

    sudo python bench/multihost.py [--calls 2000] [--work-ms 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.multihost.netns import Network, netns_unavailable  # noqa: E402

PORT = 7555
CLIENT = r'''
import json, sys, time, gpufn
@gpufn.gpu(memory="1MiB")
def work(ms):
    time.sleep(ms / 1000)
    return ms
@gpufn.gpu(memory="1MiB")
def noop(x):
    return x
n, ms = int(sys.argv[1]), float(sys.argv[2])
if sys.argv[3] == "1":
    from gpufn.api import map_run
    map_run.LEASED_MAPS = False
c = gpufn.connect()
list(work.map([0.0] * 50)); list(noop.map(range(50)))
out = {}
for name, fn, args in (("work", work, [ms] * n), ("noop", noop, list(range(n)))):
    print("cpu?", flush=True); sys.stdin.readline()
    d0 = c.leases.direct_calls
    t = time.perf_counter(); r = list(fn.map(args)); dt = time.perf_counter() - t
    assert r == args
    print(json.dumps({"name": name, "rate": n / dt, "direct": (c.leases.direct_calls - d0) / n}),
          flush=True)
    sys.stdin.readline()
'''


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scheduler_pid(serve_pid: int) -> int:
    for _ in range(200):
        for task in Path("/proc").glob("[0-9]*"):
            try:
                if (task / "cmdline").read_bytes().find(b"gpufn.scheduler") >= 0:
                    stat = (task / "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == serve_pid:
                        return int(task.name)
            except OSError:
                continue
        time.sleep(0.1)
    raise SystemExit("the head's scheduler did not start")


def one_run(hosts: int, leases: bool, calls: int, work_ms: float,
            scheduled_maps: bool = False) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="gpufn-mh-"))
    net = Network(root)
    token = secrets.token_hex(16)
    addr_file = root / "head.json"

    def env(host_home: Path, **extra: str) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
        e.update(GPUFN_TOKEN=token, GPUFN_HOME=str(host_home), GPUFN_PROGRESS="0",
                 PYTHONPATH=str(REPO), **extra)
        return e

    try:
        head = net.add_host("head", 1)
        workers = [net.add_host(f"host{i}", 10 + i) for i in range(1, hosts + 1)]
        client = net.add_host("client", 30)
        lease_env = {} if leases else {"GPUFN_LEASE_SECONDS": "0"}
        serve = net.spawn(head, [sys.executable, "-m", "gpufn.cli.main", "serve", "--no-workers",
                                 "--host", head.address, "--port", str(PORT), "--address-file",
                                 str(addr_file)], env(head.home, **lease_env), "head.log")
        for w in workers:
            net.spawn(w, [sys.executable, "-m", "gpufn.cli.main", "worker", "--address-file",
                          str(addr_file), "--cpu-devices", "1", "--node", w.name],
                      env(w.home), "supervisor.log")
        while not addr_file.exists():
            time.sleep(0.1)
        address = json.loads(addr_file.read_text())["address"]
        sched = scheduler_pid(serve.pid)
        script = root / "client.py"
        script.write_text(CLIENT)
        proc = net.spawn(client, [sys.executable, str(script), str(calls), str(work_ms),
                                 "1" if scheduled_maps else "0"],
                         env(client.home, GPUFN_ADDRESS=address), "client.log",
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        out: dict[str, float] = {}
        for _ in range(2):
            line = proc.stdout.readline()
            if not line.startswith(b"cpu?"):
                raise SystemExit(f"client failed: {line!r}; see {client.log_dir}")
            c0 = cpu_seconds(sched)
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            rec = json.loads(proc.stdout.readline())
            out[f"{rec['name']} calls/s"] = rec["rate"]
            out[f"{rec['name']} head us/call"] = (cpu_seconds(sched) - c0) / calls * 1e6
            out[f"{rec['name']} direct"] = rec["direct"]
            proc.stdin.write(b"next\n")
            proc.stdin.flush()
        proc.wait(60)
        return out
    finally:
        net.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--work-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scheduled-maps", action="store_true",
                    help="the maps go through the head in the leases rows too "
                         "(gpufn.api.map_run.LEASED_MAPS off; single calls keep leases)")
    a = ap.parse_args()
    why = netns_unavailable()
    if why is not None:
        raise SystemExit(f"this benchmark needs network namespaces: {why}")
    rows: dict[tuple[int, bool], list[dict[str, float]]] = {}
    for r in range(a.repeats):
        for hosts, leases in ((1, True), (4, True), (1, False), (4, False)):
            rows.setdefault((hosts, leases), []).append(one_run(hosts, leases, a.calls, a.work_ms,
                                                                      a.scheduled_maps))
        print(f"round {r + 1}/{a.repeats} done", file=sys.stderr)

    def cell(key: tuple[int, bool], what: str) -> str:
        vals = [x[what] for x in rows[key]]
        if what.endswith("direct"):
            return f"{min(vals):.2f} / {statistics.median(vals):.2f}"
        return f"{min(vals):,.0f} / {statistics.median(vals):,.0f}"

    def med(key: tuple[int, bool], what: str) -> float:
        return statistics.median(x[what] for x in rows[key])

    print(f"\n.map of {a.calls:,} calls from a client host; worker hosts of 1 simulated device "
          f"each; {a.repeats} rounds, min / median; {os.cpu_count()} cores for everything")
    print(f"{'':34} {'1 host':>16} {'4 hosts':>16} {'4 / 1':>7}")
    for leases in (True, False):
        tag = "leases" if leases else "no leases"
        for what in ("work calls/s", "noop calls/s", "work head us/call", "noop head us/call",
                     "work direct", "noop direct"):
            if what.endswith("direct") and not leases:
                continue  # no leases: every call through the head
            ratio = med((4, leases), what) / max(med((1, leases), what), 1e-9)
            label = what.replace("work", f"{a.work_ms:g} ms calls").replace(
                "direct", "share under a lease")
            print(f"{tag + ': ' + label:34} {cell((1, leases), what):>16} "
                  f"{cell((4, leases), what):>16} {ratio:>6.2f}x")


if __name__ == "__main__":
    main()
