"""A real worker process against a scripted scheduler: after a restart, a worker whose
Hello reaches the new scheduler before its supervisor's does is refused ("not announced
by a supervisor"); it says Hello again a second later, keeping what it runs, instead of
staying unregistered while its control channel heartbeats happily (a device stuck in
"starting" after a head restart, 1 run in 4 of tests/multihost under load)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from gpufn.wire import protocol as p

from ..conftest import assert_all_gone
from ..unit.test_connection import TcpScheduler
from ._waits import wait_for


def test_a_worker_refused_on_its_hello_again_says_it_again() -> None:
    restarted = threading.Event()
    work_hellos: list[float] = []
    known: set[bytes] = set()

    def answer(peer: bytes, msg: p.Message) -> list[p.Message]:
        if isinstance(msg, p.Hello):
            if msg.info.channel == "control":
                known.add(peer)
                return [p.Welcome(True, info=p.WelcomeInfo(devices=1))]
            work_hellos.append(time.monotonic())
            if restarted.is_set() and len(work_hellos) == 2:  # before the supervisor's
                return [p.Welcome(False, "GpufnError", "device 'n:0' was not announced by a "
                                  "supervisor; start workers with `gpufn serve`")]
            known.add(peer)
            return [p.Welcome(True, info=p.WelcomeInfo(devices=1))]
        if restarted.is_set() and peer not in known:
            return [p.Error("AuthenticationError", "this connection has not said Hello")]
        return []

    sched = TcpScheduler(answer)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env["GPUFN_TOKEN"] = "t"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufn.worker", "--address", sched.address, "--device", "n:0",
         "--kind", "cpu", "--memory", str(2**30)], env=env, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(work_hellos) == 1 and len(known) == 2, 60, "the worker to join")
        known.clear()
        restarted.set()  # the next heartbeat is refused: both channels say Hello again
        wait_for(lambda: len(work_hellos) >= 3, 20, "the worker to say Hello again")
        assert work_hellos[2] - work_hellos[1] >= 0.5  # after a pause, not in a loop
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)
        sched.close()
    assert_all_gone([proc.pid])
