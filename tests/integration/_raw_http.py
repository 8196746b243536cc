"""HTTP/1.1 by hand over a socket, for what HTTP clients will not do: a body that never
ends, a head sent a byte at a time, a half-open connection; and the gateway process's
memory, read from /proc."""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

MiB = 2**20


def connect(url: str, timeout: float = 30.0) -> socket.socket:
    u = urlparse(url)
    assert u.hostname is not None and u.port is not None
    return socket.create_connection((u.hostname, u.port), timeout=timeout)


def head(method: str, path: str, token: str | None, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def readable(sock: socket.socket, timeout: float = 0.0) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


def response(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the next answer on `sock`."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = sock.recv(65536)
        assert got, f"the connection closed before an answer: {buf!r}"
        buf += got
    raw_head, _, body = buf.partition(b"\r\n\r\n")
    first, *rest = raw_head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in rest)}
    size = int(headers.get("content-length", "0"))
    while len(body) < size:
        got = sock.recv(65536)
        assert got, "the connection closed in the middle of an answer"
        body += got
    return int(first.split()[1]), headers, body[:size]


def closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the peer closes `sock` (reading and dropping whatever it sends), or
    None if it is still open after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if readable(sock, 0.1):
            try:
                if not sock.recv(65536):
                    return time.monotonic() - start
            except ConnectionError:
                return time.monotonic() - start
    return None


def sent_until_closed(sock: socket.socket, pieces: Iterable[bytes], pause: float) -> float | None:
    """Send `pieces` one at a time, `pause` apart (reading and dropping any answer): seconds
    until the peer closed `sock`, or None if every piece went and it is still open."""
    start = time.monotonic()
    for piece in pieces:
        try:
            sock.sendall(piece)
            if readable(sock, pause) and not sock.recv(65536):
                return time.monotonic() - start
        except ConnectionError:
            return time.monotonic() - start
    return None


def children(pid: int) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat = Path(f"/proc/{e}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(e))
    return out


def gateway_pid(serve_pid: int) -> int:
    """The gateway child of `gpufn serve` (python -m gpufn.http)."""
    for pid in children(serve_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gpufn.http" in cmd:
            return pid
    raise AssertionError(f"gpufn serve ({serve_pid}) has no gateway child")


def memory_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def reset_peak(pid: int) -> None:
    """Make VmHWM (peak resident memory) start again from the current resident memory."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
