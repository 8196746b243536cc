"""`python -m gpufn.scheduler`: the scheduler process (started by the CLI or the embedded cluster)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gpufn.net.curve import SecurityError, ServerSecurity
from gpufn.scheduler.books.users import UserStoreError
from gpufn.scheduler.nouns.settings import SchedulerConfig
from gpufn.scheduler.server import run
from gpufn.wire import config


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m gpufn.scheduler")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-fd", type=int, default=None)
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--ipc", default=None, help="bind this Unix socket path instead of TCP")
    ap.add_argument("--keys", type=Path, default=None,
                    help="folder with the CURVE key pair (server.key_secret); required off loopback")
    ap.add_argument("--allow-keys", type=Path, default=None,
                    help="admit only CURVE clients whose public key (*.key) is in this folder")
    ap.add_argument("--durable", action="store_true",
                    help="keep usage, logs and the devices seen in the state dir (gpufn serve)")
    ap.add_argument("--final-on-sigterm", action="store_true",
                    help="SIGTERM stops for good (clients' calls fail), as SIGINT does")
    a = ap.parse_args()
    logging.basicConfig(level=config.log_level(),
                        format="%(asctime)s gpufn-scheduler %(levelname)s %(message)s")
    log_file = config.scheduler_log()
    if log_file is not None:  # e.g. for tests that check the log for errors
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(handler)
    try:
        security = ServerSecurity.for_bind(a.host, a.ipc is not None, a.keys, a.allow_keys)
    except SecurityError as e:
        print(f"gpufn scheduler refused to start: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    cfg = SchedulerConfig.from_env(config.token())
    try:
        status = run(a.host, a.port, cfg, a.ready_fd, a.parent_pid, a.ipc, security,
                     config.metrics_port(), a.durable, a.final_on_sigterm)
    except UserStoreError as e:  # before it listens: nothing to clean up
        print(f"gpufn scheduler refused to start: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(status)


if __name__ == "__main__":
    main()
