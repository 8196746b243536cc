"""One user's process against a served cluster, as a user runs it (GPUFN_ADDRESS and
GPUFN_TOKEN from the environment; functions defined here travel by value):

    python _users_driver.py spawn NAME FLAGS   # prints "id ID", then "result VALUE" or "error ..."
    python _users_driver.py attach ID          # FunctionCall.from_id(ID).get()
    python _users_driver.py cancel ID          # FunctionCall.from_id(ID).cancel()
    python _users_driver.py call NAME          # a quick call that prints a secret
    python _users_driver.py lookup APP FN ARG  # a deployed function
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import gpufn


@gpufn.gpu
def work(name: str, flags: str) -> str:
    Path(flags, f"started-{name}").touch()
    deadline = time.monotonic() + 90
    while not Path(flags, f"release-{name}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"result of {name}"


@gpufn.gpu
def quick(name: str) -> str:
    print(f"secret of {name}")
    return f"quick {name}"


def main(argv: list[str]) -> None:
    cmd = argv[0]
    try:
        if cmd == "spawn":
            call = work.spawn(argv[1], argv[2])
            print("id", call.id, flush=True)
            print("result", call.get(timeout=120), flush=True)
        elif cmd == "attach":
            print("result", gpufn.FunctionCall.from_id(argv[1]).get(timeout=60), flush=True)
        elif cmd == "cancel":
            print("cancel", gpufn.FunctionCall.from_id(argv[1]).cancel(), flush=True)
        elif cmd == "call":
            print("result", quick.remote(argv[1]), flush=True)
        elif cmd == "lookup":
            print("result", gpufn.lookup(argv[1], argv[2]).remote(argv[3]), flush=True)
        else:
            raise SystemExit(f"unknown command {cmd}")
    except gpufn.GpufnError as e:
        print("error", type(e).__name__, e, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
