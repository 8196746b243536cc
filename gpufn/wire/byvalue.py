"""Which modules travel by value inside pickled code: a program's own local modules.

Workers need not have the source of an app or a notebook's helper modules: modules
whose files sit under the program's folder (and are not installed packages) are
registered with `cloudpickle.register_pickle_by_value`, so their code goes along.
"""

from __future__ import annotations

import contextlib
import functools
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Iterable, Iterator
from types import ModuleType

import cloudpickle

_lock = threading.Lock()
_main_seen: tuple[int, str] = (-1, "")
_generation = 0  # bumped whenever the set of modules pickled by value changes


def generation() -> int:
    """Changes whenever a module starts or stops being pickled by value (the same code
    then pickles differently)."""
    return _generation


@functools.lru_cache(maxsize=1)
def _install_roots() -> tuple[str, ...]:
    """Folders of the interpreter and its packages."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(),
            site.getusersitepackages(), *sysconfig.get_paths().values()}
    return tuple(sorted({os.path.realpath(d) for d in dirs if d}))


@functools.lru_cache(maxsize=1)
def _installed_names() -> frozenset[str]:
    """Installed top-level names (an editable install of a package under the program's
    folder is still installed). Reads every distribution's metadata: ~0.2 s with a few
    hundred installed, so asked only when a module under the folder needs it."""
    from importlib.metadata import packages_distributions

    try:
        names = frozenset(packages_distributions())
    except Exception:
        names = frozenset()
    return names | {"gpufn"}


def local_modules(root: str) -> list[ModuleType]:
    """Imported modules whose files lie under `root`, other than installed packages."""
    root = os.path.realpath(root)
    roots = _install_roots()
    found: list[tuple[str, ModuleType]] = []
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not path or name == "__main__" or name.split(".")[0] == "gpufn":
            continue
        path = os.path.realpath(path)
        if not path.startswith(root + os.sep):
            continue
        if any(path.startswith(r + os.sep) for r in roots if not root.startswith(r + os.sep)):
            continue
        found.append((name, mod))
    if not found:
        return []
    installed = _installed_names()
    return [mod for name, mod in found if name.split(".")[0] not in installed]


def _register(modules: Iterable[ModuleType]) -> list[ModuleType]:
    global _generation
    added = []
    for mod in modules:
        if mod.__name__ not in cloudpickle.list_registry_pickle_by_value():
            try:
                cloudpickle.register_pickle_by_value(mod)
            except ValueError:  # not in sys.modules under its name
                continue
            added.append(mod)
    if added:
        _generation += 1
    return added


@contextlib.contextmanager
def by_value(modules: Iterable[ModuleType]) -> Iterator[None]:
    """Pickle these modules' functions and classes by value within the block."""
    global _generation
    with _lock:
        added = _register(modules)
    try:
        yield
    finally:
        with _lock:
            for mod in added:
                cloudpickle.unregister_pickle_by_value(mod)
            _generation += 1


_folder_of: tuple[str, str] = ("", "")  # (__main__.__file__, its folder)


def main_folder() -> str:
    """The folder of `__main__`: the script's, or the working directory of a notebook
    or an interactive session."""
    global _folder_of
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and "ipykernel" not in sys.modules:
        if _folder_of[0] != path:  # abspath reads the working directory: once per script
            _folder_of = (path, os.path.dirname(os.path.abspath(path)))
        return _folder_of[1]
    return os.getcwd()


def register_main_locals() -> None:
    """Code defined in `__main__` (a script or notebook cell) takes the local modules it
    may use along by value; checked again only when new modules were imported."""
    global _main_seen
    folder = main_folder()
    key = (len(sys.modules), folder)
    if key == _main_seen:
        return
    with _lock:
        _register(local_modules(folder))
        _main_seen = key
