"""Settings read from the environment (GPUFN_*), in one place, with their defaults."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from pathlib import Path

from gpufn.exceptions import InvalidSpec
from gpufn.wire.units import parse_memory

DEFAULT_PORT = 7555


def env_str(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return v if v not in (None, "") else default


def env_int(name: str, default: int) -> int:
    v = env_str(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise InvalidSpec(f"{name}={v!r} must be an integer.") from None


def env_float(name: str, default: float) -> float:
    v = env_str(name)
    if v is None:
        return default
    try:
        return float(v)
    except ValueError:
        raise InvalidSpec(f"{name}={v!r} must be a number.") from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_bool(name: str, default: bool) -> bool:
    """A yes/no setting: 1/0, true/false, yes/no or on/off (any case); unset means `default`."""
    v = env_str(name)
    if v is None:
        return default
    if v.strip().lower() in _TRUE:
        return True
    if v.strip().lower() in _FALSE:
        return False
    raise InvalidSpec(f"{name}={v!r} must be 1 or 0 (or true/false, yes/no, on/off).")


def env_positive_int(name: str, default: int) -> int:
    n = env_int(name, default)
    if n < 1:
        raise InvalidSpec(f"{name}={n} must be at least 1.")
    return n


def address() -> str | None:
    """GPUFN_ADDRESS: the scheduler to connect to; unset means the embedded local cluster."""
    return env_str("GPUFN_ADDRESS")


def token() -> str | None:
    """GPUFN_TOKEN: the cluster's shared secret; unset (or empty) means none."""
    return env_str("GPUFN_TOKEN")


def cpu_devices() -> int:
    """GPUFN_CPU_DEVICES: simulated devices where no GPU is found (default 2)."""
    return env_positive_int("GPUFN_CPU_DEVICES", 2)


def cpu_islands() -> int:
    """GPUFN_CPU_ISLANDS: groups the simulated devices are split into, as if on separate
    interconnects (default 1)."""
    return env_positive_int("GPUFN_CPU_ISLANDS", 1)


def force_cpu() -> bool:
    """GPUFN_FORCE_CPU: simulate CPU devices even where GPUs are found (default off)."""
    return env_bool("GPUFN_FORCE_CPU", False)


def device_memory() -> int:
    """GPUFN_DEVICE_MEMORY: capacity of each simulated device (default 8GiB)."""
    return parse_memory(env_str("GPUFN_DEVICE_MEMORY", "8GiB"), "GPUFN_DEVICE_MEMORY")


def node_id() -> str:
    """GPUFN_NODE_ID: this host's name in device keys ("node:index")."""
    return env_str("GPUFN_NODE_ID") or socket.gethostname()


def high_water_mark() -> int:
    """GPUFN_HWM: ZeroMQ send/receive high-water marks (messages) on every gpufn socket."""
    return env_int("GPUFN_HWM", 100_000)


_max_payload: tuple[str | None, int] = ("", 0)  # (the setting, its value): read per call


def max_payload() -> int:
    """GPUFN_MAX_PAYLOAD: the largest argument or result payload a call may carry, and the
    largest message the scheduler accepts (default 2GiB; e.g. 512MiB)."""
    global _max_payload
    raw = env_str("GPUFN_MAX_PAYLOAD", "2GiB")
    if raw == _max_payload[0]:
        return _max_payload[1]
    n = parse_memory(raw, "GPUFN_MAX_PAYLOAD")
    if n < 1:
        raise InvalidSpec(f"GPUFN_MAX_PAYLOAD={n} must be at least 1 byte.")
    _max_payload = (raw, n)
    return n


def log_level() -> str:
    """GPUFN_LOG_LEVEL: level of gpufn's own logs, e.g. INFO or DEBUG (default WARNING)."""
    level = (env_str("GPUFN_LOG_LEVEL", "WARNING") or "WARNING").strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise InvalidSpec(f"GPUFN_LOG_LEVEL={level!r} must be a logging level: "
                          "DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    return level


def log_dir() -> Path:
    """GPUFN_LOG_DIR: where workers' output goes (default: `logs/` in the state dir, so a
    cluster's logs stay with its state; an embedded cluster's state dir is its own)."""
    d = env_str("GPUFN_LOG_DIR")
    return Path(d) if d else state_dir() / "logs"


def worker_log_file(node: str, index: int) -> Path:
    """The one file a worker's output goes to: `worker-<node>-<index>.log` in `log_dir()`."""
    return log_dir() / f"worker-{node}-{index}.log"


def runtime_dir() -> Path:
    """This user's folder for sockets and embedded clusters' state ($TMPDIR/gpufn-$UID)."""
    return Path(tempfile.gettempdir()) / f"gpufn-{os.getuid()}"


def worker_host_memory() -> int | None:
    """GPUFN_WORKER_HOST_MEMORY: host memory (RAM) each worker of this host may use, its
    children's included, e.g. 32GiB; over it the supervisor stops and replaces the worker
    (0: not watched). Unset: 80% of the host's memory (or its cgroup's limit) split between
    its workers. `gpufn serve/worker --worker-host-memory` sets it too."""
    v = env_str("GPUFN_WORKER_HOST_MEMORY")
    return None if v is None else parse_memory(v, "GPUFN_WORKER_HOST_MEMORY")


def give_up_retry_seconds() -> float:
    """GPUFN_GIVE_UP_RETRY: seconds a supervisor waits before trying a device again after
    its worker failed to start several times in a row (default 60)."""
    return env_float("GPUFN_GIVE_UP_RETRY", 60.0)


def print_call_output() -> bool:
    """GPUFN_PRINT_CALL_OUTPUT: whether a client prints what its calls print (default yes).
    `gpufn serve` turns it off for its HTTP gateway: its callers' output is theirs (kept for
    `gpufn logs`), not the server log's."""
    return env_bool("GPUFN_PRINT_CALL_OUTPUT", True)


def head_grace() -> float:
    """GPUFN_HEAD_GRACE: seconds a head restart may take (default 60). Clients keep their
    calls while the scheduler is away this long, then fail them with ConnectionLost; the
    supervisor `gpufn serve` started keeps its workers this long for the next `gpufn
    serve` to adopt. GPUFN_CONNECTION_TIMEOUT is the older name of the same setting."""
    name = "GPUFN_HEAD_GRACE" if env_str("GPUFN_HEAD_GRACE") else "GPUFN_CONNECTION_TIMEOUT"
    grace = env_float(name, 60.0)
    if grace <= 0:
        raise InvalidSpec(f"{name}={grace:g} must be a positive number of seconds.")
    return grace


def held_result_bytes() -> int:
    """GPUFN_HELD_RESULTS: payload bytes of its latest Results a worker keeps to hand to
    a restarted scheduler (default 64MiB; the ids of its last 10,000 calls are kept)."""
    return parse_memory(env_str("GPUFN_HELD_RESULTS", "64MiB"), "GPUFN_HELD_RESULTS")


def scheduler_log() -> Path | None:
    """GPUFN_SCHEDULER_LOG: a file the scheduler also writes its log to (default: none,
    stderr only)."""
    v = env_str("GPUFN_SCHEDULER_LOG")
    return Path(v) if v else None


def home() -> Path:
    """GPUFN_HOME: where `gpufn serve` leaves its address and token (default ~/.gpufn)."""
    d = env_str("GPUFN_HOME")
    return Path(d) if d else Path.home() / ".gpufn"


def cache_dir() -> Path:
    """GPUFN_CACHE_DIR: where `@gpu(cache=True)` keeps results (default GPUFN_HOME/cache);
    put it on a shared filesystem to share results between hosts."""
    d = env_str("GPUFN_CACHE_DIR")
    return Path(d) if d else home() / "cache"


def state_dir() -> Path:
    """GPUFN_STATE_DIR: where the scheduler keeps what must survive a restart (deployments,
    CURVE keys in `keys/`) and `gpufn serve --detach` its pid and log files (default:
    GPUFN_HOME)."""
    d = env_str("GPUFN_STATE_DIR")
    return Path(d) if d else home()


def metrics_port() -> int | None:
    """GPUFN_METRICS_PORT: serve Prometheus metrics from the scheduler on this port
    (unset: off; 0 picks a free port)."""
    v = env_str("GPUFN_METRICS_PORT")
    return None if v is None else env_int("GPUFN_METRICS_PORT", 0)


def http_metrics_dir() -> Path | None:
    """GPUFN_HTTP_METRICS_DIR: where the HTTP gateway writes its request metrics
    (prometheus-client's multiprocess files) for the scheduler's metrics endpoint to
    serve; `gpufn serve --http-port --metrics-port` sets it (unset: none)."""
    v = env_str("GPUFN_HTTP_METRICS_DIR")
    return Path(v) if v else None


def http_client_idle() -> float:
    """GPUFN_HTTP_CLIENT_IDLE: seconds the HTTP gateway keeps the scheduler connection
    of a token that has no call in flight (default 300)."""
    return env_float("GPUFN_HTTP_CLIENT_IDLE", 300.0)


def http_body_budget() -> int:
    """GPUFN_HTTP_BODY_BUDGET: the bytes of request bodies the HTTP gateway reads and
    parses at once, all requests together; past it a request is answered 503 with
    Retry-After (default: GPUFN_MAX_PAYLOAD, the largest one body may be)."""
    raw = env_str("GPUFN_HTTP_BODY_BUDGET")
    if not raw:
        return max_payload()
    n = parse_memory(raw, "GPUFN_HTTP_BODY_BUDGET")
    if n < 1:
        raise InvalidSpec(f"GPUFN_HTTP_BODY_BUDGET={raw} must be at least 1 byte.")
    return n


def http_read_timeout() -> float:
    """GPUFN_HTTP_READ_TIMEOUT: seconds the HTTP gateway waits for a client's request
    headers, or for the next piece of its body, before it closes the connection
    (default 30)."""
    v = env_float("GPUFN_HTTP_READ_TIMEOUT", 30.0)
    if not v > 0:
        raise InvalidSpec(f"GPUFN_HTTP_READ_TIMEOUT={v} must be a positive number of seconds.")
    return v


def curve_forced() -> bool:
    """GPUFN_CURVE: 1 encrypts with CURVE even on a loopback bind (off loopback it always
    is); default off."""
    return env_bool("GPUFN_CURVE", False)


def client_key_file() -> Path | None:
    """GPUFN_CLIENT_KEY: a CURVE secret key file this process presents to the scheduler
    (one listed in its --allow-keys folder); unset means a fresh key pair per process."""
    v = env_str("GPUFN_CLIENT_KEY")
    return Path(v).expanduser() if v else None


def embedded_transport() -> str:
    """GPUFN_EMBEDDED_TRANSPORT: how this process reaches its embedded cluster, "ipc"
    (a Unix socket, the default) or "tcp" (loopback)."""
    v = (env_str("GPUFN_EMBEDDED_TRANSPORT", "ipc") or "ipc").strip().lower()
    if v not in ("ipc", "tcp"):
        raise InvalidSpec(f"GPUFN_EMBEDDED_TRANSPORT={v!r} must be ipc or tcp.")
    return v


def dist_backend() -> str | None:
    """GPUFN_DIST_BACKEND: the torch.distributed backend for gangs, e.g. gloo; unset means
    nccl on GPUs and gloo on CPU devices."""
    v = env_str("GPUFN_DIST_BACKEND")
    return v.strip() if v and v.strip() else None


def progress_enabled() -> bool:
    """GPUFN_PROGRESS: 0 hides `.map` progress bars; 1 (the default) shows them where
    output is a terminal or a notebook."""
    return env_bool("GPUFN_PROGRESS", True)


def map_window() -> int:
    """GPUFN_MAP_WINDOW: calls one `.map()` keeps in flight (default 4096)."""
    return env_positive_int("GPUFN_MAP_WINDOW", 4096)


def shm_threshold() -> int | None:
    """GPUFN_SHM_THRESHOLD: tensors and bytes at least this large travel through shared
    memory (/dev/shm) when caller and worker share a host and user (default 64MiB;
    0 turns it off, and every payload goes through the sockets)."""
    global _SHM_THRESHOLD
    raw = env_str("GPUFN_SHM_THRESHOLD", "64MiB")
    if _SHM_THRESHOLD[0] == raw:  # read for every call's result: parsed once per setting
        return _SHM_THRESHOLD[1]
    n = parse_memory(raw, "GPUFN_SHM_THRESHOLD")
    value = n if n > 0 else None
    _SHM_THRESHOLD = (raw, value)
    return value


_SHM_THRESHOLD: tuple[str | None, int | None] = (None, None)  # the setting last parsed, its value


SHM_DIR_DEFAULT = "/dev/shm"


def shm_dir() -> str:
    """GPUFN_SHM_DIR: the folder of same-host payload files (default /dev/shm). A tmpfs of
    its own bounds their memory; every process of a host (clients, workers, `gpufn serve`,
    `gpufn worker`) must be given the same one, else big payloads go through the sockets."""
    raw = env_str("GPUFN_SHM_DIR", SHM_DIR_DEFAULT)
    assert raw is not None
    if not os.path.isabs(raw):
        raise InvalidSpec(f"GPUFN_SHM_DIR={raw!r} must be an absolute path (a tmpfs folder, "
                          "e.g. /dev/shm).")
    return os.path.normpath(raw)


def shm_pool_bytes() -> int:
    """GPUFN_SHM_POOL: how many bytes of shared-memory argument files a caller keeps,
    already written once, to reuse for its next calls' big arguments (default 1GiB; 0
    keeps none, and each call's arguments get new files). Idle files go after 30 s."""
    raw = env_str("GPUFN_SHM_POOL", "1GiB")
    return parse_memory(raw, "GPUFN_SHM_POOL")


KEY_PARAM = "?key="
_Z85_KEY_LEN = 40


def split_address(addr: str) -> tuple[str, str | None]:
    """'tcp://host:port?key=<z85 public key>' -> ('tcp://host:port', key); no key -> None.

    The one place a scheduler address is taken apart. The key is everything after the
    first '?key=' (Z85 text may itself contain '?', '&', '=' or ':'); it must be 40 chars.
    """
    endpoint, sep, key = addr.partition(KEY_PARAM)
    if not sep:
        if "?" in addr:
            raise InvalidSpec(f"address {addr!r}: the only option is ?key=<server public key>.")
        return addr, None
    if len(key) != _Z85_KEY_LEN:
        raise InvalidSpec(f"address {addr!r}: ?key= must be the scheduler's 40-character Z85 "
                          "public key, as `gpufn serve` printed it.")
    return endpoint, key


def join_address(endpoint: str, key: str | None) -> str:
    return f"{endpoint}{KEY_PARAM}{key}" if key else endpoint


def normalize_address(addr: str) -> str:
    """'host:port' or 'tcp://host:port' -> 'tcp://host:port' (a ?key= suffix is kept)."""
    if not isinstance(addr, str) or not addr.strip():
        raise InvalidSpec(f"address {addr!r}: write a scheduler address as tcp://HOST:PORT.")
    endpoint, key = split_address(addr.strip())
    if "://" not in endpoint:
        endpoint = (f"tcp://{endpoint}:{DEFAULT_PORT}" if ":" not in endpoint
                    else f"tcp://{endpoint}")
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidSpec(f"address {addr!r}: write it as tcp://HOST:PORT, e.g. "
                              f"tcp://127.0.0.1:{DEFAULT_PORT} (as `gpufn serve` printed it).")
    elif scheme not in ("ipc", "inproc") or not rest:
        raise InvalidSpec(f"address {addr!r}: gpufn schedulers speak ZeroMQ, not {scheme}://; "
                          f"write it as tcp://HOST:PORT, e.g. tcp://127.0.0.1:{DEFAULT_PORT} "
                          "(as `gpufn serve` printed it).")
    return join_address(endpoint, key)


def address_host(addr: str) -> str:
    """The host part of a tcp:// address ('' for ipc and others), without brackets."""
    endpoint, _ = split_address(addr)
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
