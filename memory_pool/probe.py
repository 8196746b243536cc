"""Device probes: what devices a host has, from NVML on GPU machines or simulated on CPU.

Both return the same `DeviceInfo`, so scheduling and pool logic is identical over both.
The simulated probe carries a topology too (NVLink-like islands) for gang placement tests.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("gpufn.probe")

# NVML common-ancestor levels (nvmlGpuTopologyLevel_t): smaller is closer.
TOPO_INTERNAL, TOPO_SINGLE, TOPO_MULTIPLE, TOPO_HOSTBRIDGE, TOPO_NODE, TOPO_SYSTEM = (
    0, 10, 20, 30, 40, 50,
)


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One device as a probe sees it. `key` ("node:index") names it cluster-wide."""

    node: str
    index: int
    name: str
    uuid: str
    memory_total: int
    memory_free: int
    kind: str = "cpu"  # "cuda" or "cpu" (simulated)
    pci_bus_id: str = ""
    numa_node: int = -1
    nvlink_peers: tuple[int, ...] = ()
    # peer index -> NVML common-ancestor level (TOPO_*); missing means TOPO_SYSTEM.
    pcie_levels: dict[int, int] = field(default_factory=dict)
    key: str = field(init=False, repr=False, compare=False)  # "node:index", made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.node}:{self.index}")

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("key")
        d["nvlink_peers"] = list(self.nvlink_peers)
        d["pcie_levels"] = {str(k): v for k, v in self.pcie_levels.items()}
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> DeviceInfo:
        d = dict(d)
        d.pop("key", None)
        d["nvlink_peers"] = tuple(d.get("nvlink_peers", ()))
        d["pcie_levels"] = {int(k): int(v) for k, v in d.get("pcie_levels", {}).items()}
        return cls(**d)


def simulated_devices(
    node: str, count: int, memory: int, *, islands: int = 1, name: str = "cpu"
) -> list[DeviceInfo]:
    """`count` CPU-backed devices split into `islands` NVLink-like groups.

    Inside an island every pair is "NVLink" connected and shares a PCIe switch
    (TOPO_SINGLE); across islands the path crosses the system (TOPO_SYSTEM). The
    island number doubles as the NUMA node.
    """
    islands = max(1, min(islands, count))
    per = -(-count // islands)
    island_of = [i // per for i in range(count)]
    out = []
    for i in range(count):
        peers = tuple(j for j in range(count) if j != i and island_of[j] == island_of[i])
        levels = {
            j: (TOPO_SINGLE if island_of[j] == island_of[i] else TOPO_SYSTEM)
            for j in range(count)
            if j != i
        }
        out.append(
            DeviceInfo(
                node=node, index=i, name=name, uuid=f"SIM-{node}-{i}", memory_total=memory,
                memory_free=memory, kind="cpu", pci_bus_id=f"sim:{i:02x}",
                numa_node=island_of[i], nvlink_peers=peers, pcie_levels=levels,
            )
        )
    return out


def nvml_devices(node: str) -> list[DeviceInfo]:
    """Devices from NVML; [] when there is no driver or no GPU."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver: the normal case on CPU machines
        log.debug("NVML unavailable: %s", e)
        return []
    try:
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        out = []
        for i, h in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            pci = pynvml.nvmlDeviceGetPciInfo(h).busId
            numa = _safe(lambda h=h: pynvml.nvmlDeviceGetNumaNodeId(h), -1)
            peers, levels = [], {}
            for j, other in enumerate(handles):
                if j == i:
                    continue
                status = _safe(
                    lambda h=h, o=other: pynvml.nvmlDeviceGetP2PStatus(
                        h, o, pynvml.NVML_P2P_CAPS_INDEX_NVLINK
                    ),
                    -1,
                )
                if status == pynvml.NVML_P2P_STATUS_OK:
                    peers.append(j)
                levels[j] = _safe(
                    lambda h=h, o=other: pynvml.nvmlDeviceGetTopologyCommonAncestor(h, o),
                    TOPO_SYSTEM,
                )
            out.append(
                DeviceInfo(
                    node=node, index=i, name=_text(name), uuid=_text(uuid),
                    memory_total=int(mem.total), memory_free=int(mem.free), kind="cuda",
                    pci_bus_id=_text(pci), numa_node=int(numa), nvlink_peers=tuple(peers),
                    pcie_levels=levels,
                )
            )
        return out
    finally:
        _safe(pynvml.nvmlShutdown, None)


def _safe(fn: Any, default: Any) -> Any:
    try:
        return fn()
    except Exception:
        return default


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def probe_devices(
    node: str, *, cpu_devices: int, device_memory: int, islands: int = 1, force_cpu: bool = False
) -> list[DeviceInfo]:
    """NVML devices if a driver is present, else `cpu_devices` simulated ones."""
    if not force_cpu:
        found = nvml_devices(node)
        if found:
            return found
    return simulated_devices(node, cpu_devices, device_memory, islands=islands)
