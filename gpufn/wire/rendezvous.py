"""The rendezvous a gang's ranks share: `GangSpec` (handed out by the scheduler in a
Run's `RunMeta.gang`), the backend choice, and the scheduler-hosted `TCPStore`.

Wire-level and torch-free at import, so the scheduler and workers both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpufn.wire import config

if TYPE_CHECKING:
    from torch.distributed import TCPStore

ENV_BACKEND = "GPUFN_DIST_BACKEND"
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class GangSpec:
    """One rank's view of a gang formation, as the scheduler hands it out in `RunMeta.gang`."""

    gang_id: str
    generation: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    backend: str  # "nccl", "gloo", or a torch backend string such as "cpu:gloo,cuda:nccl"
    timeout_s: float = DEFAULT_TIMEOUT_S
    devices: tuple[str, ...] = ()  # device keys in rank order
    # A random key-space secret per formation, sent only inside the token-protected Run:
    # the store itself has no authentication, so its keys must not be guessable.
    nonce: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad gang rank {self.rank} of world size {self.world_size}")
        if not self.timeout_s > 0:
            raise ValueError(f"gang timeout_s must be > 0, got {self.timeout_s}")
        if self.devices and len(self.devices) != self.world_size:
            raise ValueError(
                f"gang lists {len(self.devices)} devices for world size {self.world_size}"
            )

    @property
    def prefix(self) -> str:
        """The store key space of this formation."""
        base = f"gpufn/{self.gang_id}/{self.generation}"
        return f"{base}/{self.nonce}" if self.nonce else base

    def same_group(self, other: GangSpec | None) -> bool:
        """True if `other` is this very group and rank (warm reuse needs no init)."""
        return (
            other is not None
            and (other.gang_id, other.generation, other.rank, other.world_size)
            == (self.gang_id, self.generation, self.rank, self.world_size)
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "gang_id": self.gang_id, "generation": self.generation, "rank": self.rank,
            "world_size": self.world_size, "store_host": self.store_host,
            "store_port": self.store_port, "backend": self.backend,
            "timeout_s": self.timeout_s, "devices": list(self.devices), "nonce": self.nonce,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> GangSpec:
        return cls(
            gang_id=str(d["gang_id"]), generation=int(d["generation"]), rank=int(d["rank"]),
            world_size=int(d["world_size"]), store_host=str(d["store_host"]),
            store_port=int(d["store_port"]), backend=str(d["backend"]),
            timeout_s=float(d.get("timeout_s", DEFAULT_TIMEOUT_S)),
            devices=tuple(str(k) for k in d.get("devices", ())),
            nonce=str(d.get("nonce", "")),
        )


def resolve_backend(kind: str) -> str:
    """The backend for a gang on `kind` devices: $GPUFN_DIST_BACKEND, else nccl/gloo.

    Call this once where the gang is formed (the scheduler) so every rank uses the same.
    """
    override = config.dist_backend()
    if override:
        return override
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    from torch.distributed import Backend

    return str(Backend.default_device_backend_map.get(kind, "gloo"))


def host_store(host: str = "127.0.0.1") -> tuple[TCPStore, int]:
    """Start the rendezvous store (in the scheduler process) on a free port: (store, port).

    It listens on `host` only (the scheduler's own bind: torch's TCPStore alone would
    listen on every interface), through a socket bound here and handed over as
    `master_listen_fd`. The store is plaintext and unauthenticated (see GangSpec.nonce).
    Keep the store object alive for as long as gangs may form. Workers on other hosts
    must be given an address of this host they can reach as `GangSpec.store_host`.
    """
    import socket

    from torch.distributed import TCPStore

    bind = "0.0.0.0" if host in ("", "*") else host.strip("[]")
    family, kind, proto, _, addr = socket.getaddrinfo(bind, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(addr)
        listener.listen(512)
        port = int(listener.getsockname()[1])
    except OSError:
        listener.close()
        raise
    # The store connects to itself too: through loopback when bound to every interface.
    own = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    fd = listener.detach()  # the store owns the listening socket from here on
    store = TCPStore(own, port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    return store, port
