"""The gateway's uvicorn server (gpufn/http/server.py) in this process over real sockets: a
request's head must arrive within the read timeout, a handler may take longer, bytes that
trickle in after an answer do not keep the connection; its config (no Server header, the
lifespan run, TLS when given a certificate)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gpufn.http.server import make_config, with_head_timeout

from ..integration import _raw_http as raw

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.6  # GPUFN_HTTP_READ_TIMEOUT for these servers
SLACK = 1.5
started_up: list[str] = []


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers at once, or after `?sleep=S` seconds; never reads a body."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                started_up.append("yes")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    query = scope.get("query_string", b"").decode()
    if query.startswith("sleep="):
        await asyncio.sleep(float(query[6:]))
    body = f"{scope['method']} {scope['path']}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(monkeypatch: pytest.MonkeyPatch, cert: str | None = None,
            key: str | None = None) -> Iterator[int]:
    monkeypatch.setenv("GPUFN_HTTP_READ_TIMEOUT", str(TIMEOUT))
    server = uvicorn.Server(make_config(app, "127.0.0.1", 0, cert, key))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_a_connection_that_never_sends_a_byte_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(monkeypatch) as port, _connect(port) as idle:
        took = raw.closed_within(idle, TIMEOUT + SLACK)
        assert took is not None and took >= TIMEOUT * 0.8, took


def test_a_head_sent_a_byte_at_a_time_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(monkeypatch) as port, _connect(port) as slow:
        head = raw.head("GET", "/slow", None, X_Padding="x" * 40)
        took = raw.sent_until_closed(slow, (bytes([b]) for b in head), 0.05)
        assert took is not None, "a head that took longer than the timeout was kept"
        assert TIMEOUT * 0.8 <= took < TIMEOUT + SLACK, took


def test_a_handler_may_take_longer_than_the_head_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(monkeypatch) as port, _connect(port) as sock:
        sock.sendall(raw.head("GET", "/a", None))
        status, headers, body = raw.response(sock)
        assert (status, body) == (200, b"GET /a") and "server" not in headers, headers
        # the next request on the same connection: its head in, its handler slow
        sock.sendall(raw.head("GET", f"/b?sleep={TIMEOUT * 2.5}", None))
        status, headers, body = raw.response(sock, 10)
        assert (status, body) == (200, b"GET /b"), body
        sock.sendall(raw.head("GET", "/c", None))  # and the connection still serves
        assert raw.response(sock)[2] == b"GET /c"


def test_a_head_sent_in_pieces_within_the_timeout_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(monkeypatch) as port, _connect(port) as sock:
        whole = raw.head("GET", "/pieces", None)
        for i in range(0, len(whole), 8):
            sock.sendall(whole[i:i + 8])
            time.sleep(TIMEOUT / 10)
        assert raw.response(sock)[2] == b"GET /pieces"


def test_bytes_trickling_in_after_an_answer_do_not_keep_the_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(monkeypatch) as port, _connect(port) as sock:
        # a body promised and never read: the answer goes, the rest trickles in
        sock.sendall(raw.head("POST", "/refused", None, Content_Length="10000") + b"x")
        assert raw.response(sock)[0] == 200
        took = raw.sent_until_closed(sock, [b"y"] * int((TIMEOUT + SLACK) / 0.1), 0.1)
        assert took is not None, "a client trickling leftovers kept its connection"
        assert took >= TIMEOUT * 0.8, took


def test_the_lifespan_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    started_up.clear()
    with serving(monkeypatch):
        assert started_up == ["yes"]


def test_the_protocol_is_named_for_its_base() -> None:
    class Base(asyncio.Protocol):
        pass

    assert with_head_timeout(Base, 1.0).__name__ == "HeadTimeoutBase"


def test_tls_when_given_a_certificate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    ctx = ssl.create_default_context(cafile=str(cert))
    ctx.check_hostname = False
    with (serving(monkeypatch, str(cert), str(key)) as port, _connect(port) as plain,
          ctx.wrap_socket(plain) as sock):
        sock.sendall(raw.head("GET", "/tls", None))
        assert raw.response(sock)[2] == b"GET /tls"
