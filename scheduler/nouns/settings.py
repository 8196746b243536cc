"""The scheduler's settings (`SchedulerConfig`, from GPUFN_* variables) and its counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufn.memory_pool.eviction import EvictionPolicy, policy_by_name
from gpufn.wire.units import parse_memory


@dataclass
class SchedulerConfig:
    token: str | None = None
    slots_per_device: int = 8
    aging_seconds: float = 30.0
    heartbeat_timeout: float = 30.0
    client_timeout: float = 120.0
    max_queue: int = 1_000_000
    max_queue_per_function: int | None = None
    # A call told to stop (cancelled, or another rank of its gang failed) that has not
    # returned after this long has its worker killed and restarted.
    stop_grace_seconds: float = 10.0
    # After a gang rank fails, wait this long at most for the others to report, so the
    # root cause (a dead rank, or a non-communication error) is what the caller sees.
    gang_settle_seconds: float = 3.0
    # Calls measured shorter than this run inline on the worker's main thread, and
    # more of them may wait at a worker (hiding the round trip): 2, or as many as run
    # in `pipeline_seconds` (so a call that comes later waits at most about that long
    # behind them), at most `pipeline_depth`.
    short_call_seconds: float = 0.005
    pipeline_depth: int = 7  # with the running call: a device's 8 slots
    pipeline_seconds: float = 0.002
    # The memory pool: eviction policy ("cost" or "lru-count") and its options, and the
    # host memory per node that offloaded models may use (0: half the node's RAM).
    eviction_policy: str = "cost"
    eviction_options: dict[str, Any] | None = None
    host_offload_bytes: int = 0
    # The largest frame a peer may send (GPUFN_MAX_PAYLOAD); ZeroMQ drops a peer that
    # declares a larger one before buffering it.
    max_payload: int = 2 * 2**30
    # Where deployments are kept ("" keeps them in memory: unit tests).
    state_dir: str = ""
    # A retried call waits retry_backoff_seconds * 2**(n-1) before its n-th retry, at
    # most retry_backoff_max, so it does not land on the next worker to die at once.
    retry_backoff_seconds: float = 0.2
    retry_backoff_max: float = 5.0
    # After a restart, calls that forgotten clients resubmit wait this long, so workers
    # register first and say which of them they ran (see recovery.py).
    restart_grace_seconds: float = 30.0
    # Spawned calls of deployed functions: their Results stay on disk this long after
    # they ended, within this many bytes in all (see kept_results.py).
    result_retention_seconds: float = 24 * 3600.0
    result_store_bytes: int = 4 * 2**30
    # Leases (desks/lease_desk.py): a client's repeat calls go straight to a worker for
    # this long, or this many calls, while nothing else waits (0 seconds: no leases).
    lease_seconds: float = 1.0
    lease_max_calls: int = 100_000

    def retry_delay(self, retry: int) -> float:
        """The wait before retry number `retry` (1-based)."""
        return min(self.retry_backoff_max, self.retry_backoff_seconds * 2 ** max(0, min(retry - 1, 32)))

    def policy(self) -> EvictionPolicy:
        return policy_by_name(self.eviction_policy, **(self.eviction_options or {}))

    @classmethod
    def from_env(cls, token: str | None) -> SchedulerConfig:
        """Defaults overridden by GPUFN_SLOTS, GPUFN_AGING_SECONDS, GPUFN_HEARTBEAT_TIMEOUT,
        GPUFN_CLIENT_TIMEOUT, GPUFN_MAX_QUEUE, GPUFN_MAX_QUEUE_PER_FUNCTION,
        GPUFN_STOP_GRACE_SECONDS, GPUFN_GANG_SETTLE_SECONDS, GPUFN_PIPELINE_DEPTH,
        GPUFN_EVICTION_POLICY (+ GPUFN_LRU_MAX_MODELS), GPUFN_HOST_OFFLOAD_MEMORY,
        GPUFN_MAX_PAYLOAD, GPUFN_RETRY_BACKOFF, GPUFN_RETRY_BACKOFF_MAX, GPUFN_RESTART_GRACE,
        GPUFN_RESULT_RETENTION, GPUFN_RESULT_STORE_MAX, GPUFN_LEASE_SECONDS."""
        from gpufn.wire import config as c

        per_fn = c.env_int("GPUFN_MAX_QUEUE_PER_FUNCTION", 0)
        policy = c.env_str("GPUFN_EVICTION_POLICY", "cost") or "cost"
        options: dict[str, Any] = {}
        if policy.split(":")[0] == "lru-count":
            options["max_models"] = c.env_int("GPUFN_LRU_MAX_MODELS", 3)
        host = c.env_str("GPUFN_HOST_OFFLOAD_MEMORY")
        return cls(
            token=token,
            slots_per_device=c.env_int("GPUFN_SLOTS", cls.slots_per_device),
            aging_seconds=c.env_float("GPUFN_AGING_SECONDS", cls.aging_seconds),
            heartbeat_timeout=c.env_float("GPUFN_HEARTBEAT_TIMEOUT", cls.heartbeat_timeout),
            client_timeout=c.env_float("GPUFN_CLIENT_TIMEOUT", cls.client_timeout),
            max_queue=c.env_int("GPUFN_MAX_QUEUE", cls.max_queue),
            max_queue_per_function=per_fn or None,
            stop_grace_seconds=c.env_float("GPUFN_STOP_GRACE_SECONDS", cls.stop_grace_seconds),
            gang_settle_seconds=c.env_float("GPUFN_GANG_SETTLE_SECONDS", cls.gang_settle_seconds),
            pipeline_depth=c.env_int("GPUFN_PIPELINE_DEPTH", cls.pipeline_depth),
            pipeline_seconds=c.env_float("GPUFN_PIPELINE_SECONDS", cls.pipeline_seconds),
            eviction_policy=policy,
            eviction_options=options,
            host_offload_bytes=parse_memory(host, "GPUFN_HOST_OFFLOAD_MEMORY") if host else 0,
            max_payload=c.max_payload(),
            state_dir=str(c.state_dir()),
            retry_backoff_seconds=c.env_float("GPUFN_RETRY_BACKOFF", cls.retry_backoff_seconds),
            retry_backoff_max=c.env_float("GPUFN_RETRY_BACKOFF_MAX", cls.retry_backoff_max),
            restart_grace_seconds=c.env_float("GPUFN_RESTART_GRACE", cls.restart_grace_seconds),
            lease_seconds=c.env_float("GPUFN_LEASE_SECONDS", cls.lease_seconds),
            result_retention_seconds=c.env_float("GPUFN_RESULT_RETENTION",
                                                 cls.result_retention_seconds),
            result_store_bytes=parse_memory(c.env_str("GPUFN_RESULT_STORE_MAX", "4GiB"),
                                            "GPUFN_RESULT_STORE_MAX"),
        )


@dataclass
class Counters:
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    retried: int = 0
    timeouts: int = 0
    lost: int = 0
    unschedulable: int = 0
    restarts: int = 0
    rejected: int = 0
    preempted: int = 0
    batches: int = 0
    stale_results: int = 0  # results fenced off: from a lost worker, or an earlier dispatch
    stalls: int = 0  # times the scheduler itself was found not to have run (see `Stalled`)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)
