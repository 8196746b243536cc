"""`gpufn.deploy(app.py)`: register an app's `@gpu` functions and models under a name and
version in the scheduler, pickled by value so workers need no source; and the app
commands (list, history, rollback, stop) that `gpufn app ...` prints."""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from gpufn.api.chat import model_names, openai_interface
from gpufn.api.function import Function
from gpufn.api.model import Model
from gpufn.client.client import Client
from gpufn.client.default import served_client
from gpufn.exceptions import GpufnError, InvalidSpec
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.wire.byvalue import by_value, local_modules
from gpufn.wire.interface import describe
from gpufn.wire.spec import make_spec


class DeployError(GpufnError):
    """The app could not be deployed (its module fails to import, a model fails its
    check); `details` holds the traceback."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


@dataclass
class Deployment:
    """What `deploy` did: the app, its version (unchanged code keeps it) and functions."""

    app: str
    version: int
    unchanged: bool
    functions: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    previous: int | None = None
    checked: list[str] = field(default_factory=list)  # models whose loader ran (--check)

    def usage(self) -> str:
        if not self.functions:
            return ""
        fn = self.functions[0]["name"]
        return f'f = gpufn.lookup("{self.app}", "{fn}"); f.remote(...)'


_GPUFN_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def _is_user_frame(filename: str) -> bool:
    return not (filename.startswith("<frozen ") or filename.startswith(_GPUFN_DIR))


def user_traceback(exc: BaseException) -> str:
    """`exc`'s traceback with gpufn's own frames and the import machinery's left out: what
    the user wrote (for a SyntaxError, just the line and its caret)."""
    tb = traceback.TracebackException.from_exception(exc)
    for part in (tb, tb.__cause__, tb.__context__):
        if part is not None:
            part.stack = traceback.StackSummary.from_list(
                [f for f in part.stack if _is_user_frame(f.filename)])
    return "".join(tb.format())


def load_module(path: str | Path) -> ModuleType:
    """Import an app file as a module named after its stem; its folder is importable
    while it loads (for its local modules). A failure raises DeployError with the traceback."""
    path = Path(path).resolve()
    if not path.is_file():
        raise DeployError(f"{path} is not a file; pass the app's .py file")
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DeployError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    old = sys.modules.get(name)
    sys.modules[name] = module
    try:
        # Compiled from the file as it is now, not through the loader: its bytecode cache
        # is keyed by the source's mtime in whole seconds and its size, so an app edited
        # and deployed again within the same second (same size) ran the old code.
        code = compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except BaseException as e:
        if old is not None:
            sys.modules[name] = old
        else:
            sys.modules.pop(name, None)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise DeployError(f"{path.name} failed to import: {type(e).__name__}: {e}",
                          user_traceback(e)) from None
    finally:
        if added:
            sys.path.remove(folder)
    return module


def app_modules(module: ModuleType) -> list[ModuleType]:
    """What travels by value with an app file's code (`by_value`): the module itself and
    the local modules next to it that it imported (not installed packages), so that
    worker hosts need none of its files. `gpufn deploy` and `gpufn run` both send these."""
    source = getattr(module, "__file__", None)
    if not source:
        return [module]
    return [module, *local_modules(os.path.dirname(os.path.abspath(source)))]


def _members(module: ModuleType) -> tuple[dict[str, Function[Any, Any]], list[Model[Any]]]:
    fns = {k: v for k, v in vars(module).items() if isinstance(v, Function)}
    models: dict[str, Model[Any]] = {}
    for v in vars(module).values():
        if isinstance(v, Model):
            models[v.name] = v
    for f in fns.values():
        for m in f._models:
            models.setdefault(m.name, m)
    return fns, list(models.values())


def _git(folder: str, path: str) -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5)
        if commit.returncode != 0:
            return "", False
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=5)
        return commit.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "", False


def _code_hash(files: list[str], described: list[dict[str, Any]]) -> str:
    """The app's content hash: its source files and its functions' specs and models
    (stable across processes, unlike pickles)."""
    parts = []
    for f in sorted(set(files)):
        try:
            parts.append(Path(f).read_bytes())
        except OSError:
            parts.append(f.encode())
    spec = [(d["name"], d["spec"], [(m["name"], m["memory"], m["pin"], m["offload"], m["count"])
                                    for m in d["models"]]) for d in described]
    parts.append(json.dumps(spec, sort_keys=True).encode())
    return ser.content_hash(*parts)


def _touch_models(models: list[Model[Any]]) -> list[str]:
    """Runs on a worker for `--check`: load each model once."""
    for m in models:
        m.get()
    return [m.name for m in models]


def _check(models: list[Model[Any]]) -> list[str]:
    """Run each model's loader once on a worker; a failure raises DeployError."""
    done = []
    for m in models:
        checker: Function[[list[Model[Any]]], list[str]] = Function(_touch_models, make_spec(models=(m.name,)), (m,))
        checker.name = f"check {m.name}"
        try:
            checker.remote([m])
        except Exception as e:
            tb = getattr(e, "remote_traceback", "") or traceback.format_exc()
            raise DeployError(f"model {m.name} failed its check: {type(e).__name__}: {e}; "
                              "nothing was deployed", tb) from None
        done.append(m.name)
    return done


def deploy(module_or_path: ModuleType | str | Path, name: str | None = None, tag: str = "",
           strategy: str = "rolling", *, check: bool = False,
           client: Client | None = None) -> Deployment:
    """Deploy an app: every `@gpu` function (and its models) in the module, under `name`
    (default: the file's stem). Unchanged code keeps its version. `check=True` runs each
    model loader once on a worker before the new version takes calls."""
    if strategy not in ("rolling", "recreate"):
        raise InvalidSpec(f"strategy={strategy!r}: use 'rolling' or 'recreate'")
    module = module_or_path if isinstance(module_or_path, ModuleType) else load_module(module_or_path)
    source = getattr(module, "__file__", None) or ""
    app = name or (Path(source).stem if source else module.__name__.rsplit(".", 1)[-1])
    fns, models = _members(module)
    if not fns:
        raise DeployError(f"{source or module.__name__} has no @gpu functions to deploy")
    for role in ("chat", "completion", "embedding"):
        names = [model_names(f)[role] for f in fns.values() if role in model_names(f)]
        if len(names) != len(set(names)):
            raise DeployError(f"two functions of {source or module.__name__} declare the same "
                              f"@gpufn.{role}_model name ({sorted(names)}); give each its own")
    folder = os.path.dirname(os.path.abspath(source)) if source else os.getcwd()
    local = app_modules(module)
    client = client or served_client("gpufn.deploy()")
    described: list[dict[str, Any]] = []
    frames: list[Any] = []
    with by_value(local):
        for attr, f in fns.items():
            f.__dict__["_deployment"] = (app, attr)  # nested calls in the app keep its version
        try:
            for attr, f in sorted(fns.items()):
                code_id, code = ser.dump_code(f._fn, attr)
                descs = []
                loaders: list[Any] = []
                for m in f._models:
                    m_id, m_frames = ser.dump_code(m.loader, f"model {m.name}")
                    # count: a sharded model loads on a gang, inside its group (as
                    # Model.wire_description says for calls made without a deploy)
                    descs.append({"name": m.name, "memory": m.memory, "pin": m.pin,
                                  "offload": m.offload, "code_id": m_id, "nframes": len(m_frames),
                                  "count": m.count})
                    loaders += m_frames
                wire = f.spec.to_wire()
                fid = ser.content_hash(code_id.encode(), json.dumps(wire, sort_keys=True).encode(),
                                       json.dumps([d["name"] for d in descs]).encode())
                described.append({"name": attr, "function_id": fid, "code_id": code_id,
                                  "spec": wire, "models": descs, "ncode": len(code),
                                  "interface": {**describe(f._fn, model_names(f).get("chat", "")),
                                                "openai": openai_interface(f)}})
                frames += code + loaders
            checked = _check(models) if check else []
        finally:
            for f in fns.values():
                f.__dict__.pop("_deployment", None)
    files = [str(m.__file__) for m in local if getattr(m, "__file__", None)]
    commit, dirty = _git(folder, source) if source else ("", False)
    meta = {"code_hash": _code_hash(files, described), "tag": tag, "strategy": strategy,
            "who": f"{getpass.getuser()}@{socket.gethostname()}", "git_commit": commit,
            "git_dirty": dirty, "source": source}
    data = client.ask(lambda rid: p.Deploy(rid, app, meta, described, tuple(frames)))
    return Deployment(data["app"], data["version"], data["unchanged"], data["functions"],
                      data.get("notes", []), data.get("previous"), checked)


# --------------------------------------------------------------------------- app commands


def _command(command: str, client: Client | None = None, **args: Any) -> dict[str, Any]:
    client = client or served_client(f"the app command {command!r}")
    return client.ask(lambda rid: p.AppCommand(rid, command, args))


def list_apps(client: Client | None = None) -> list[dict[str, Any]]:
    """Deployed apps: current version, state, functions with specs and calls in the last hour."""
    return list(_command("list", client)["apps"])


def history(app: str, client: Client | None = None) -> dict[str, Any]:
    """An app's versions (time, who, tag, git commit, code hash, rollback_of)."""
    return _command("history", client, app=app)


def rollback(app: str, version: int | None = None, client: Client | None = None) -> Deployment:
    """A new version with the code of `version` (default: the one before the current)."""
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    data = _command("rollback", client, app=app, version=version or 0, who=who)
    return Deployment(data["app"], data["version"], data["unchanged"], data["functions"],
                      data.get("notes", []), data.get("previous"))


def stop(app: str, client: Client | None = None) -> dict[str, Any]:
    """Stop an app: queued calls fail with AppStopped, running ones finish, models leave."""
    return _command("stop", client, app=app)
