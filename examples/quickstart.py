"""gpufn quickstart: decorate, call remotely, map, spawn — on the embedded local cluster.

    python examples/quickstart.py

No server to start: the first call starts a local scheduler and one worker per GPU
(or simulated CPU devices where there is none) and stops them when the script ends.
"""

from __future__ import annotations

import torch

import gpufn
from gpufn import gpu


@gpu(memory="2GiB")
def square(x: int) -> int:
    return x * x


@gpu(memory="1GiB", timeout=60)
def classify(batch: torch.Tensor) -> torch.Tensor:
    """A small seeded torch model on the worker's own device."""
    device = gpufn.context().device
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(device).eval()
    print(f"classifying {len(batch)} rows on {device}")
    with torch.no_grad():
        return model(batch.to(device)).argmax(dim=1).cpu()


def main() -> None:
    print(square.remote(7))                     # 49, ran in a worker process
    print(sum(square.map(range(1000))))         # ordered results: 332833500
    call = square.spawn(3)
    print(call.get(timeout=10))                 # 9

    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    labels = list(classify.map(batches))
    print([t.tolist() for t in labels])

    try:
        square.with_options(memory="1TiB").remote(1)
    except gpufn.Unschedulable as e:
        print(f"as expected, too big: {str(e)[:70]}...")


if __name__ == "__main__":
    main()
