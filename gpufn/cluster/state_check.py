"""The state directory checked before `gpufn serve` starts anything, and put right by
`gpufn state restore`: a damaged file is never taken for an empty one.

Each file the head keeps there is checked for what it is: the sqlite stores
(`deployments.sqlite`, `ops.sqlite`, `results.sqlite`) by their header (a file shorter
than its header says was truncated; an empty one too) and sqlite's `quick_check`,
`users.json` and `head.json` as JSON of their shape, `admin.token` as one line of text,
`keys/` as a CURVE key pair. `gpufn serve` refuses to start on the first damaged one,
in one line naming it and the fix, and changes nothing. `restore` keeps the damaged file
aside (`NAME.damaged-TIME`), then puts back the newest good backup (`backups/`, kept by
the head: gpufn/net/backups.py), else copies into a new file what can still be read.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufn.exceptions import GpufnError
from gpufn.net import backups, processes
from gpufn.net import curve as security
from gpufn.net.private_files import private_file

SQLITE = ("deployments.sqlite", "ops.sqlite", "results.sqlite")
JSON = ("users.json", "head.json")
TOKEN = "admin.token"
KEYS = "keys"
QUICK_CHECK_MAX = 256 * 2**20  # larger databases: header, length and schema only
LOST = {
    "deployments.sqlite": "the apps it could not read must be deployed again",
    "ops.sqlite": "usage and logs from before are lost, the restart hold waits for no device",
    "results.sqlite": "kept results of spawned calls it could not read are lost",
    "users.json": "every user's token stops working (gpufn token create makes new ones)",
    "head.json": "workers a previous gpufn serve left are not adopted; stop them by pid",
    TOKEN: "the next gpufn serve makes a new token (clients and worker hosts need it), "
           "or give --token",
    KEYS: "the next gpufn serve makes new CURVE keys (clients and worker hosts need the "
          "new address with ?key=)",
}


@dataclass(frozen=True)
class Damage:
    path: Path
    why: str

    def fix(self) -> str:
        good = next(iter(_good_backups(self.path)), None)
        keeps = (f"puts back its newest good backup, {good.name}" if good is not None
                 else "copies what can still be read into a new file" if
                 self.path.name in SQLITE else LOST[self.path.name])
        return (f"Run `gpufn state restore {self.path}`: it keeps the damaged file aside "
                f"and {keeps}")

    def line(self) -> str:
        """`gpufn serve`'s one line: the file, why, and the fix."""
        return (f"the state file {self.path} is damaged ({self.why}); nothing was started. "
                f"{self.fix()}")


# ---------------------------------------------------------------------- checks


def sqlite_damage(path: Path) -> str | None:
    """Why the sqlite file `path` is damaged, or None (also when it does not exist)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(100)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    if size == 0:
        return "it is empty (0 bytes): truncated"
    if not header.startswith(b"SQLite format 3\0"):
        return "not a sqlite database" if size >= 100 else f"truncated to {size} bytes"
    page = int.from_bytes(header[16:18], "big") or 1
    page = 65536 if page == 1 else page
    pages = int.from_bytes(header[28:32], "big")
    if header[24:28] == header[92:96] and pages * page > size:
        return f"truncated: {size} bytes of {pages * page}"
    try:
        return _sqlite_check(path, size)
    except sqlite3.Error as e:
        return str(e)


def _sqlite_check(path: Path, size: int) -> str | None:
    uri = f"file:{path}?mode=ro"
    try:
        db = sqlite3.connect(uri, uri=True)
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as e:
        if "unable to open" not in str(e):
            raise
        db = sqlite3.connect(str(path))  # a -wal without its -shm: sqlite recovers it
    try:
        if size > QUICK_CHECK_MAX:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return None
        rows = db.execute("PRAGMA quick_check").fetchall()
        return None if rows == [("ok",)] else str(rows[0][0])
    finally:
        db.close()


def _json_shape(name: str, data: Any) -> bool:
    if name == "users.json":
        return isinstance(data, dict) and isinstance(data.get("users"), list) and all(
            isinstance(u, dict) and isinstance(u.get("name"), str)
            and isinstance(u.get("token_sha256"), str) for u in data["users"])
    return isinstance(data, dict)


def json_damage(path: Path) -> str | None:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except ValueError as e:
        return f"not JSON: {e}"
    return None if _json_shape(path.name, data) else "JSON of the wrong shape"


def token_damage(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    token = text.strip()
    if not token:
        return "it is empty"
    if not token.isprintable():
        return "not one line of printable text"
    return None


def keys_damage(d: Path) -> str | None:
    secret = d / f"{security.SERVER_KEY_NAME}.key_secret"
    public = d / f"{security.SERVER_KEY_NAME}.key"
    if not secret.exists() and not public.exists():
        return None
    if not secret.exists() or not public.exists():
        return f"{(public if secret.exists() else secret).name} is missing"
    try:
        security.load_keypair(secret)
    except (security.SecurityError, ValueError, UnicodeDecodeError) as e:
        return str(e)
    return None


CHECKS: dict[str, Callable[[Path], str | None]] = {
    **{n: sqlite_damage for n in SQLITE}, **{n: json_damage for n in JSON},
    TOKEN: token_damage, KEYS: keys_damage}


def check(state_dir: Path, token_given: bool = False) -> list[Damage]:
    """Every damaged file of the state directory (admin.token is not read when the
    token is given: it is written over)."""
    out = []
    for name, damage in CHECKS.items():
        if name == TOKEN and token_given:
            continue
        why = damage(state_dir / name)
        if why is not None:
            out.append(Damage(state_dir / name, why))
    return out


def refusal(state_dir: Path, token_given: bool = False) -> str | None:
    """The one line `gpufn serve` refuses to start with, or None."""
    found = check(state_dir, token_given)
    if not found:
        return None
    more = f" ({len(found) - 1} more damaged: `gpufn state check`)" if len(found) > 1 else ""
    return found[0].line() + more


# ---------------------------------------------------------------------- restore


def _good_backups(path: Path) -> list[Path]:
    damage = CHECKS.get(path.name)
    if damage is None or path.name == KEYS:
        return []
    return [b for b in backups.copies(path) if _copy_damage(damage, b) is None]


def _copy_damage(damage: Callable[[Path], str | None], copy: Path) -> str | None:
    """A backup is checked as the file it copies (json_damage reads it by its name)."""
    if damage is json_damage:
        try:
            data = json.loads(copy.read_text())
        except (OSError, ValueError):
            return "unreadable"
        return None if _json_shape(copy.name.rsplit(".", 1)[0], data) else "wrong shape"
    return damage(copy)


def _serving(state_dir: Path) -> int | None:
    try:
        rec = json.loads((state_dir / "head.json").read_text())
        pid = int(rec.get("serve") or 0)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return pid if pid and processes.same(pid, rec.get("serve_started")) else None


def restore(path: Path) -> list[str]:
    """Put the damaged state file `path` right (see the module doc); what was done."""
    path = path.absolute()
    if path.name not in CHECKS:
        raise GpufnError(f"{path.name} is not a state file gpufn checks "
                         f"({', '.join(CHECKS)})")
    serving = _serving(path.parent)
    if serving is not None:
        raise GpufnError(f"a gpufn serve (pid {serving}) uses {path.parent}: stop it first")
    why = CHECKS[path.name](path)
    if why is None:
        return [f"{path} is not damaged: nothing to do"]
    good = _good_backups(path)
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    done = [f"{path} ({why}) was kept aside as {aside}"]
    if good:
        private_file(path)
        shutil.copyfile(good[0], path)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(good[0].stat().st_mtime))
        done.append(f"restored from its backup {good[0]} (of {stamp}): changes after it "
                    "are lost")
    elif path.name in SQLITE:
        done.append(_salvage(aside, path))
    else:
        done.append(f"no backup: {LOST[path.name]}")
    return done


def _salvage(src_path: Path, path: Path) -> str:
    """Copy every row sqlite can still read from `src_path` into a new `path`."""
    try:
        src = sqlite3.connect(f"file:{src_path}?mode=ro", uri=True)
        tables = src.execute("SELECT name, sql FROM sqlite_master WHERE type='table' AND "
                             "sql IS NOT NULL AND name NOT LIKE 'sqlite_%'").fetchall()
    except sqlite3.Error as e:
        return f"nothing in it could be read ({e}): {LOST[path.name]}"
    private_file(path)
    dst = sqlite3.connect(str(path), isolation_level=None)
    kept, partial = 0, []
    try:
        dst.execute("BEGIN")
        for name, sql in tables:
            dst.execute(sql)
            try:
                for row in src.execute(f'SELECT * FROM "{name}"'):
                    dst.execute(f'INSERT OR IGNORE INTO "{name}" VALUES '
                                f'({",".join("?" * len(row))})', row)
                    kept += 1
            except sqlite3.DatabaseError:
                partial.append(name)
        dst.execute("COMMIT")
    finally:
        dst.close()
        src.close()
    if not kept and not partial and not tables:
        path.unlink(missing_ok=True)  # an empty file would read as damaged again
        return f"nothing in it could be read: the next gpufn serve starts without it ({LOST[path.name]})"
    cut = f"; tables read in part: {', '.join(partial)} ({LOST[path.name]})" if partial else ""
    return f"copied {kept} rows it could still read into a new {path.name}{cut}"
