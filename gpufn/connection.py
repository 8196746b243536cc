"""One peer's connection to the scheduler: socket setup, handshake, re-hello, backoff, wake pipe."""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from gpufn import _sockets
from gpufn import protocol as p
from gpufn.exceptions import AuthenticationError, ConnectionLost, GpufnError, from_wire, kind_of
from gpufn.runtime import runtime_info

log = logging.getLogger("gpufn.connection")

_FORGOTTEN = kind_of(AuthenticationError)


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """What a peer needs to reach a scheduler: where, and how to prove it may.

    Every peer builds its sockets from one of these, so credentials (today the token;
    a server key once traffic is encrypted) enter in one place.
    """

    address: str
    token: str = ""


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
                 role: str, info: dict[str, Any] | None = None) -> None:
        self.config = config
        self.address = config.address
        self.role = role
        self.info = info or {}
        self.welcome: p.Welcome | None = None
        self.backoff = Backoff()
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        _sockets.configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self._secure(self.sock)
        self.sock.connect(config.address)

    def _secure(self, sock: zmq.Socket[Any]) -> None:
        """Socket security options, applied before connect (the place for CURVE keys from
        `self.config`); plaintext with the token in Hello today."""

    # ------------------------------------------------------------------ handshake

    def hello_message(self) -> p.Hello:
        info = {**runtime_info(), **self.info}  # versions: the client checks the workers'
        return p.Hello(self.role, p.PROTOCOL_VERSION, self.config.token, os.getpid(), info)

    def hello_frames(self) -> list[Any]:
        """An encoded Hello, for owners that send through a queue of their own."""
        return p.encode(self.hello_message())

    def hello(self) -> None:
        self.sock.send_multipart(self.hello_frames())

    def handshake(self, timeout: float) -> list[p.Message]:
        """Send Hello and wait for the Welcome; return the messages batched after it
        (work may follow a Welcome at once). A refusal raises its gpufn error
        (`AuthenticationError`, `ProtocolMismatch`, ...); no answer raises `ConnectionLost`.

        Messages before the Welcome are answers to what was sent before this Hello
        (e.g. the refusals that made us say Hello again) and are dropped.
        """
        self.hello()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                raise ConnectionLost(
                    f"no answer from a gpufn scheduler at {self.address} within {timeout:.0f}s. "
                    "Is `gpufn serve` running there? Check GPUFN_ADDRESS, or unset it to use the "
                    "embedded local cluster.")
            try:
                msgs = p.decode_all(self.sock.recv_multipart(copy=False))
            except p.DecodeError as e:
                log.warning("undecodable message from the scheduler: %s", e)
                continue
            for i, msg in enumerate(msgs):
                if isinstance(msg, p.Welcome):
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

    def on_error(self, msg: p.Message) -> bool:
        """Say Hello again if `msg` says we were forgotten; True if so, so the caller can
        send its state again (the scheduler dropped it with the connection)."""
        if not self.needs_rehello(msg):
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
