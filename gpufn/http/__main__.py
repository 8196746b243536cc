"""`python -m gpufn.http --address SCHEDULER --host H --port P`: run the gateway (uvicorn).

`gpufn serve --http-port` starts it as its child; it also runs on its own beside any
scheduler it can reach. It writes its port to `--ready-fd` once it listens and stops when
`--parent-pid` is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import uvicorn

from gpufn.cluster.gateway import refusal
from gpufn.http.app import create_app
from gpufn.http.server import make_config
from gpufn.wire import config


class _Server(uvicorn.Server):
    def __init__(self, cfg: uvicorn.Config, ready_fd: int | None, parent: int | None) -> None:
        super().__init__(cfg)
        self.ready_fd = ready_fd
        self.parent = parent

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        if self.ready_fd is not None:
            port = self.servers[0].sockets[0].getsockname()[1]
            os.write(self.ready_fd, f"{port}\n".encode())
            os.close(self.ready_fd)
        if self.parent:
            self._watcher = asyncio.ensure_future(self._watch_parent())

    async def _watch_parent(self) -> None:
        while not self.should_exit:
            if os.getppid() != self.parent:  # `gpufn serve` is gone: so are we
                self.should_exit = True
                return
            await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufn.http", description=__doc__)
    ap.add_argument("--address", default=None, help="the scheduler (default: GPUFN_ADDRESS)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--cert", default=None, help="TLS certificate (PEM)")
    ap.add_argument("--key", default=None, help="TLS private key (PEM, mode 0600)")
    ap.add_argument("--ready-fd", type=int, default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    args = ap.parse_args(argv)
    address = args.address or config.address()
    if not address:
        print("error: no scheduler address: pass --address or set GPUFN_ADDRESS", file=sys.stderr)
        return 2
    from pathlib import Path

    cert, key = (Path(args.cert) if args.cert else None), (Path(args.key) if args.key else None)
    why = refusal(args.host, cert, key)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    cfg = make_config(create_app(address), args.host, args.port, args.cert, args.key)
    server = _Server(cfg, args.ready_fd, args.parent_pid)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
