"""Where a client finds its cluster, the same way for the library and the CLI: an explicit
address, then GPUFN_ADDRESS, then the running `gpufn serve` of this GPUFN_HOME (its cluster
file, if its pid is alive and its port answers), and only then an embedded cluster. The
answer remembers where the address came from, so errors can say so."""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from gpufn.exceptions import InvalidSpec
from gpufn.net import cluster_file
from gpufn.net.processes import alive
from gpufn.wire import config


class Source(Enum):
    """Where a client's address came from."""

    ARGUMENT = "argument"          # connect(address) / --address
    ENVIRONMENT = "environment"    # GPUFN_ADDRESS
    CLUSTER_FILE = "cluster file"  # the running `gpufn serve` of this GPUFN_HOME
    EMBEDDED = "embedded"          # none: start an embedded cluster


@dataclass(frozen=True, slots=True)
class Target:
    """The cluster a client should use, and where that answer came from."""

    address: str | None  # None: start an embedded cluster
    token: str | None
    source: Source
    where: str = ""   # the address's origin in words ("GPUFN_ADDRESS", "the cluster file ...")
    notice: str = ""  # embedded although another cluster may have been meant: why,
    advice: str = ""  # and what to do to reach that one

    @property
    def embedded(self) -> bool:
        return self.address is None

    def origin(self) -> str:
        """Where the address came from, for a repr or a message."""
        return self.where or {Source.EMBEDDED: "an embedded cluster of this process"}.get(
            self.source, self.source.value)

    def unreachable_hint(self) -> str:
        """What to check when the scheduler at this address does not answer."""
        if self.source is Source.ENVIRONMENT:
            return ("The address came from GPUFN_ADDRESS: check it, or unset it to use the "
                    "`gpufn serve` of this GPUFN_HOME (or an embedded cluster).")
        if self.source is Source.CLUSTER_FILE:
            return (f"The address came from {self.where}: is that server still running? "
                    "`gpufn status` shows it; start one with `gpufn serve --detach`.")
        if self.source is Source.ARGUMENT:
            return f"The address came from {self.origin()}: check it. Is `gpufn serve` running there?"
        return ""


def resolve(address: str | None = None, token: str | None = None, *,
            label: str = "the address passed to gpufn.connect()") -> Target:
    """The cluster to use: `address` (named `label` in messages), else GPUFN_ADDRESS, else
    the running `gpufn serve` of this GPUFN_HOME, else an embedded cluster (`embedded`,
    with a `notice` when another cluster may have been meant). Reads files and probes one
    local port: call it once per connect, never per call. A malformed address raises
    `InvalidSpec` naming the form tcp://HOST:PORT."""
    env_token = token if token is not None else config.token()
    if address:
        addr = config.normalize_address(address)
        return Target(addr, env_token or cluster_file.saved_token(addr), Source.ARGUMENT, label)
    env = config.address()
    if env:
        addr = config.normalize_address(env)
        return Target(addr, env_token or cluster_file.saved_token(addr), Source.ENVIRONMENT,
                      "GPUFN_ADDRESS")
    path = cluster_file.home() / "cluster.json"
    saved = cluster_file.load_cluster_file()
    if saved is None or not isinstance(saved.get("address"), str):
        notice, advice = _other_servers()
        return Target(None, env_token, Source.EMBEDDED, notice=notice, advice=advice)
    pid = saved.get("pid")
    try:
        addr = config.normalize_address(saved["address"])
    except InvalidSpec:
        return Target(None, env_token, Source.EMBEDDED,
                      notice=f"{path} holds no usable address ({saved['address']!r})",
                      advice="remove the file, or start `gpufn serve --detach` again")
    who = f"`gpufn serve` pid {pid}" if isinstance(pid, int) else "`gpufn serve`"
    if isinstance(pid, int) and not alive(pid):
        return Target(None, env_token, Source.EMBEDDED,
                      notice=f"{path} names {who}, which is no longer running (a stale file)",
                      advice="start the server again with `gpufn serve --detach`, or remove "
                             "the file")
    if not answers(addr):
        return Target(None, env_token, Source.EMBEDDED,
                      notice=f"{path} names {who} at {addr}, which does not answer",
                      advice="restart it (`gpufn shutdown --force`, then `gpufn serve "
                             "--detach`)")
    tok = env_token or (saved.get("token") if isinstance(saved.get("token"), str) else None)
    return Target(addr, tok, Source.CLUSTER_FILE, f"{path}, left by {who}")


def answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections at a tcp:// (or ipc://) address."""
    endpoint, _ = config.split_address(address)
    if endpoint.startswith("ipc://"):
        return os.path.exists(endpoint[len("ipc://"):])
    host = config.address_host(endpoint)
    try:
        port = int(endpoint.rsplit(":", 1)[1])
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except (OSError, ValueError, IndexError):
        return False


@dataclass(frozen=True, slots=True)
class ServeProcess:
    """A `gpufn serve` of this OS user, seen in /proc."""

    pid: int
    home: Path
    address: str | None  # from its cluster file, when it is readable


def _is_serve(argv: list[str]) -> bool:
    head = argv[:3]
    gpufn = any(a.endswith("/gpufn") or a == "gpufn" or a == "gpufn.cli.main"
                or a.endswith("gpufn/cli/main.py") for a in head)
    return gpufn and "serve" in argv[1:4]


def serve_processes() -> list[ServeProcess]:
    """Every `gpufn serve` this user runs (Linux: read from /proc; elsewhere none)."""
    out = []
    uid, me = os.getuid(), os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            if not _is_serve(argv):
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.decode(errors="replace").partition("=")[::2]
                           for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        home = Path(env["GPUFN_HOME"]) if env.get("GPUFN_HOME") else (
            Path(env.get("HOME", str(Path.home()))) / ".gpufn")
        saved = cluster_file.read_cluster_file(home / "cluster.json")
        address = saved.get("address") if saved and saved.get("pid") == int(name) else None
        out.append(ServeProcess(int(name), home, address if isinstance(address, str) else None))
    return out


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return a == b


def other_serves() -> list[ServeProcess]:
    """The `gpufn serve` processes of this user that serve another GPUFN_HOME than ours."""
    here = cluster_file.home()
    return [s for s in serve_processes() if not _same(s.home, here)]


def _owned(home: Path) -> bool:
    """Whether this user owns the folder `home` (or, if it is gone, its parent): only such
    a folder is named in a message (another user's serve, as root, or under a shared
    uid, is someone else's to name)."""
    for d in (home, home.parent):
        try:
            return d.stat().st_uid == os.getuid()
        except OSError:
            continue
    return False


def _other_servers() -> tuple[str, str]:
    """(notice, advice) if a `gpufn serve` of another GPUFN_HOME runs while this one has
    none. One that serves a folder of this user's is named; others are only counted."""
    here = cluster_file.home()
    others = other_serves()
    if not others:
        return "", ""
    mine = [s for s in others if _owned(s.home)]
    if len(mine) == 1:
        s = mine[0]
        at = f" at {s.address}" if s.address else ""
        more = f" (and {len(others) - 1} of other folders)" if len(others) > 1 else ""
        return (f"no `gpufn serve` runs for GPUFN_HOME={here}, but one of another GPUFN_HOME "
                f"of yours does{at} (pid {s.pid}, GPUFN_HOME={s.home}){more}",
                f"to use it, set GPUFN_HOME={s.home} or GPUFN_ADDRESS")
    return (f"no `gpufn serve` runs for GPUFN_HOME={here}; {len(others)} of another "
            "GPUFN_HOME run on this machine (their folders are not named: not all yours)",
            "to use one, set GPUFN_ADDRESS=<its address> or GPUFN_HOME=<its folder>")


_announced: set[str] = set()
_announce_lock = threading.Lock()


def announce(target: Target) -> None:
    """Say once per process, in one line on stderr, why an embedded cluster starts although
    another may have been meant."""
    if not target.notice:
        return
    with _announce_lock:
        if target.notice in _announced:
            return
        _announced.add(target.notice)
    try:
        sys.stderr.write(f"gpufn: {target.notice}; this process starts an embedded cluster of "
                         f"its own ({target.advice}).\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not stop the cluster from starting
        pass


def _port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _speaks_gpufn(host: str, port: int) -> bool:
    """Whether a gpufn scheduler answers a Hello at host:port (it refuses our empty token)."""
    import zmq

    from gpufn.exceptions import GpufnError
    from gpufn.net.connection import Connection, ConnectionConfig
    from gpufn.wire import protocol as p

    if host in ("0.0.0.0", "*", "::", ""):
        host = "127.0.0.1"
    ctx: zmq.Context[Any] = zmq.Context()
    conn = None
    try:
        conn = Connection(ctx, ConnectionConfig(f"tcp://{host}:{port}"), f"probe/{os.getpid()}",
                          p.Role.CLIENT)
        conn.handshake(1.5)
        return True
    except GpufnError as e:
        return type(e).__name__ != "ConnectionLost"
    except zmq.ZMQError:
        return False
    finally:
        if conn is not None:
            conn.close()
        ctx.term()


def port_holder(host: str, port: int) -> str | None:
    """None if `gpufn serve` can listen on host:port; else what holds the port, in words
    (a `gpufn serve` of some GPUFN_HOME, another gpufn scheduler, or another program)."""
    if port == 0 or not _port_in_use(host, port):
        return None
    for s in serve_processes():
        if s.address and config.split_address(s.address)[0].rsplit(":", 1)[-1] == str(port):
            return (f"the `gpufn serve` of GPUFN_HOME={s.home} (pid {s.pid})" if _owned(s.home)
                    else f"a `gpufn serve` of another GPUFN_HOME (pid {s.pid})")
    if _speaks_gpufn(host, port):
        return "a gpufn scheduler"
    return "another program"
