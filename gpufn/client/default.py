"""The default client of this process: `gpufn.connect()`, `get_client()` (finding the
cluster once, on first use, or starting the embedded one), and what happens at exit."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from gpufn.client.client import Client
from gpufn.exceptions import ConnectionLost
from gpufn.net.discovery import Source, Target, announce, resolve
from gpufn.wire import shm

_default: Client | None = None
_default_lock = threading.RLock()
_exiting = False  # set when interpreter exit begins: no connection or cluster is made after it


def connect(address: str | None = None, *, token: str | None = None) -> Client:
    """Connect to a scheduler and make it the default for `.remote()` and friends.

    The cluster is found as everywhere in gpufn (`gpufn.net.discovery.resolve`): `address`,
    else GPUFN_ADDRESS, else the running `gpufn serve` of this GPUFN_HOME, else an embedded
    local cluster started (or reused) for this process.
    """
    return connect_to(resolve(address, token))


def connect_to(target: Target) -> Client:
    """`connect` to a cluster already found (`gpufn.net.discovery.resolve`)."""
    global _default
    with _default_lock:
        if _exiting or sys.is_finalizing():
            raise ConnectionLost(
                "the interpreter is exiting; gpufn calls made after exit has begun are refused "
                "(is a daemon thread still calling? stop or join it before the main thread ends)")
        if target.embedded and _default is not None and _default.pid != os.getpid():
            # A forked child reuses its parent's embedded cluster instead of starting one.
            target = Target(_default.address, _default.token, Source.ARGUMENT,
                            f"the embedded cluster of the parent process (pid {_default.pid})")
            _default = None
        if _default is not None and _default.pid == os.getpid():
            same = (target.embedded and _default.cluster is not None) or (
                target.address is not None and target.address == _default.address)
            if same and not _default._closed.is_set():
                return _default
            _shutdown_default()
        _default = _start(target) if target.embedded else Client(
            str(target.address), target.token, target=target)
        return _default


def _start(target: Target) -> Client:
    """Start an embedded cluster (saying why first, if another one may have been meant)."""
    from gpufn.cluster.embedded import LocalCluster

    if target.notice:
        announce(target)
    elif _interactive():  # it takes seconds: say what the wait is (a .map bar waits behind it)
        _say("gpufn: starting a local cluster for this process (to share one, run `gpufn "
             "serve --detach` or set GPUFN_ADDRESS) ...")
    cluster = LocalCluster(private_state=True)
    addr, tok = cluster.start()
    try:
        client = Client(addr, tok, cluster=cluster, target=target)
        cluster.wait_for_devices(client)
    except BaseException:
        cluster.stop()
        raise
    return client


def get_client() -> Client:
    """The default client, connecting (or starting the embedded cluster) on first use."""
    c = _default
    if c is not None and c.pid == os.getpid() and not c._closed.is_set():
        return c
    return connect()


def _interactive() -> bool:
    """stderr is a terminal, or this is a notebook kernel (whose stderr shows in the cell)."""
    try:
        return sys.stderr.isatty() or "ipykernel" in sys.modules
    except (AttributeError, ValueError):
        return False


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not stop the cluster from starting
        pass


def served_client(what: str) -> Client:
    """The default client, for `what` (e.g. "gpufn.deploy()"), which needs a cluster that
    outlives this process: an embedded cluster (with its private state) is refused, with
    what to do instead."""
    c = _default
    if c is not None and c.pid == os.getpid() and not c._closed.is_set():
        if c.cluster is None:
            return c
        raise ConnectionLost(
            f"{what} needs a running cluster, and this process uses an embedded one (its "
            "state ends with this process). Start one with `gpufn serve --detach`, then "
            "gpufn.connect() to it (or set GPUFN_ADDRESS), or pass client=.")
    target = resolve()
    if target.embedded:
        if target.notice:
            raise ConnectionLost(f"{what} needs a running cluster and found none: "
                                 f"{target.notice}; {target.advice}.")
        raise ConnectionLost(
            f"{what} needs a running cluster and found none: start one with `gpufn serve "
            "--detach` (it is then found through this GPUFN_HOME), or set GPUFN_ADDRESS, or "
            "pass client=.")
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
    shm.sweep(owner=os.getpid())  # results this process never read (gpufn/wire/shm.py)


atexit.register(_at_exit)
