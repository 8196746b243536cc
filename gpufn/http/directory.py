"""What is deployed, as the gateway needs it: apps, current versions, and each function's
recorded interface (parameters, streaming, the OpenAI models it serves), listed from the scheduler at most
once a second per token, and a pinned version's looked up once."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

from gpufn.exceptions import GpufnError, NotFound
from gpufn.http.errors import HTTPError, from_gpufn
from gpufn.http.pool import Entry, ask
from gpufn.wire import interface as iface
from gpufn.wire import protocol as p

LIST_TTL = 1.0  # seconds a listing answers for the current versions


@dataclass(frozen=True)
class Target:
    """A deployed function to call."""

    app: str
    name: str
    version: int  # the version it was resolved at (0: unknown)
    pinned: bool  # the caller asked for this version
    interface: dict[str, Any]
    signature: inspect.Signature

    @property
    def generator(self) -> bool:
        return bool(self.interface.get("generator"))

    @property
    def chat_model(self) -> str:
        return str(self.interface.get("chat_model") or "")

    def function_id(self) -> str:
        return p.app_alias(self.app, self.name, self.version if self.pinned else None)

    def check(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        """HTTPError 400 if the arguments do not bind to the recorded signature."""
        why = iface.bind_error(self.signature, args, kwargs)
        if why is not None:
            raise HTTPError(400, "BadArguments", f"{self.app}.{self.name}"
                            f"({signature_text(self.interface)}): {why}")


def signature_text(interface: dict[str, Any]) -> str:
    """`x: int, *, scale: int=1`: the recorded parameters as Python would write them."""
    params = interface.get("params", [])
    out: list[str] = []
    star = any(x.get("kind") == "VAR_POSITIONAL" for x in params)
    for i, x in enumerate(params):
        if x.get("kind") == "KEYWORD_ONLY" and not star:
            out.append("*")
            star = True
        out.append(_param_text(x))
        if x.get("kind") == "POSITIONAL_ONLY" and (
                i + 1 == len(params) or params[i + 1].get("kind") != "POSITIONAL_ONLY"):
            out.append("/")
    return ", ".join(out)


def _param_text(param: dict[str, Any]) -> str:
    kind, name = param.get("kind"), str(param.get("name"))
    text = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(str(kind), "") + name
    if param.get("annotation"):
        text += f": {param['annotation']}"
    if param.get("has_default"):
        text += f"={param.get('default_repr', '...')}"
    return text


def _target(app: str, fn: dict[str, Any], version: int, pinned: bool) -> Target:
    interface = fn.get("interface") or {}
    if interface.get("params") is None:  # deployed before interfaces were recorded
        interface = {**interface, "params": [
            {"name": "args", "kind": "VAR_POSITIONAL"}, {"name": "kwargs", "kind": "VAR_KEYWORD"}]}
    return Target(app, str(fn.get("name") or fn.get("function")), version, pinned, interface,
                  iface.signature(interface))


class Directory:
    """One token's view of the deployed apps (cached in its pool entry)."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.cache = entry.cache

    async def apps(self, fresh: bool = False) -> list[dict[str, Any]]:
        listed = self.cache.get("apps")
        if fresh or listed is None or time.monotonic() - listed[0] > LIST_TTL:
            try:
                data = await ask(self.entry.client, lambda rid: p.AppCommand(rid, "list", {}))
            except GpufnError as e:
                raise from_gpufn(e) from None
            listed = self.cache["apps"] = (time.monotonic(), list(data["apps"]), {})
        apps: list[dict[str, Any]] = listed[1]
        return apps

    async def target(self, app: str, function: str, version: int | None = None) -> Target:
        """The function to call: the current version's (from the listing) or a pinned one."""
        if version:
            key = ("pinned", app, function, version)
            hit = self.cache.get(key)
            if hit is None:
                try:
                    data = await ask(self.entry.client,
                                     lambda rid: p.Lookup(rid, app, function, version))
                except GpufnError as e:
                    raise await self._not_found(e) from None
                hit = self.cache[key] = _target(app, data, version, True)
            return hit
        for fresh in (False, True):  # a miss may be a deploy newer than the listing
            await self.apps(fresh)
            found = self._current(app, function)
            if found is not None:
                return found
        try:  # the scheduler's own answer lists what is deployed
            await ask(self.entry.client, lambda rid: p.Lookup(rid, app, function, 0))
        except GpufnError as e:
            raise await self._not_found(e) from None
        raise HTTPError(404, "NotFound", f"no function {app}.{function} is deployed")

    def _current(self, app: str, function: str) -> Target | None:
        listed = self.cache["apps"]
        targets: dict[tuple[str, str], Target] = listed[2]
        hit = targets.get((app, function))
        if hit is not None:
            return hit
        for a in listed[1]:
            if a["name"] == app and a.get("state", "active") == "active":
                for fn in a["functions"]:
                    if fn["name"] == function:
                        hit = targets[(app, function)] = _target(app, fn, int(a["version"]), False)
                        return hit
        return None

    async def _not_found(self, e: GpufnError) -> HTTPError:
        err = from_gpufn(e)
        if isinstance(e, NotFound):
            err.extra["apps"] = {a["name"]: [f["name"] for f in a["functions"]]
                                 for a in await self.apps()}
        return err

    async def openai_models(self) -> dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]]:
        """OpenAI model id -> role (chat, completion, embedding) -> (app, function): a name
        declared by one app is its id; one declared by several apps is `app/name` for each."""
        by_name: dict[str, dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]]] = {}
        for a in await self.apps():
            if a.get("state", "active") != "active":
                continue
            for fn in a["functions"]:
                for role, name in openai_roles(fn.get("interface") or {}).items():
                    by_name.setdefault(name, {}).setdefault(a["name"], {})[role] = (a, fn)
        out = {}
        for name, apps in by_name.items():
            for app, roles in apps.items():
                out[name if len(apps) == 1 else f"{app}/{name}"] = roles
        return out

    async def openai_target(self, model: str, role: str) -> Target:
        """The function serving `model` in `role`; 404 naming the models there are."""
        models = await self.openai_models()
        hit = models.get(model, {}).get(role)
        if hit is None:
            have = sorted(m for m, roles in models.items() if role in roles)
            other = sorted(models.get(model, {}))
            why = (f"{model!r} is {_a(' and '.join(other))} model, not {_a(role)} model"
                   if other else f"no model {model!r} is deployed")
            raise HTTPError(404, "NotFound", f"{why}; {role} models: "
                            f"{', '.join(have) or f'none (declare one with @gpufn.{role}_model)'}",
                            param="model", code="model_not_found")
        a, fn = hit
        return _target(a["name"], fn, int(a["version"]), False)


def openai_roles(interface: dict[str, Any]) -> dict[str, str]:
    """The OpenAI model names a recorded function serves, by role."""
    roles = {r: str(n) for r, n in (interface.get("openai") or {}).items()
             if r in ("chat", "completion", "embedding") and n}
    if not roles and interface.get("chat_model"):  # recorded before the other roles
        roles["chat"] = str(interface["chat_model"])
    return roles


def _a(word: str) -> str:
    """`word` with its article: "an embedding", "a chat"."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"
