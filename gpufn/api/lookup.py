"""`gpufn.lookup("app", "fn")`: a deployed function, called by name without its source.

The lookup is lazy: nothing is asked until the first call, which resolves the name (an
unknown app, function or version raises `NotFound`, listing what is deployed). Each
call is submitted under the app's name, so the scheduler binds it to the version that
is current when the call is admitted, or to the pinned `version`. Inside a deployed
function, a lookup of the same app keeps the version the running call is on.
"""

from __future__ import annotations

import threading
from typing import Any

from gpufn.api.function import Function
from gpufn.client.client import Client
from gpufn.exceptions import GpufnError, InvalidSpec
from gpufn.runtime.context import current as current_context
from gpufn.wire import protocol as p
from gpufn.wire.spec import OPTION_NAMES, GpuSpec, make_spec


class DeployedFunction(Function[Any, Any]):
    """A function of a deployed app: `.remote/.spawn/.map/.starmap`, their async twins
    and `with_options`, as for any `Function`; it cannot run locally."""

    def __init__(self, app: str, function: str, version: int | None = None,
                 options: dict[str, Any] | None = None) -> None:
        if version is not None and (not isinstance(version, int) or version < 1):
            raise InvalidSpec(f"version={version!r} must be a positive integer (or None for "
                              "the current version)")
        self.app = app
        self.function = function
        self.version = version
        self.name = f"{app}.{function}"
        self._options = dict(options or {})
        self._resolved: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        pin = f" v{self.version}" if self.version else ""
        return f"<gpufn.DeployedFunction {self.app}.{self.function}{pin}>"

    def __getstate__(self) -> dict[str, Any]:
        return {"app": self.app, "function": self.function, "version": self.version,
                "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["app"], state["function"], state["version"],  # type: ignore[misc]
                      state["options"])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise GpufnError(f"{self.name} is a deployed function: its source is not here. Call "
                         f"it with .remote(...), .spawn(...) or .map(...)")

    local = __call__

    def _pinned(self) -> int:
        if self.version:
            return self.version
        ctx = current_context()  # a call of this app on a worker keeps its version
        return ctx.version if ctx is not None and ctx.app == self.app else 0

    def resolve(self, client: Client | None = None) -> dict[str, Any]:
        """Ask the scheduler what this name means (once); NotFound if nothing does."""
        with self._lock:
            if self._resolved is None:
                from gpufn.client.default import get_client

                c = client or get_client()
                version = self._pinned()
                self._resolved = c.ask(lambda rid: p.Lookup(rid, self.app, self.function, version))
            return self._resolved

    @property
    def _yields(self) -> bool:  # type: ignore[override]
        """A generator function streams (`.remote_gen`): its deployment recorded it."""
        return bool(self.resolve().get("interface", {}).get("generator"))

    @property
    def spec(self) -> GpuSpec:  # type: ignore[override]
        spec = GpuSpec.from_wire(self.resolve()["spec"])
        return make_spec(spec, **self._options) if self._options else spec

    def with_options(self, **options: Any) -> DeployedFunction:
        unknown = set(options) - set(OPTION_NAMES)
        if "models" in options or unknown:
            raise InvalidSpec(f"option(s) {sorted(unknown | ({'models'} & set(options)))} cannot "
                              f"be changed on a deployed function; known options: "
                              f"{', '.join(o for o in OPTION_NAMES if o != 'models')}")
        make_spec(GpuSpec(), **options)  # a bad value fails here, not on the scheduler
        new = DeployedFunction(self.app, self.function, self.version,
                               {**self._options, **options})
        new._resolved = self._resolved
        return new

    def register_message(self) -> p.Register:
        raise GpufnError(f"{self.name} is deployed: it is called by name, not registered")

    def _prepare(self, client: Client) -> tuple[p.Register | None, str, dict[str, Any]]:
        self.resolve(client)
        return None, p.app_alias(self.app, self.function, self._pinned() or None), self._options


def lookup(app: str, function: str, *, version: int | None = None) -> DeployedFunction:
    """A deployed function by app and name; `version=N` pins a version (and the calls it
    makes to functions of the same app). Resolved on the first call, not here."""
    if not isinstance(app, str) or not app or not isinstance(function, str) or not function:
        raise InvalidSpec(f"lookup({app!r}, {function!r}): app and function are non-empty names")
    return DeployedFunction(app, function, version)
