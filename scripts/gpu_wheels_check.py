"""Check that a folder of wheels, with what the GPU image already has, is a complete set.

Every `Requires-Dist` of every wheel (markers evaluated for CPython on x86-64 Linux at the
given Python version, no extras) must be met by another wheel in the folder or by a
distribution the image holds (`scripts/gpu_image.txt`, checked against its version where
the list gives one). Each name may come once, and torch and numpy are never carried. With
`--source`, every Python file of the checkout's packages must be in gpufn's wheel. Prints
one line per wheel and exits non-zero on any gap.

    python3 scripts/gpu_wheels_check.py .whl scripts/gpu_image.txt --python-version 3.12 --source .
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip always carries its own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[assignment]

NEVER_CARRIED = {"torch", "numpy"}


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of `-_.` as one `-`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """Name, version and Requires-Dist lines of one wheel."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist()
                    if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(zf.read(meta).decode("utf-8"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def read_image(path: Path) -> dict[str, str | None]:
    """The image's distributions: normalized name -> version, or None where unknown."""
    have: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            have[normalize(words[0])] = words[1] if len(words) > 1 else None
    return have


def environment(python_version: str) -> dict[str, str]:
    """Marker values for CPython on x86-64 Linux."""
    return {
        "python_version": python_version, "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython", "implementation_version": f"{python_version}.0",
        "platform_python_implementation": "CPython", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
        "platform_release": "", "platform_version": "", "extra": "",
    }


def satisfied(req: Requirement, version: str | None) -> bool:
    """Whether a present distribution (of unknown version: None) meets the requirement."""
    if version is None or not str(req.specifier):
        return True
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check(folder: Path, image: dict[str, str | None], python_version: str) -> list[str]:
    """Print each wheel and what meets its needs; return the problems found."""
    problems: list[str] = []
    carried: dict[str, tuple[str, Path]] = {}
    requires: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, reqs = wheel_metadata(path)
        key = normalize(name)
        if key in carried:
            problems.append(f"two wheels of {name}: {carried[key][1].name} and {path.name}")
        if key in NEVER_CARRIED:
            problems.append(f"{path.name}: {name} is the image's own and must not be carried")
        carried[key] = (version, path)
        requires[key] = reqs
    if not carried:
        return [f"no wheels in {folder}"]
    env = environment(python_version)
    for key, (_version, path) in carried.items():
        met: list[str] = []
        have: str | None
        for line in requires[key]:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = normalize(req.name)
            if dep in carried:
                where, have = "carried", carried[dep][0]
            elif dep in image:
                where, have = "image", image[dep]
            else:
                problems.append(f"{path.name} needs {req}: neither carried nor in the image")
                continue
            if not satisfied(req, have):
                problems.append(f"{path.name} needs {req}: the {where} has {have}")
            met.append(f"{req.name} ({where})")
        size = path.stat().st_size
        print(f"  {path.name:<72} {size / 2**10:8.0f} KiB  needs: {', '.join(met) or '-'}")
    return problems


def unpackaged(folder: Path, root: Path) -> list[str]:
    """Python files of the checkout's packages (pyproject's package-dir) missing from gpufn's
    wheel: a sub-package not listed in `packages` would be absent on the GPU machine."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: not checked
        return []
    wheels = sorted(folder.glob("gpufn-*.whl"))
    if not wheels:
        return ["no gpufn wheel"]
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    missing: list[str] = []
    for package, source in dirs.items():
        for path in sorted((root / source).rglob("*.py")):
            rel = path.relative_to(root / source)
            if "__pycache__" not in rel.parts and "/".join(
                    [*package.split("."), *rel.parts]) not in names:
                missing.append(f"{source}/{rel.as_posix()} is not in {wheels[0].name}: list its "
                               "package in pyproject's [tool.setuptools] packages")
    return missing


def main(argv: list[str] | None = None) -> int:
    """Check the folder; exit 1 on any problem."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("image", type=Path)
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--source", type=Path, help="the checkout gpufn's wheel was built from")
    args = ap.parse_args(argv)
    problems = check(args.folder, read_image(args.image), args.python_version)
    if args.source is not None:
        problems += unpackaged(args.folder, args.source)
    for p in problems:
        print(f"MISSING: {p}", file=sys.stderr)
    if problems:
        return 1
    modules = "; every module of the checkout is in gpufn's wheel" if args.source else ""
    print(f"complete: every requirement is carried or in the image ({args.image}){modules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
