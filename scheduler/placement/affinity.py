"""Session and prefix affinity: a call that names a key (`with_options(affinity=...)`) goes
to the device that last ran that key, whose engine may still hold the key's cache, when
that device can take it now and is not much busier than the least busy device that could
(hashing with a load cap, as Ray Serve's prefix-aware router and Dynamo's KV router do)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from gpufn.scheduler.nouns.records import Device

MAX_KEYS = 100_000  # keys remembered, least recently used first out
SLACK = 2  # the affine device may run this many more calls than the least busy candidate


class Affinity:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._where: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.max_keys = max_keys

    def ran(self, function: str, key: str, device: str) -> None:
        """A call of `function` with `key` was dispatched to `device`."""
        if not key:
            return
        k = (function, key)
        self._where[k] = device
        self._where.move_to_end(k)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def choose(self, function: str, key: str, candidates: Iterable[Device],
               concurrency: int) -> Device | None:
        """The key's device among `candidates` (those that could take the call now) if its
        load is within the cap; None: place the call as any other."""
        if not key:
            return None
        home = self._where.get((function, key))
        if home is None:
            return None
        found, least = None, None
        for d in candidates:
            n = len(d.running)
            least = n if least is None else min(least, n)
            if d.key == home:
                found = d
        if found is None or least is None:
            return None
        cap = max(SLACK, concurrency // 4)
        return found if len(found.running) <= least + cap else None
