"""Which imported modules count as the program's own (pickled by value), and that the
installed-package list (slow to read) is read only when a module under the folder needs it."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from gpufn.wire import byvalue


def _module(monkeypatch: pytest.MonkeyPatch, name: str, file: Path) -> types.ModuleType:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("X = 1\n")
    mod = types.ModuleType(name)
    mod.__file__ = str(file)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_a_folder_without_modules_of_its_own_never_reads_the_installed_list(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unread() -> frozenset[str]:
        raise AssertionError("the installed-package list was read")

    monkeypatch.setattr(byvalue, "_installed_names", unread)
    assert byvalue.local_modules(str(tmp_path)) == []


def test_local_modules_are_found_and_installed_or_gpufn_ones_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _module(monkeypatch, "gpufn_probe_helpers", tmp_path / "gpufn_probe_helpers.py")
    sub = _module(monkeypatch, "gpufn_probe_pkg.sub", tmp_path / "gpufn_probe_pkg" / "sub.py")
    _module(monkeypatch, "gpufn_probe_editable", tmp_path / "gpufn_probe_editable.py")
    _module(monkeypatch, "gpufn.probe_inside", tmp_path / "probe_inside.py")
    _module(monkeypatch, "gpufn_probe_elsewhere", tmp_path.parent / "gpufn_probe_elsewhere.py")
    reads: list[int] = []

    def installed() -> frozenset[str]:
        reads.append(1)
        return frozenset({"gpufn_probe_editable"})

    monkeypatch.setattr(byvalue, "_installed_names", installed)
    found = byvalue.local_modules(str(tmp_path))
    assert found == [mine, sub] and reads == [1]


def test_the_installed_list_names_top_level_packages_and_gpufn() -> None:
    names = byvalue._installed_names()
    assert {"gpufn", "zmq", "msgpack", "torch"} <= names
    assert os.path.realpath(sys.prefix) in byvalue._install_roots()
