"""gpufn's own typed failures; every message says what went wrong and how to fix it.

The scheduler and workers send a failure as (kind, message); `from_wire` rebuilds the
same class in the caller, so `except gpufn.Timeout:` works across processes.
"""

from __future__ import annotations


class GpufnError(Exception):
    """Base class of every error gpufn raises itself."""


class InvalidSpec(GpufnError, ValueError):
    """A `@gpu(...)`, `@model(...)` or `with_options(...)` value is wrong."""


class Unschedulable(GpufnError):
    """No registered device can ever satisfy the request."""


class SerializationError(GpufnError, TypeError):
    """An argument, result or function could not be pickled or unpickled."""


class NotJSONSerializable(SerializationError):
    """A call made with JSON arguments (over HTTP) returned or yielded a value that JSON
    cannot hold; the message names its type."""


class Timeout(GpufnError, TimeoutError):
    """A call ran past its `timeout`, missed its `deadline`, or `get(timeout=)` expired."""


class WorkerLost(GpufnError):
    """The worker process running the call died or stopped answering."""


class QueueFull(GpufnError):
    """A queue limit was reached; the call was not accepted."""


class PayloadTooLarge(GpufnError):
    """An argument or result payload is larger than GPUFN_MAX_PAYLOAD allows."""


class OutOfMemory(GpufnError, MemoryError):
    """The call (or a model load) ran out of device memory."""


class HostOutOfMemory(OutOfMemory):
    """The call's worker went over its host-memory (RAM) limit and was stopped; the
    message names the limit and how to raise it."""


class Cancelled(GpufnError):
    """The call was cancelled before it produced a result."""


class AuthenticationError(GpufnError):
    """The token sent to the scheduler is missing or wrong."""


class ProtocolMismatch(GpufnError):
    """Client, scheduler and workers run incompatible gpufn versions."""


class ConnectionLost(GpufnError):
    """The scheduler stopped answering."""


class ModelLoadError(GpufnError):
    """A `@gpufn.model` loader raised; its traceback is attached."""


class NotFound(GpufnError, LookupError):
    """No deployed app, function or version by that name; the message lists what is deployed."""


class AppStopped(GpufnError):
    """The app was stopped (or replaced with `--strategy recreate`) before the call ran."""


class PermissionDenied(GpufnError):
    """The caller's token does not allow this (an operation for the admin or an operator)."""


class RemoteError(GpufnError):
    """A remote exception whose type cannot be rebuilt in this process."""

    def __init__(self, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback = traceback

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return (RemoteError, (self.type_name, self.message, self.traceback))


class RemoteTraceback(Exception):
    """Carries the remote traceback text; set as `__cause__` of a re-raised remote error."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n" + self.tb


_BY_NAME: dict[str, type[GpufnError]] = {
    cls.__name__: cls
    for cls in (
        GpufnError, InvalidSpec, Unschedulable, SerializationError, NotJSONSerializable,
        Timeout, WorkerLost,
        QueueFull, PayloadTooLarge, OutOfMemory, HostOutOfMemory, Cancelled, AuthenticationError, ProtocolMismatch,
        ConnectionLost, ModelLoadError, NotFound, AppStopped, PermissionDenied,
    )
}


def kind_of(exc: type[GpufnError] | GpufnError) -> str:
    """The wire name of a gpufn error class."""
    cls = exc if isinstance(exc, type) else type(exc)
    return cls.__name__


def from_wire(kind: str, message: str) -> GpufnError:
    """Rebuild a gpufn error sent as (kind, message)."""
    return _BY_NAME.get(kind, GpufnError)(message)
