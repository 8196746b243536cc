"""Drives a SchedulerCore with messages, as the process shell would, with a fake clock."""

from __future__ import annotations

from typing import Any

from gpufn.memory_pool.probe import simulated_devices
from gpufn.scheduler.books.users import UserStore
from gpufn.scheduler.calls.recovery import Restored
from gpufn.scheduler.core import Received, SchedulerConfig, SchedulerCore, Send, Tick, Unreachable
from gpufn.scheduler.stores.deployments import DeploymentStore
from gpufn.scheduler.stores.kept_results import KeptResults
from gpufn.scheduler.stores.ops import OpsStore
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec, make_spec

GiB = 2**30


class Harness:
    def __init__(self, devices: int = 2, memory: int = 8 * GiB, islands: int = 1,
                 users: UserStore | None = None, ops: OpsStore | None = None,
                 **cfg: Any) -> None:
        config = SchedulerConfig(**cfg)
        results = KeptResults.in_state_dir(config.state_dir)
        self.core = SchedulerCore(config, DeploymentStore.in_state_dir(config.state_dir), users,
                                  results, ops)
        self.now = 1000.0
        # What the shell reads from the stores at its start (nothing without an ops store).
        restored = Restored.read(ops, results, 0.0, 0) if ops is not None else Restored()
        self.sent: list[Send] = self.core.start(restored, self.now)
        self.n = 0
        self.generations: dict[int, int] = {}
        self.infos = simulated_devices("n", devices, memory, islands=islands)
        self.hello(b"sup", p.Role.SUPERVISOR, token=config.token or "",
                   info={"node": "n", "devices": [d.to_wire() for d in self.infos]})
        self.hello(b"cli", p.Role.CLIENT, token=config.token or "")

    # ------------------------------------------------------------------ driving

    def feed(self, peer: bytes, msg: p.Message, dt: float = 0.0) -> list[Send]:
        self.now += dt
        out = self.core.handle(Received(peer, msg), self.now)
        self.sent += out
        return out

    def tick(self, dt: float = 0.0) -> list[Send]:
        self.now += dt
        out = self.core.handle(Tick(), self.now)
        self.sent += out
        return out

    def unreachable(self, peer: bytes) -> list[Send]:
        out = self.core.handle(Unreachable(peer), self.now)
        self.sent += out
        return out

    def hello(self, peer: bytes, role: str, token: str = "", info: dict[str, Any] | None = None,
              version: int = p.PROTOCOL_VERSION, pid: int = 1) -> p.Message:
        out = self.feed(peer, p.Hello(role, version, token, pid, p.HelloInfo(**(info or {}))))
        return next(s.msg for s in out if s.peer == peer and isinstance(s.msg, p.Welcome))

    def start_worker(self, index: int, peer: bytes | None = None, pid: int = 100,
                     incarnation: int | None = None) -> bytes:
        """A worker says hello; each start of a device is a new generation unless given."""
        peer = peer or f"w{index}".encode()
        if incarnation is None:
            incarnation = self.generations[index] = self.generations.get(index, 0) + 1
        msg = self.hello(peer, p.Role.WORKER, token=self.core.config.token or "",
                         info={"device": f"n:{index}", "incarnation": incarnation}, pid=pid)
        assert isinstance(msg, p.Welcome) and msg.ok, msg
        return peer

    def register(self, name: str = "f", spec: GpuSpec | None = None, **options: Any) -> str:
        spec = spec or make_spec(**options)
        fid = f"{name}-{hash(spec)}"
        self.feed(b"cli", p.Register(fid, f"code-{name}", name, spec.to_wire(), [], (b"code",)))
        return fid

    def submit(self, fid: str, client: bytes = b"cli", keep: bool = False, **options: Any) -> str:
        self.n += 1
        inv = f"inv{self.n}"
        self.feed(client, p.Submit(inv, fid, options, keep, frames=(b"args",)))
        return inv

    def token(self, inv: str) -> int:
        """The dispatch token of the invocation's latest Run (what a worker echoes)."""
        return [r for r in self.runs() if r.invocation_id == inv][-1].dispatch_token

    def finish(self, worker: bytes, inv: str, ok: bool = True, duration: float = 0.1) -> list[Send]:
        meta = p.ResultMeta(dispatch_token=self.token(inv), duration=duration)
        return self.feed(worker, p.Result(inv, ok, "", "", meta, (b"value",)), dt=duration)

    # ------------------------------------------------------------------ inspecting

    def runs(self, peer: bytes | None = None) -> list[p.Run]:
        return [s.msg for s in self.sent if isinstance(s.msg, p.Run) and (peer is None or s.peer == peer)]

    def results(self, client: bytes = b"cli") -> dict[str, p.Result]:
        return {s.msg.invocation_id: s.msg for s in self.sent
                if isinstance(s.msg, p.Result) and s.peer == client}

    def of_type(self, cls: type) -> list[Send]:
        return [s for s in self.sent if isinstance(s.msg, cls)]
