"""Gang formations the scheduler has made: which group each device's worker holds,
generations, and the warm gang remembered per function.

A formation is an ordered tuple of device keys (rank order). Re-forming the same set
reuses its group when every member still holds the current generation (warm: no init);
otherwise, or after any failure, the generation is bumped and every rank joins afresh.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field


@dataclass
class Formation:
    gang_id: str
    devices: tuple[str, ...]
    generation: int = 0
    uses: int = 0
    nonce: str = ""
    backend: str = ""  # the torch backend its current generation's group was made with


@dataclass
class GangBook:
    formations: dict[tuple[str, ...], Formation] = field(default_factory=dict)
    # device key -> (gang_id, generation) of the group its worker holds
    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    cold_formations: int = 0
    warm_formations: int = 0

    def form(self, devices: tuple[str, ...]) -> tuple[Formation, bool]:
        """The formation for these devices and whether its group is warm (held by all)."""
        f = self.formations.get(devices)
        if f is None:
            gid = "g" + hashlib.blake2b("|".join(devices).encode(), digest_size=6).hexdigest()
            f = self.formations[devices] = Formation(gid, devices)
        warm = f.generation > 0 and all(
            self.held.get(k) == (f.gang_id, f.generation) for k in devices)
        if not warm:
            f.generation += 1
            f.nonce = secrets.token_hex(8)
            for k in devices:  # each member leaves whatever group it held
                self.held[k] = (f.gang_id, f.generation)
            self.cold_formations += 1
        else:
            self.warm_formations += 1
        f.uses += 1
        return f, warm

    def is_warm(self, devices: tuple[str, ...]) -> bool:
        """Whether forming these devices now would reuse their group (no new generation)."""
        f = self.formations.get(devices)
        return f is not None and f.generation > 0 and all(
            self.held.get(k) == (f.gang_id, f.generation) for k in devices)

    def holds(self, devices: tuple[str, ...], gang: tuple[str, int]) -> bool:
        """Whether every device's worker still holds the group of `gang` (gang_id, generation)."""
        return all(self.held.get(k) == gang for k in devices)

    def broken(self, devices: tuple[str, ...]) -> None:
        """A rank failed or was lost: no member may reuse this generation."""
        f = self.formations.get(devices)
        for k in devices:
            if f is not None and self.held.get(k) == (f.gang_id, f.generation):
                del self.held[k]

    def forget_device(self, key: str) -> None:
        """The device's worker restarted: it holds no group."""
        self.held.pop(key, None)
