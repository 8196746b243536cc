"""Whether a call in flight under a lease lost with its worker had started there.

Its client sends such a call again with the attempt counted (`Submit.prior_lease`). The
dead worker's supervisor reads the process's journal of the calls it started and says
them with its exit notice (`WorkerExited.started`); a call that is not in a whole
journal never started, so its attempt is not counted: it runs as if first sent, even
with `retries=0` (calls queued behind one that crashed or hung its worker used to fail
`WorkerLost`). A resubmit that comes before the journal waits for it a while; with no
journal (a lost host, a wrapped or missing one) the attempt counts, as before. Pure:
the LeaseDesk feeds it and acts on its answers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from enum import Enum

from gpufn.scheduler.nouns.records import Journal, journal_of, may_have_started
from gpufn.wire import protocol as p

JOURNAL_WAIT_SECONDS = 5.0  # a resubmit waits this long for its lost worker's journal
REMEMBERED = 1024  # leases, and dead workers' journals, remembered


class Verdict(Enum):
    NEVER_STARTED = "never started"  # its attempt there is not counted
    MAY_HAVE_RUN = "may have run"  # counted, as a scheduled attempt lost with its worker
    WAIT = "wait"  # its worker's journal may still come


Worker = tuple[str, int]  # device key, worker pid


@dataclass(slots=True)
class Parked:
    peer: bytes
    msg: p.Submit
    until: float


class LostLeases:
    def __init__(self) -> None:
        self._where: OrderedDict[str, Worker] = OrderedDict()  # lease -> its worker
        self._why: dict[str, str] = {}  # lease lost with its worker -> why
        self._journals: OrderedDict[Worker, Journal | None] = OrderedDict()
        self._parked: dict[Worker, list[Parked]] = {}

    def opened(self, lease_id: str, device: str, pid: int) -> None:
        self._where[lease_id] = (device, pid)
        while len(self._where) > REMEMBERED:
            gone, _ = self._where.popitem(last=False)
            self._why.pop(gone, None)

    def lost(self, lease_id: str, why: str) -> None:
        if lease_id in self._where:
            self._why[lease_id] = why

    def worker(self, lease_id: str) -> Worker | None:
        return self._where.get(lease_id)

    def why(self, lease_id: str) -> str:
        """Why the lease was lost, as the scheduler saw it ("" if it did not see it)."""
        return self._why.get(lease_id, "")

    def verdict(self, msg: p.Submit, alive: bool = False) -> Verdict:
        """For a call resubmitted after its lease's worker was lost; `alive`: that worker
        is still the device's, as far as the scheduler knows (its client gave up on it).
        Only `NEVER_STARTED` changes the call (`decided`)."""
        where = self._where.get(msg.prior_lease)
        if where is None or msg.prior_raised or msg.prior_attempts < 1:
            return Verdict.MAY_HAVE_RUN
        if where in self._journals:
            journal = self._journals[where]
            if journal is None or may_have_started(journal, msg.invocation_id):
                return Verdict.MAY_HAVE_RUN
            return Verdict.NEVER_STARTED
        return Verdict.MAY_HAVE_RUN if alive else Verdict.WAIT

    @staticmethod
    def decided(msg: p.Submit, verdict: Verdict) -> p.Submit:
        """`msg` to admit: its last attempt uncounted if it never started."""
        if verdict is Verdict.NEVER_STARTED:
            return replace(msg, prior_attempts=msg.prior_attempts - 1, prior_lease="",
                           prior_device="" if msg.prior_attempts == 1 else msg.prior_device)
        return msg

    def park(self, peer: bytes, msg: p.Submit, now: float) -> None:
        """Wait for the journal of the lease's worker (`journal`, `expired`); a second
        Submit of a parked call (its client said Hello again) is the same call."""
        where = self._where[msg.prior_lease]
        waiting = self._parked.setdefault(where, [])
        if all(w.msg.invocation_id != msg.invocation_id for w in waiting):
            waiting.append(Parked(peer, msg, now + JOURNAL_WAIT_SECONDS))

    def journal(self, msg: p.WorkerExited) -> list[Parked]:
        """A worker's exit notice, with its journal: the calls that waited for it."""
        where = (msg.device, msg.pid)
        self._journals[where] = journal_of(msg)
        while len(self._journals) > REMEMBERED:
            self._journals.popitem(last=False)
        return self._parked.pop(where, [])

    def expired(self, now: float) -> list[Parked]:
        """Calls that waited long enough for a journal that did not come."""
        out: list[Parked] = []
        for where, waiting in list(self._parked.items()):
            out += [w for w in waiting if w.until <= now]
            left = [w for w in waiting if w.until > now]
            if left:
                self._parked[where] = left
            else:
                del self._parked[where]
        return out

    def unpark(self, peer: bytes, invocation_id: str) -> bool:
        """Drop a waiting call its client cancelled; False if none waits."""
        for where, waiting in self._parked.items():
            for w in waiting:
                if w.msg.invocation_id == invocation_id and w.peer == peer:
                    waiting.remove(w)
                    if not waiting:
                        del self._parked[where]
                    return True
        return False

    def waiting(self) -> int:
        return sum(len(w) for w in self._parked.values())
