"""What a worker keeps for the next scheduler: the Results it sent lately (a restarted
scheduler may never have passed them on) and a journal of the calls it started, which
its supervisor reads if the worker dies while no scheduler is there to notice.

Both are bounded and cost a few dictionary and memory writes per call; nothing is
written to disk through a system call on the call path (the journal is a memory-mapped
file of fixed size).
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from gpufn.wire import protocol as p

MAX_IDS = 10_000  # calls remembered as "ran here" (ids only) for a restarted scheduler
JOURNAL_SLOTS = 4096  # calls the journal remembers, newest over oldest
SLOT = p.JOURNAL_ID_MAX + 1  # bytes per journal slot: a length byte, then the id
MAX_ID = p.JOURNAL_ID_MAX


def _nbytes(frames: tuple[Any, ...]) -> int:
    n = 0
    for f in frames:
        n += len(f) if isinstance(f, (bytes, bytearray)) else memoryview(getattr(f, "buffer", f)).nbytes
    return n


class HeldResults:
    """The worker's latest Results (with the output their calls printed), newest last:
    each with its payload while they fit in `max_bytes` (the newest always), then by id
    only (it ran; its value is gone)."""

    def __init__(self, max_bytes: int, max_ids: int = MAX_IDS) -> None:
        self.max_bytes, self.max_ids = max_bytes, max_ids
        # id -> (Result or None once its payload was let go, attempt)
        self._calls: OrderedDict[str, tuple[p.Result | None, int]] = OrderedDict()
        self._with_payload: OrderedDict[str, int] = OrderedDict()  # id -> payload bytes
        self._output: dict[str, list[p.Output]] = {}  # id -> its Output, if it printed
        self.nbytes = 0

    def add(self, result: p.Result, attempt: int, output: list[p.Output] | None = None) -> None:
        """A Result the worker sends (on every call's path: kept cheap)."""
        inv = result.invocation_id
        size = 0
        for f in result.frames:
            size += len(f) if type(f) is bytes else _nbytes((f,))
        if output:
            self._output[inv] = output
            size += sum(len(o.text) for o in output)
        calls = self._calls
        if inv in calls:  # sent again (a Resend): keep one entry
            del calls[inv]
            self.nbytes -= self._with_payload.pop(inv, 0)
        calls[inv] = (result, attempt)
        self._with_payload[inv] = size
        self.nbytes += size
        if self.nbytes > self.max_bytes:
            self._let_go()
        if len(calls) > self.max_ids:
            self._forget()

    def _let_go(self) -> None:
        """Drop the oldest payloads until they fit (the newest is kept whatever its size)."""
        while self.nbytes > self.max_bytes and len(self._with_payload) > 1:
            gone, n = self._with_payload.popitem(last=False)
            self.nbytes -= n
            _, att = self._calls[gone]
            self._calls[gone] = (None, att)
            self._output.pop(gone, None)

    def _forget(self) -> None:
        while len(self._calls) > self.max_ids:
            gone, _ = self._calls.popitem(last=False)
            self.nbytes -= self._with_payload.pop(gone, 0)
            self._output.pop(gone, None)

    def ran(self, ids: list[str]) -> None:
        """Calls that ended here without a Result of their own to hand over (a batch's
        members, a gang's ranks): a restarted scheduler counts them as run."""
        for inv in ids:
            if inv not in self._calls:
                self._calls[inv] = (None, 0)
        self._forget()

    def get(self, invocation_id: str) -> p.Result | None:
        entry = self._calls.get(invocation_id)
        return entry[0] if entry is not None else None

    def output(self, invocation_id: str) -> list[p.Output]:
        """What the call printed (sent again before its Result)."""
        return self._output.get(invocation_id, [])

    def report(self) -> tuple[dict[str, list[int]], list[str]]:
        """(held: id -> [dispatch token, attempt, ms the run took] of Results still kept,
        ran: ids of the calls whose Result is gone), for a Hello to a restarted scheduler."""
        held: dict[str, list[int]] = {}
        ran: list[str] = []
        for inv, (result, attempt) in self._calls.items():
            if result is not None:
                held[inv] = [result.meta.dispatch_token, attempt,
                             int(max(0.0, result.meta.duration or 0.0) * 1000)]
            else:
                ran.append(inv)
        return held, ran


class RunJournal:
    """A ring of the ids of the calls a worker started, in a memory-mapped file its
    supervisor reads after the worker died (`read`). A write is a memory copy; the file
    survives the process (not the machine, which takes the calls with it anyway)."""

    def __init__(self, path: Path | str) -> None:
        """Raises OSError when the file cannot be made, e.g. on a full disk."""
        size = JOURNAL_SLOTS * SLOT
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # Its size and every page now (a new file grows to `size`): a write into a hole
            # of the mapping on a full disk is SIGBUS (a worker started on a full disk, its
            # supervisor's zeroing failed, died at its first call whose slot fell in a
            # hole, and again after each restart).
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._next = 0

    def started(self, invocation_id: str) -> None:
        raw = invocation_id.encode()
        if len(raw) > MAX_ID:
            return  # not an id gpufn makes; such a call is not journaled
        at = self._next * SLOT
        self._next = (self._next + 1) % JOURNAL_SLOTS
        m = self._map
        m[at] = 0  # the length last: a slot torn by a kill reads as empty
        m[at + 1:at + 1 + len(raw)] = raw
        m[at] = len(raw)

    def close(self) -> None:
        self._map.close()

    @staticmethod
    def read(path: Path | str) -> list[str]:
        """The ids in a journal file (any order); [] if there is none."""
        try:
            data = Path(path).read_bytes()
        except OSError:
            return []
        out = []
        for at in range(0, len(data) - SLOT + 1, SLOT):
            n = data[at]
            if 0 < n <= MAX_ID:
                try:
                    out.append(data[at + 1:at + 1 + n].decode())
                except UnicodeDecodeError:
                    continue
        return out

    @staticmethod
    def read_whole(path: Path | str) -> list[str] | None:
        """The ids in a journal file when they are every call its process started: None
        when there is no journal of full size (the worker could not make it) or it may
        have wrapped (newer ids over older ones; a slot torn by the kill reads empty)."""
        try:
            if Path(path).stat().st_size != JOURNAL_SLOTS * SLOT:
                return None
        except OSError:
            return None
        ids = RunJournal.read(path)
        return ids if len(ids) < JOURNAL_SLOTS - 1 else None

    @staticmethod
    def clear(path: Path | str) -> None:
        """Empty the journal for a new worker process (its predecessor's was read). It is
        zeroed, never truncated: a process that still maps it must not fault."""
        size = JOURNAL_SLOTS * SLOT
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return
        try:
            zeroed = os.pwrite(fd, bytes(size), 0) == size
        except OSError:  # a full disk
            zeroed = False
        finally:
            os.close(fd)
        if not zeroed:  # none of the predecessor's ids left to be read again: no file
            try:
                os.unlink(path)
            except OSError:
                pass
