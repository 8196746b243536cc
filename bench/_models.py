"""Models, trace and statistics for bench/multimodel.py (pure helpers, no cluster), and
`connect_ready`, the start every bench that drives a cluster shares.

* `plan_models`: N torch MLPs whose sizes are spread log-uniformly over a range (one
  size per log-stratum, jittered, so a short list still covers the whole range), with
  popularity ranks assigned by a seeded shuffle (so popularity is independent of size).
* `write_weights`: each model's seeded weights written once to a safetensors file.
* `make_loader` / `make_model` / `make_function`: a loader that reads the weights from
  that file (as a real model server does: a file read plus tensor construction, no
  random init, no downloads), a `@gpufn.model` over it, and one `@gpufn.gpu` function
  per model running a small forward pass. The loaders and functions are closures, so
  cloudpickle ships them by value (workers never import this module).
* `zipf_trace`: Poisson arrivals (open loop) with Zipf(s) popularity over the ranks.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MiB = 2**20
WIDTHS = (256, 512, 1024, 2048)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    rank: int  # popularity rank, 1 = most popular
    width: int
    layers: int
    seed: int

    @property
    def nbytes(self) -> int:
        """fp32 weights + biases of `layers` Linear(width, width) layers."""
        return self.layers * 4 * (self.width * self.width + self.width)


def _shape_for(target: float) -> tuple[int, int]:
    """(width, layers) of an MLP of about `target` bytes: the widest layer that leaves
    at least two layers (so the forward pass is a real stack), capped at 2048."""
    width = WIDTHS[0]
    for w in WIDTHS:
        if 4 * (w * w + w) * 2 <= target:
            width = w
    per_layer = 4 * (width * width + width)
    return width, max(1, round(target / per_layer))


def model_count_for(pool_bytes: int, ratio: float, min_bytes: float, max_bytes: float) -> int:
    """How many log-uniform models in [min, max] weigh about `ratio` x the pool."""
    mean = (max_bytes - min_bytes) / math.log(max_bytes / min_bytes)
    return max(2, round(ratio * pool_bytes / mean))


def plan_models(n: int, min_bytes: float, max_bytes: float, seed: int) -> list[ModelSpec]:
    """`n` model specs, sizes log-stratified over [min_bytes, max_bytes], ranks shuffled."""
    rng = random.Random(seed)
    lo, hi = math.log(min_bytes), math.log(max_bytes)
    targets = [math.exp(lo + (i + rng.random()) / n * (hi - lo)) for i in range(n)]
    ranks = list(range(1, n + 1))
    rng.shuffle(ranks)
    specs = []
    for i, (target, rank) in enumerate(zip(targets, ranks, strict=True)):
        width, layers = _shape_for(target)
        specs.append(ModelSpec(f"mm{i:02d}", rank, width, layers, seed * 1000 + i))
    return sorted(specs, key=lambda s: s.rank)


def weights_path(spec: ModelSpec, directory: str) -> str:
    return os.path.join(directory, f"{spec.name}.safetensors")


def write_weights(specs: Sequence[ModelSpec], directory: str) -> int:
    """Write each spec's seeded fp32 weights (nn.Linear's init range) to
    `directory/<name>.safetensors`, as keys of an nn.Sequential; returns bytes written."""
    import torch
    from safetensors.torch import save_file

    total = 0
    for spec in specs:
        gen = torch.Generator().manual_seed(spec.seed)
        bound = 1 / math.sqrt(spec.width)
        tensors = {}
        for i in range(spec.layers):
            tensors[f"{i}.weight"] = torch.empty(spec.width, spec.width).uniform_(
                -bound, bound, generator=gen)
            tensors[f"{i}.bias"] = torch.empty(spec.width).uniform_(-bound, bound, generator=gen)
        path = weights_path(spec, directory)
        save_file(tensors, path)
        total += os.path.getsize(path)
    return total


def make_loader(spec: ModelSpec, directory: str, drop_file_cache: bool = False) -> Any:
    """A loader for `spec` that reads its safetensors file into an MLP built on the meta
    device (no init work): one read of the file, page cache permitting. `drop_file_cache`: ask the kernel to drop the file's pages
    first (posix_fadvise DONTNEED), so the read comes from disk, not the page cache."""
    width, layers = spec.width, spec.layers
    path = weights_path(spec, directory)

    def load() -> Any:
        import os

        import torch
        from safetensors.torch import load_file
        from torch import nn

        if drop_file_cache and hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        state = load_file(path)
        if not torch.cuda.is_available():
            # load_file maps the file lazily; copy so the weights are really read into
            # the (simulated) device's memory, as moving them to a GPU would do
            state = {k: v.clone() for k, v in state.items()}
        with torch.device("meta"):
            m = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        m.load_state_dict(state, assign=True)
        return m.eval()

    load.__name__ = load.__qualname__ = f"load_{spec.name}"
    return load


def make_model(spec: ModelSpec, loader: Any) -> Any:
    """A `@gpufn.model` for `spec` over `loader` (estimate = its exact weight bytes)."""
    import gpufn

    return gpufn.model(name=spec.name, memory=spec.nbytes)(loader)


def make_function(model: Any, workspace: str, concurrency: int = 1) -> Any:
    """One `@gpufn.gpu` function per model: a forward pass of `batch` rows of ones."""
    import gpufn

    def infer(batch: int) -> float:
        import torch

        m = model.get()
        with torch.inference_mode():
            y = m(torch.ones(batch, m[0].in_features))
        return float(y[0, 0])

    infer.__name__ = infer.__qualname__ = f"infer_{model.name}"
    return gpufn.gpu(models=[model], memory=workspace, concurrency=concurrency)(infer)


def zipf_trace(n: int, n_models: int, rate: float, s: float, seed: int) -> list[tuple[float, int]]:
    """`n` (arrival seconds, model rank - 1): Poisson(rate) arrivals, Zipf(s) ranks."""
    rng = random.Random(seed)
    cum = []
    total = 0.0
    for k in range(1, n_models + 1):
        total += 1.0 / k**s
        cum.append(total)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, min(bisect.bisect_left(cum, rng.random() * total), n_models - 1)))
    return out


# ---------------------------------------------------------------------------- stats

def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def descendants(root: int) -> set[int]:
    """Pids of every live process below `root` (from /proc; empty off Linux)."""
    parent: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":
            continue
        parent[int(e)] = int(fields[1])
    out: set[int] = set()
    frontier = [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(kids)
        frontier.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def connect_ready(timeout: float = 120.0) -> Any:
    """`gpufn.connect()`, then wait until every device's worker is ready."""
    import gpufn

    client = gpufn.connect()
    deadline = time.monotonic() + timeout
    while any(d["state"] != "ready" for d in client.status()["devices"]):
        if time.monotonic() > deadline:
            raise SystemExit(f"workers did not start within {timeout:.0f}s: "
                             f"{client.status()['devices']}")
        time.sleep(0.1)
    return client
