"""The default client of this process: `gpufn.connect()`, `get_client()` (connecting or
starting the embedded cluster on first use), and what happens at interpreter exit."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from gpufn.client.client import Client
from gpufn.exceptions import ConnectionLost
from gpufn.wire import config

_default: Client | None = None
_default_lock = threading.RLock()
_exiting = False  # set when interpreter exit begins: no connection or cluster is made after it


def connect(address: str | None = None, *, token: str | None = None) -> Client:
    """Connect to a scheduler and make it the default for `.remote()` and friends.

    With no address and no GPUFN_ADDRESS, start (or reuse) the embedded local cluster.
    """
    global _default
    with _default_lock:
        if _exiting or sys.is_finalizing():
            raise ConnectionLost(
                "the interpreter is exiting; gpufn calls made after exit has begun are refused "
                "(is a daemon thread still calling? stop or join it before the main thread ends)")
        addr = address or config.address()
        tok = token if token is not None else config.token()
        if addr is None and _default is not None and _default.pid != os.getpid():
            # A forked child reuses its parent's embedded cluster instead of starting one.
            addr, tok = _default.address, _default.token
            _default = None
        if _default is not None and _default.pid == os.getpid():
            same = (addr is None and _default.cluster is not None) or (
                addr is not None and config.normalize_address(addr) == _default.address)
            if same and not _default._closed.is_set():
                return _default
            _shutdown_default()
        if addr is None:
            from gpufn.client.embedded import LocalCluster

            cluster = LocalCluster()
            addr, tok = cluster.start()
            try:
                client = Client(addr, tok, cluster=cluster)
                cluster.wait_for_devices(client)
            except BaseException:
                cluster.stop()
                raise
        else:
            if not tok:  # `gpufn serve` on this machine leaves its token for local clients
                from gpufn.net.cluster_file import saved_token

                tok = saved_token(addr)
            client = Client(addr, tok)
        _default = client
        return client


def get_client() -> Client:
    """The default client, connecting (or starting the embedded cluster) on first use."""
    c = _default
    if c is not None and c.pid == os.getpid() and not c._closed.is_set():
        return c
    return connect()


def _shutdown_default() -> None:
    global _default
    with _default_lock:
        c, _default = _default, None
    if c is None or c.pid != os.getpid():
        return
    c.close()
    if c.cluster is not None:
        c.cluster.stop()


def _at_exit() -> None:
    global _exiting
    _exiting = True
    _shutdown_default()


atexit.register(_at_exit)
