"""One peer's connection to the scheduler: socket setup, handshake, re-hello, backoff, wake pipe."""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from gpufn.exceptions import (
    AuthenticationError,
    ConnectionLost,
    GpufnError,
    InvalidSpec,
    from_wire,
    kind_of,
)
from gpufn.net import curve as security
from gpufn.net import sockets
from gpufn.wire import config
from gpufn.wire import protocol as p
from gpufn.wire.versions import runtime_info

log = logging.getLogger("gpufn.net.connection")

_FORGOTTEN = kind_of(AuthenticationError)

_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
# After a restart every message queued while the scheduler was away is refused, each
# with its own Error: one Hello answers them all, and another only if no Welcome came.
HELLO_AGAIN_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """What a peer needs to reach a scheduler: where, and how to prove it may.

    Every peer builds its sockets from one of these, so credentials (the token, and the
    scheduler's CURVE public key from `tcp://host:port?key=...`) enter in one place.
    """

    address: str
    token: str = ""
    # What to check when nothing answers: says where the address came from (discovery).
    unreachable: str = ""

    @property
    def endpoint(self) -> str:
        """The address ZeroMQ connects to (without ?key=)."""
        return config.split_address(self.address)[0]

    def server_key(self) -> str | None:
        """The scheduler's public key: from the address, else from the cluster file that
        `gpufn serve` on this machine left for this endpoint; None means plaintext."""
        endpoint, key = config.split_address(self.address)
        if key is None and endpoint.startswith("tcp://"):
            from gpufn.net.cluster_file import saved_server_key

            key = saved_server_key(endpoint)
        return key


@dataclass(slots=True)
class Backoff:
    """Bounded exponential backoff: `initial * factor**attempt`, at most `maximum`,
    optionally spread by +-`jitter` (a fraction) so many peers do not retry in step."""

    initial: float = 0.1
    maximum: float = 10.0
    factor: float = 2.0
    jitter: float = 0.0
    attempts: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    def delay(self, attempt: int) -> float:
        """The wait before retry number `attempt` (0-based), without counting it."""
        base = min(self.maximum, self.initial * self.factor ** max(0, min(attempt, 64)))
        if self.jitter:
            base *= 1 + self.jitter * (2 * self._rng.random() - 1)
        return min(self.maximum, base)

    def next(self) -> float:
        """The wait before the next attempt; counts the attempt."""
        d = self.delay(self.attempts)
        self.attempts += 1
        return d

    def reset(self) -> None:
        """A connection succeeded: the next failure starts from `initial` again."""
        self.attempts = 0


class Connection:
    """A DEALER socket to the scheduler that introduces itself as `role` with `info`.

    The owner thread sends and receives on `sock` directly (no wrapper on the hot path);
    this class does what every peer does the same way: connect, Hello/Welcome, and Hello
    again when the scheduler says it forgot us (it restarted, or we were silent too long).
    """

    def __init__(self, ctx: zmq.Context[Any], config: ConnectionConfig, identity: str,
                 role: str, info: p.HelloInfo | None = None) -> None:
        self.config = config
        self.address = config.address
        self.role = role
        self.info = info or p.HelloInfo()
        self.welcome: p.Welcome | None = None
        self.backoff = Backoff()
        self._hello_sent: float | None = None  # a Hello not answered yet (see `wants_hello`)
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        sockets.configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.server_key = self._secure(self.sock)
        # Over TCP, watch the security handshake until the Welcome, so a refused key or a
        # plaintext/CURVE mismatch is reported at once instead of as a silent timeout.
        self._monitor: zmq.Socket[Any] | None = None
        endpoint = config.endpoint
        if endpoint.startswith("tcp://"):
            self._monitor = self.sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError as e:  # e.g. a host name ZeroMQ cannot parse
            self._stop_monitor()
            self.sock.close(0)
            raise InvalidSpec(f"address {endpoint!r} cannot be connected to ({e.strerror}): "
                              "write it as tcp://HOST:PORT, as `gpufn serve` printed it") from None

    def _secure(self, sock: zmq.Socket[Any]) -> str | None:
        """Security options, applied before connect; every peer's socket comes through here.

        With the scheduler's public key this is a CURVE client: the traffic is encrypted and
        only the holder of the matching secret key can answer. Our own key pair is
        GPUFN_CLIENT_KEY's (for a scheduler with an allow-list) or made for this process.
        The token still goes in Hello, inside the encrypted channel. Returns the server key.
        """
        key = self.config.server_key()
        if key is not None:
            mine = security.client_keys()
            sock.curve_serverkey = key.encode()
            sock.curve_publickey = mine.public
            sock.curve_secretkey = mine.secret
        return key

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None

    def _handshake_event(self, failures: int) -> int:
        """Read one security-handshake event; raise if it says we will never get in.
        Returns the count of failed handshakes so far."""
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        ev = recv_monitor_message(self._monitor)
        event, value = ev["event"], ev["value"]
        where = self.config.endpoint
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise AuthenticationError(
                f"the scheduler at {where} refused this {self.role}'s CURVE key (ZAP status "
                f"{value}): it admits only the public keys in its --allow-keys folder; add "
                "this host's .key file there and point GPUFN_CLIENT_KEY at its secret key")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
            if self.server_key is None:
                raise AuthenticationError(
                    f"the scheduler at {where} requires encryption (CURVE): connect with "
                    "the address `gpufn serve` printed, tcp://HOST:PORT?key=<its public key>")
            raise AuthenticationError(
                f"the scheduler at {where} does not use CURVE encryption; drop ?key= from "
                "the address (or start it with the keys this address names)")
        if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            # The scheduler hung up mid-handshake (a mechanism mismatch is often seen only
            # as that); twice in a row is not a restart but a refusal.
            failures += 1
            if failures >= 2 and self.server_key is not None:
                raise AuthenticationError(
                    f"the scheduler at {where} closed the connection during the CURVE "
                    "handshake: the ?key= in the address is not its public key (take the "
                    "address `gpufn serve` printed)")
            if failures >= 2:  # the same class as a mismatch seen as such (it races)
                raise AuthenticationError(
                    f"the scheduler at {where} closed the connection during the handshake: "
                    "it probably requires encryption (CURVE); connect with the address "
                    "`gpufn serve` printed, tcp://HOST:PORT?key=<its public key>")
        return failures

    # ------------------------------------------------------------------ handshake

    def hello_message(self) -> p.Hello:
        versions = runtime_info()  # the client checks the workers'
        self.info.python = self.info.python or versions["python"]
        self.info.cloudpickle = self.info.cloudpickle or versions["cloudpickle"]
        return p.Hello(self.role, p.PROTOCOL_VERSION, self.config.token, os.getpid(), self.info)

    def hello_frames(self) -> list[Any]:
        """An encoded Hello, for owners that send through a queue of their own."""
        return p.encode(self.hello_message())

    def hello(self) -> None:
        self.sock.send_multipart(self.hello_frames())
        self._hello_sent = time.monotonic()

    def welcomed(self) -> None:
        """A Welcome (or a refusal) answered our Hello: the next Error may ask for another."""
        self._hello_sent = None

    def handshake(self, timeout: float) -> list[p.Message]:
        """Send Hello and wait for the Welcome; return the messages batched after it
        (work may follow a Welcome at once). A refusal raises its gpufn error
        (`AuthenticationError`, `ProtocolMismatch`, ...); no answer raises `ConnectionLost`.

        Messages before the Welcome are answers to what was sent before this Hello
        (e.g. the refusals that made us say Hello again) and are dropped.
        """
        try:
            return self._handshake(timeout)
        finally:
            self._stop_monitor()

    def _handshake(self, timeout: float) -> list[p.Message]:
        self.hello()
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        failures = 0
        while True:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
            if self._monitor is not None and ready.get(self._monitor):
                failures = self._handshake_event(failures)
                if not ready.get(self.sock):
                    continue
            if not ready.get(self.sock):
                raise ConnectionLost(
                    f"no answer from a gpufn scheduler at {self.address} within {timeout:.0f}s. "
                    + (self.config.unreachable or "Is `gpufn serve` running there, and is this the "
                       "address it printed (--address or GPUFN_ADDRESS)?"))
            try:
                msgs = p.decode_all(self.sock.recv_multipart(copy=False))
            except p.DecodeError as e:
                log.warning("undecodable message from the scheduler: %s", e)
                continue
            for i, msg in enumerate(msgs):
                if isinstance(msg, p.Welcome):
                    self._hello_sent = None
                    if not msg.ok:
                        raise from_wire(msg.error_kind, msg.message)
                    self.welcome = msg
                    self.backoff.reset()
                    return msgs[i + 1:]

    # ------------------------------------------------------------------ re-hello

    @staticmethod
    def needs_rehello(msg: p.Message) -> bool:
        """Whether `msg` says the scheduler does not know this connection (any more)."""
        return isinstance(msg, p.Error) and msg.error_kind == _FORGOTTEN

    def wants_hello(self, msg: p.Message) -> bool:
        """Whether `msg` says we were forgotten and no Hello of ours is on its way (the
        refusals of what was queued while the scheduler was away all come at once)."""
        if not self.needs_rehello(msg):
            return False
        sent = self._hello_sent
        return sent is None or time.monotonic() - sent > HELLO_AGAIN_SECONDS

    def on_error(self, msg: p.Message) -> bool:
        """Say Hello again if `msg` says we were forgotten (once for a burst of such
        refusals); True if so, so the caller can send its state again (the scheduler
        dropped it with the connection)."""
        if not self.wants_hello(msg):
            return False
        self.hello()
        return True

    def handshake_or_exit(self, timeout: float, who: str) -> list[p.Message]:
        """`handshake` for processes that cannot go on without the scheduler (workers,
        supervisors): a failure becomes SystemExit with the reason."""
        try:
            return self.handshake(timeout)
        except ConnectionLost as e:
            raise SystemExit(str(e)) from None
        except GpufnError as e:
            raise SystemExit(f"scheduler refused this {who}: {e}") from None

    def close(self, linger_ms: int = 0) -> None:
        self._stop_monitor()
        self.sock.close(linger_ms)


class WakePipe:
    """Wakes a thread blocked in a poller from other threads (a non-blocking pipe).

    `wake()` writes at most one byte until the owner calls `drain()`: one pending wake-up
    is enough, since the owner handles everything queued when it wakes (a write per event
    costs a context switch each on a busy machine). The owner must `drain()` before it
    looks at what was queued, so a wake-up after the drain is never lost.
    """

    __slots__ = ("_pending", "_r", "_w")

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._pending = False

    def fileno(self) -> int:
        """The read end, for `zmq.Poller.register` or `select`."""
        return self._r

    def wake(self) -> None:
        if self._pending:
            return
        self._pending = True
        try:
            os.write(self._w, b"x")
        except OSError:  # full: the owner is awake already
            pass

    def drain(self) -> None:
        try:
            os.read(self._r, 65536)
        except (BlockingIOError, InterruptedError):
            pass
        # Read, then clear: a wake() after the read sets the flag again and writes a byte
        # the next poll sees.
        self._pending = False

    def close(self) -> None:
        """Only once no thread can call `wake()` any more (the fd numbers get reused)."""
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
