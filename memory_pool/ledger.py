"""Per-device memory ledger kept by the scheduler: capacity, workspace reserved by
running invocations, and (with the pool) model weights resident on the device."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DeviceLedger:
    """Byte accounting for one device. All numbers are bytes."""

    capacity: int
    workspace: dict[str, int] = field(default_factory=dict)

    @property
    def workspace_bytes(self) -> int:
        return sum(self.workspace.values())

    @property
    def used(self) -> int:
        return self.workspace_bytes

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def reserve(self, owner: str, nbytes: int) -> None:
        if owner in self.workspace:
            raise KeyError(f"workspace for {owner} is already reserved")
        self.workspace[owner] = nbytes

    def release(self, owner: str) -> int:
        return self.workspace.pop(owner, 0)

    def reset(self) -> None:
        """The worker restarted: nothing of the old process holds memory any more."""
        self.workspace.clear()
