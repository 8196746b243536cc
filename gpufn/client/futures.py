"""A call's future: a `concurrent.futures.Future` whose Condition is made only when a
thread has to wait on it (most of a `.map`'s calls are read only once done).

Making the Condition (an RLock and its bound methods) was a sixth of a leased `.map`'s
per-call time in the calling thread. Until some thread needs the Condition (a blocking
`result()`, `concurrent.futures.wait`, `as_completed`, `cancel`), the future's state
changes under one lock shared by every CallFuture; from the moment it is made, every
change goes through it, as in the base class. So a waiter either finds the state already
final or is notified under its Condition, and a callback added before the end runs once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import (  # the base class's own state names
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    LOGGER,
    PENDING,
)
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
_STATE = threading.Lock()  # state changes of every CallFuture with no Condition yet


class CallFuture(Future[T]):
    def __init__(self) -> None:  # the base's fields, but no Condition yet
        self._cond: threading.Condition | None = None
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Callable[[Future[T]], object]] = []

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond = self._cond
        if cond is None:
            with _STATE:
                if self._cond is None:
                    self._cond = threading.Condition()
                cond = self._cond
        return cond

    def _end(self, result: Any, exc: BaseException | None) -> bool:
        """The lock-free-of-Condition path of set_result/set_exception: False when the
        Condition exists (the caller takes the base class's path)."""
        with _STATE:
            if self._cond is not None:
                return False
            ended = self._state in _DONE
            if not ended:
                self._result, self._exception = result, exc
                self._state = FINISHED  # after the value: who sees it sees the value
        if ended:  # (outside the lock: repr takes the Condition, made under it)
            raise InvalidStateError(f"{self._state}: {self!r}")
        for callback in self._done_callbacks:
            try:
                callback(self)
            except Exception:
                LOGGER.exception("exception calling callback for %r", self)
        return True

    def set_result(self, result: T) -> None:
        if not self._end(result, None):
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._end(None, exception):
            super().set_exception(exception)

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        with _STATE:
            if self._cond is None:
                if self._state not in _DONE:
                    self._done_callbacks.append(fn)
                    return
                ran_now = True
            else:
                ran_now = False
        if not ran_now:
            super().add_done_callback(fn)
            return
        try:
            fn(self)
        except Exception:
            LOGGER.exception("exception calling callback for %r", self)

    def done(self) -> bool:
        return self._state in _DONE  # final once set, and set after the value

    def result(self, timeout: float | None = None) -> T:
        if self._state == FINISHED:  # no wait: no Condition needed
            exc = self._exception
            if exc is None:
                return self._result
            try:
                raise exc
            finally:
                exc = None  # (as the base class: no cycle through the traceback)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == FINISHED:
            return self._exception
        return super().exception(timeout)
