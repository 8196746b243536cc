"""Mutants that cosmic-ray makes and no test can tell from the original, each with why
(scripts/mutants.py leaves them out of a module's score). A mutant is named by its module
and its one changed line, before and after (stripped), so a line that moves stays named."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Equivalent:
    module: str
    before: str
    after: str
    why: str


# Mutants inside annotations are not listed: scripts/mutants.py skips them (never evaluated
# under `from __future__ import annotations`).
_FP = "gpufn/wire/fingerprint.py"
_USERS = "scheduler/books/users.py"
_HELD = "worker/host/held.py"
_OPEN = "scheduler/placement/open_index.py"
EQUIVALENT: tuple[Equivalent, ...] = (
    Equivalent(_FP, "@dataclass(slots=True)", "@dataclass(slots=False)",
               "slots only save memory; no attribute is set outside the fields"),
    Equivalent(_FP, "except ImportError:  # pragma: no cover - another cloudpickle layout: "
               "always re-pickle", "except CosmicRayTestingException:  # pragma: no cover - "
               "another cloudpickle layout: always re-pickle",
               "the import succeeds with every cloudpickle gpufn installs; the fallback's "
               "behaviour (None: pickle every time) is tested by setting the helpers to None"),
    Equivalent(_USERS, "if path.stat().st_mode & 0o077:", "if path.stat().st_mode | 0o077:",
               "the file is then always chmod 0600: a file already 0600 is unchanged; the "
               "test checks a 0644 file is made 0600"),
    Equivalent(_USERS, "tmp.unlink(missing_ok=True)", "tmp.unlink(missing_ok=False)",
               "inside the try the temporary file always exists: os.open, which creates "
               "it, is before the try"),
    Equivalent(_USERS, "user = store.resolve(token) if token and len(store) else None",
               "user = store.resolve(token) if token or len(store) else None",
               "resolving an empty token, or on an empty store, finds nobody (None): the "
               "guard only saves a hash"),
    Equivalent(_USERS, "json.dump(data, f, indent=1)", "json.dump(data, f, indent= 0)",
               "only the whitespace of the JSON file changes"),
    Equivalent(_USERS, "json.dump(data, f, indent=1)", "json.dump(data, f, indent= 2)",
               "only the whitespace of the JSON file changes"),
    Equivalent(_USERS, "if user is None or user.max_priority is None or spec.priority <= "
               "user.max_priority:", "if user is None or user.max_priority is None or "
               "spec.priority < user.max_priority:",
               "at the ceiling the spec is replaced by an equal one (the same priority)"),
    Equivalent(_USERS, "@dataclass(frozen=True, slots=True)", "@dataclass(frozen=False, slots=True)",
               "nothing assigns to or hashes an Identity; frozen only guards against it"),
    Equivalent(_USERS, "@dataclass(frozen=True, slots=True)", "@dataclass(frozen=True, slots=False)",
               "slots only save memory"),
    Equivalent(_USERS, "@dataclass(slots=True)", "@dataclass(slots=False)",
               "slots only save memory; no attribute is set outside the fields"),
    Equivalent(_USERS, "return False", "return True",
               "DeviceCaps.begin with no capped user: checking caps then finds no cap "
               "(room is infinite); False only saves the work"),
    Equivalent(_USERS, "fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)",
               "fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 385)",
               "os.fchmod(fd, 0o600) on the next line sets the mode either way"),
    Equivalent(_USERS, "fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)",
               "fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 383)",
               "os.fchmod(fd, 0o600) on the next line sets the mode either way"),
    Equivalent(_HELD, "size += len(f) if type(f) is bytes else _nbytes((f,))",
               "size += len(f) if type(f) is not bytes else _nbytes((f,))",
               "_nbytes counts bytes by len too: the `is bytes` test only saves a call"),
    Equivalent(_HELD, "size += len(f) if type(f) is bytes else _nbytes((f,))",
               "size += len(f) if not type(f) is bytes else _nbytes((f,))",
               "_nbytes counts bytes by len too: the `is bytes` test only saves a call"),
    Equivalent(_HELD, "self._next = (self._next + 1) % JOURNAL_SLOTS",
               "self._next = (self._next - 1) % JOURNAL_SLOTS", "the journal is read as a set (`read`: any order): a ring walked backwards, or from another first slot, keeps the same newest JOURNAL_SLOTS ids"),
    Equivalent(_HELD, "self._next = 0", "self._next = -1", "the journal is read as a set (`read`: any order): a ring walked backwards, or from another first slot, keeps the same newest JOURNAL_SLOTS ids"),
    Equivalent(_HELD, "if os.fstat(fd).st_size != JOURNAL_SLOTS * SLOT:",
               "if os.fstat(fd).st_size != JOURNAL_SLOTS / SLOT:",
               "the file is then always truncated to its right size: one of that size is "
               "unchanged by it"),
    Equivalent(_HELD, "if self.nbytes > self.max_bytes:", "if self.nbytes >= self.max_bytes:",
               "_let_go's own loop drops nothing at exactly the budget (its test is >)"),
    Equivalent(_HELD, "if len(calls) > self.max_ids:", "if len(calls) >= self.max_ids:",
               "_forget's own loop forgets nothing at exactly max_ids (its test is >)"),
    Equivalent(_HELD, "self._calls[inv] = (None, 0)", "self._calls[inv] = (None, 1)",
               "the attempt of a call kept by id only is never read (report lists it as ran)"),
    Equivalent(_HELD, "self._calls[inv] = (None, 0)", "self._calls[inv] = (None, -1)",
               "the attempt of a call kept by id only is never read (report lists it as ran)"),
    Equivalent(_HELD, "int(max(0.0, result.meta.duration or 0.0) * 1000)]",
               "int(max(0.0, result.meta.duration or -1.0) * 1000)]",
               "max(0.0, ...) makes a missing duration 0 either way"),
    Equivalent(_HELD, "m[at] = 0  # the length last: a slot torn by a kill reads as empty",
               "m[at] = 1  # the length last: a slot torn by a kill reads as empty",
               "only a kill between this write and the id's tells (a torn slot then reads as "
               "a 1-byte id); no test can stop a process between two memory writes"),
    Equivalent(_OPEN, 'lo, uniform = min(0.0, min(rbd.values(), default=0.0)), not rbd',
               'lo, uniform = min(0.0, min(rbd.values(), default=0.0)),  rbd',
               'nothing measured: runtime_by_device is empty too (a measure sets the mean first), so lo is 0 or lower and uniform False at worst; a lower bound and no skipping only walk further, to the same device'),
    Equivalent(_OPEN, 'lo, uniform = min(0.0, min(rbd.values(), default=0.0)), not rbd',
               'lo, uniform = min( 1.0, min(rbd.values(), default=0.0)), not rbd',
               'nothing measured: runtime_by_device is empty too (a measure sets the mean first), so lo is 0 or lower and uniform False at worst; a lower bound and no skipping only walk further, to the same device'),
    Equivalent(_OPEN, 'lo, uniform = min(0.0, min(rbd.values(), default=0.0)), not rbd',
               'lo, uniform = min( -1.0, min(rbd.values(), default=0.0)), not rbd',
               'nothing measured: runtime_by_device is empty too (a measure sets the mean first), so lo is 0 or lower and uniform False at worst; a lower bound and no skipping only walk further, to the same device'),
    Equivalent(_OPEN, 'lo, uniform = min(0.0, min(rbd.values(), default=0.0)), not rbd',
               'lo, uniform = min(0.0, min(rbd.values(), default= 1.0)), not rbd',
               'nothing measured: runtime_by_device is empty too (a measure sets the mean first), so lo is 0 or lower and uniform False at worst; a lower bound and no skipping only walk further, to the same device'),
    Equivalent(_OPEN, 'lo, uniform = min(0.0, min(rbd.values(), default=0.0)), not rbd',
               'lo, uniform = min(0.0, min(rbd.values(), default= -1.0)), not rbd',
               'nothing measured: runtime_by_device is empty too (a measure sets the mean first), so lo is 0 or lower and uniform False at worst; a lower bound and no skipping only walk further, to the same device'),
    Equivalent(_OPEN, 'if got is not None and got[0] == stamp:',
               'if got is not None and got[ 1] == stamp:',
               'the cache never hits: the bounds are computed again, the same'),
    Equivalent(_OPEN, 'if got is not None and got[0] == stamp:',
               'if got is not None and got[ -1] == stamp:',
               'the cache never hits: the bounds are computed again, the same'),
    Equivalent(_OPEN, 'best_drain = 0.0',
               'best_drain = 1.0',
               'read only once `best` is set, which sets it'),
    Equivalent(_OPEN, 'best_drain = 0.0',
               'best_drain = -1.0',
               'read only once `best` is set, which sets it'),
    Equivalent(_OPEN, 'if got is not None and (found is None or got < found):',
               'if got is not None and (found is None or got <= found):',
               "candidates never tie: each ends with its device's unique key"),
    Equivalent(_OPEN, 'if best is None or cand < best:',
               'if best is None or cand <= best:',
               "candidates never tie: each ends with its device's unique key"),
    Equivalent(_OPEN, 'if drain + lo > best[0]:',
               'if drain - lo > best[0]:',
               'lo >= 0: a later break only walks further, to the same device'),
    Equivalent(_OPEN, 'if uniform and drain == best_drain:',
               'if uniform and drain != best_drain:',
               "with one run time for every device an entry of a larger drain finishes later than best and cannot win: skipping its drain's run changes nothing"),
    Equivalent(_OPEN, 'if running and d.running_by_fn.get(code, 0) >= limit:',
               'if running and d.running_by_fn.get(code, -1) >= limit:',
               'limit (concurrency) is at least 1: 0 and -1 are both under it'),
    Equivalent(_OPEN, 'and not (d.running and d.running_by_fn.get(code, 0) >= limit))',
               'and not (d.running and d.running_by_fn.get(code, -1) >= limit))',
               'limit (concurrency) is at least 1: 0 and -1 are both under it'),
    Equivalent(_OPEN, 'merged: Iterator[Entry] = iter(lists[0]) if len(lists) == 1 else heapq.merge(*lists)',
               'merged: Iterator[Entry] = iter(lists[ -1]) if len(lists) == 1 else heapq.merge(*lists)',
               'with one list, lists[0] is lists[-1]'),
)
