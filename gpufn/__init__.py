"""gpufn: self-hosted serverless GPU functions.

    @gpufn.gpu(memory="2GiB")
    def square(x): return x * x

    square.remote(7); list(square.map(range(10))); square.spawn(3).get()

Every public name is loaded on first use (the `_PUBLIC` table below), so the scheduler and
the workers, which import `gpufn.wire` and friends, never load the SDK or the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufn import parallel as parallel
    from gpufn.api.calls import CallStream, FunctionCall, gather
    from gpufn.api.chat import chat_model, completion_model, embedding_model
    from gpufn.api.deployment import DeployError, Deployment, deploy
    from gpufn.api.function import Function, gpu
    from gpufn.api.lookup import DeployedFunction, lookup
    from gpufn.api.model import Model, model
    from gpufn.client.client import Client
    from gpufn.client.default import connect
    from gpufn.exceptions import (
        AppStopped,
        AuthenticationError,
        Cancelled,
        ConnectionLost,
        GpufnError,
        HostOutOfMemory,
        InvalidSpec,
        ModelLoadError,
        NotFound,
        NotJSONSerializable,
        OutOfMemory,
        PayloadTooLarge,
        PermissionDenied,
        ProtocolMismatch,
        QueueFull,
        RemoteError,
        SerializationError,
        Timeout,
        Unschedulable,
        WorkerLost,
    )
    from gpufn.runtime.context import CallContext, context, current_device
    from gpufn.wire.spec import GpuSpec, Retries

__version__ = "0.1.0"

_EXCEPTIONS = (
    "AppStopped", "AuthenticationError", "Cancelled", "ConnectionLost", "GpufnError",
    "HostOutOfMemory", "InvalidSpec", "ModelLoadError", "NotFound", "NotJSONSerializable", "OutOfMemory",
    "PayloadTooLarge", "PermissionDenied", "ProtocolMismatch", "QueueFull", "RemoteError",
    "SerializationError", "Timeout", "Unschedulable", "WorkerLost",
)

# public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    **dict.fromkeys(_EXCEPTIONS, "gpufn.exceptions"),
    "gpu": "gpufn.api.function", "Function": "gpufn.api.function",
    "FunctionCall": "gpufn.api.calls", "CallStream": "gpufn.api.calls", "gather": "gpufn.api.calls",
    "model": "gpufn.api.model", "Model": "gpufn.api.model", "chat_model": "gpufn.api.chat",
    "completion_model": "gpufn.api.chat", "embedding_model": "gpufn.api.chat",
    "lookup": "gpufn.api.lookup", "DeployedFunction": "gpufn.api.lookup",
    "deploy": "gpufn.api.deployment", "Deployment": "gpufn.api.deployment",
    "DeployError": "gpufn.api.deployment",
    "Client": "gpufn.client.client", "connect": "gpufn.client.default",
    "context": "gpufn.runtime.context", "current_device": "gpufn.runtime.context",
    "CallContext": "gpufn.runtime.context",
    "GpuSpec": "gpufn.wire.spec", "Retries": "gpufn.wire.spec",
}

__all__ = [  # the same names as _PUBLIC (a test holds it)
    "AppStopped", "AuthenticationError", "CallContext", "CallStream", "Cancelled", "Client",
    "ConnectionLost", "DeployError", "DeployedFunction", "Deployment", "Function",
    "FunctionCall", "GpuSpec", "GpufnError", "HostOutOfMemory", "InvalidSpec", "Model", "ModelLoadError",
    "NotFound", "NotJSONSerializable", "OutOfMemory", "PayloadTooLarge", "PermissionDenied",
    "ProtocolMismatch", "QueueFull", "RemoteError", "Retries", "SerializationError", "Timeout",
    "Unschedulable", "WorkerLost", "chat_model", "completion_model", "connect", "context",
    "current_device", "deploy", "embedding_model", "gather", "gpu", "lookup", "model",
]

if not TYPE_CHECKING:  # hidden from type checkers, which would type every unknown name as Any

    def __getattr__(name: str) -> Any:
        """A public name, or `gpufn.parallel` (it imports torch), loaded on first use."""
        if name == "parallel":
            return importlib.import_module("gpufn.parallel")
        where = _PUBLIC.get(name)
        if where is None:
            raise AttributeError(f"module 'gpufn' has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        globals()[name] = value  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted([*globals(), *_PUBLIC, "parallel"])
