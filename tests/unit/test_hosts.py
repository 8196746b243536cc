"""Many hosts, without the hosts: interface selection, the address file, join reasons."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from gpufn.exceptions import AuthenticationError, ConnectionLost, ProtocolMismatch
from gpufn.net import address_file
from gpufn.net import interfaces as netif
from gpufn.wire import protocol as p
from gpufn.worker.supervisor.joining import JoinLog, refusal_reason

IFACES = {"lo": "127.0.0.1", "eth0": "10.213.0.11", "eth1": "192.168.5.2", "docker0": None}


def _interface_of(addr: str) -> str | None:
    return netif.interface_of(addr, interfaces=lambda: list(enumerate(IFACES)),
                              ipv4_of=IFACES.get, ipv6=lambda: {"fe80::1": "eth1"})


def test_scheduler_host_parses_tcp_addresses_only() -> None:
    assert netif.scheduler_host("tcp://10.213.0.1:7555") == "10.213.0.1"
    assert netif.scheduler_host("tcp://[fe80::1]:7555") == "fe80::1"
    assert netif.scheduler_host("tcp://head:7555?key=abc") == "head"
    assert netif.scheduler_host("tcp://0.0.0.0:7555") is None
    assert netif.scheduler_host("ipc:///tmp/s.sock") is None


def test_interface_of_maps_the_source_address_to_its_interface() -> None:
    assert _interface_of("10.213.0.11") == "eth0"
    assert _interface_of("192.168.5.2") == "eth1"
    assert _interface_of("127.0.0.1") == "lo"
    assert _interface_of("fe80::1") == "eth1"
    assert _interface_of("10.9.9.9") is None


def test_route_to_loopback_on_this_machine() -> None:
    r = netif.route_to("127.0.0.1")
    assert r.address == "127.0.0.1"
    assert r.ifname == socket.if_indextoname(1) or r.ifname == "lo"


def test_socket_ifname_env_uses_the_route_to_the_scheduler() -> None:
    seen: list[str] = []

    def route(host: str) -> netif.Route:
        seen.append(host)
        return netif.Route("10.213.0.11", _interface_of("10.213.0.11"))

    env = netif.socket_ifname_env("tcp://10.213.0.1:7555", {}, route)
    assert env == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert seen == ["10.213.0.1"]


def test_socket_ifname_env_keeps_what_the_user_set() -> None:
    def route(host: str) -> netif.Route:
        return netif.Route("10.213.0.11", "eth0")

    assert netif.socket_ifname_env("tcp://h:1", {"NCCL_SOCKET_IFNAME": "ib0"}, route) == {
        "GLOO_SOCKET_IFNAME": "eth0"}
    both = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    assert netif.socket_ifname_env("tcp://h:1", both, route) == {}


def test_socket_ifname_env_leaves_ipc_and_unknown_routes_alone() -> None:
    def no_route(host: str) -> netif.Route:
        raise OSError("Network is unreachable")

    assert netif.socket_ifname_env("ipc:///tmp/x", {}) == {}
    assert netif.socket_ifname_env("tcp://10.1.1.1:1", {}, no_route) == {}
    assert netif.socket_ifname_env("tcp://h:1", {}, lambda h: netif.Route("1.2.3.4", None)) == {}


def test_socket_ifname_env_real_loopback() -> None:
    assert netif.socket_ifname_env("tcp://127.0.0.1:7555", {}) == {
        "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


# ---------------------------------------------------------------- address file

def test_address_file_roundtrip_and_atomic(tmp_path: Path) -> None:
    f = tmp_path / "shared" / "head.json"
    assert address_file.read(f) is None
    address_file.write(f, "tcp://10.0.0.1:7555")
    data = address_file.read(f)
    assert data is not None and data["address"] == "tcp://10.0.0.1:7555"
    assert "public_key" in data and "token" not in data
    assert [x.name for x in f.parent.iterdir()] == ["head.json"]
    address_file.remove_if_ours(f)
    assert not f.exists()


def test_address_file_wait_until_written(tmp_path: Path) -> None:
    f = tmp_path / "head.json"
    f.write_text('{"addr')  # a half-written file is not an address
    assert address_file.wait_for(f, timeout=0.3, poll=0.05) is None
    t = threading.Timer(0.3, address_file.write, (f, "tcp://h:1"))
    t.start()
    try:
        t0 = time.monotonic()
        data = address_file.wait_for(f, timeout=10, poll=0.05)
    finally:
        t.join()
    assert data is not None and data["address"] == "tcp://h:1"
    assert time.monotonic() - t0 < 5


def test_remove_if_ours_keeps_a_newer_heads_file(tmp_path: Path) -> None:
    f = tmp_path / "head.json"
    f.write_text('{"address": "tcp://other:1", "pid": 1}')
    address_file.remove_if_ours(f)
    assert f.exists()


# ---------------------------------------------------------------- joining

def test_refusal_reasons() -> None:
    assert refusal_reason(ConnectionLost("x")).startswith("unreachable")
    assert refusal_reason(AuthenticationError("bad token")).startswith("wrong token")
    assert refusal_reason(ProtocolMismatch("v3 vs v4")).startswith("version mismatch")
    assert refusal_reason(p.Welcome(False, "AuthenticationError", "no")).startswith("wrong token")


def test_join_log_backs_off_boundedly_and_logs_each_attempt(caplog: pytest.LogCaptureFixture) -> None:
    j = JoinLog("tcp://h:1")
    j.backoff.jitter = 0.0
    with caplog.at_level(logging.WARNING, "gpufn.supervisor"):
        waits = [j.failed("unreachable (no answer)") for _ in range(12)]
        j.failed("wrong token (bad)")
    assert waits[0] == 0.5 and waits == sorted(waits) and max(waits) == 30.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 13 and "attempt 13" in lines[-1] and "wrong token" in lines[-1]
    j.joined()
    assert j.attempts == 0 and j.backoff.attempts == 0


def test_join_log_refused_rehello_is_retried_after_backoff() -> None:
    j = JoinLog("tcp://h:1")
    j.backoff.jitter = 0.0
    j.refused_again("wrong token (x)", now=100.0)
    assert not j.hello_due(100.1)
    assert j.hello_due(100.6) and not j.hello_due(100.7)


def test_join_log_silence(caplog: pytest.LogCaptureFixture) -> None:
    j = JoinLog("tcp://h:1")
    with caplog.at_level(logging.WARNING, "gpufn.supervisor"):
        j.check_silence(0.0)
        j.check_silence(5.0)
        j.check_silence(7.0)
        j.check_silence(7.1)
        j.heard(8.0)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "unreachable" in msgs[0] and "answers again" in msgs[1]
