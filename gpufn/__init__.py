"""gpufn: self-hosted serverless GPU functions.

    @gpufn.gpu(memory="2GiB")
    def square(x): return x * x

    square.remote(7); list(square.map(range(10))); square.spawn(3).get()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpufn.call_context import CallContext, context, current_device
from gpufn.call_forms import gather
from gpufn.client import Client, connect
from gpufn.deployment import DeployError, Deployment, deploy
from gpufn.exceptions import (
    AppStopped,
    AuthenticationError,
    Cancelled,
    ConnectionLost,
    GpufnError,
    InvalidSpec,
    ModelLoadError,
    NotFound,
    OutOfMemory,
    PayloadTooLarge,
    ProtocolMismatch,
    QueueFull,
    RemoteError,
    SerializationError,
    Timeout,
    Unschedulable,
    WorkerLost,
)
from gpufn.function import Function, FunctionCall, gpu
from gpufn.lookup import DeployedFunction, lookup
from gpufn.model import Model, model
from gpufn.spec import GpuSpec, Retries
from gpufn.streams import CallStream

if TYPE_CHECKING:
    from gpufn import parallel as parallel

__version__ = "0.1.0"

__all__ = [
    "AppStopped", "AuthenticationError", "CallContext", "CallStream", "Cancelled", "Client",
    "ConnectionLost", "DeployError", "DeployedFunction", "Deployment", "Function", "FunctionCall",
    "GpuSpec", "GpufnError", "InvalidSpec", "Model", "ModelLoadError", "NotFound", "OutOfMemory",
    "PayloadTooLarge", "ProtocolMismatch", "QueueFull", "RemoteError", "Retries",
    "SerializationError", "Timeout", "Unschedulable", "WorkerLost", "connect", "context",
    "current_device", "deploy", "gather", "gpu", "lookup", "model",
]

if not TYPE_CHECKING:  # hidden from type checkers, which would type every unknown name as Any

    def __getattr__(name: str) -> Any:
        """`gpufn.parallel` on first use: it imports torch, which `import gpufn` does not."""
        if name == "parallel":
            import importlib

            return importlib.import_module("gpufn.parallel")
        raise AttributeError(f"module 'gpufn' has no attribute {name!r}")
