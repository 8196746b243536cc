"""Data-parallel vision: a ResNet-style model on every device, 2,000 image batches spread
over them with dynamic batching.

    python examples/vision_data_parallel.py [--batches 2000] [--compare]

The model is a `@gpufn.model` (loaded once per device, shared by every call there); the
function is `@gpu(batch_size=32)`, so calls that arrive together run as one forward pass
per device, and `.map` spreads the 2,000 batches over all devices. `--compare` measures
images/s on one worker and on all of them (on the embedded cluster with simulated
devices: two runs with 1 and N devices). The model is built from code with seeded
weights; the same file runs unchanged on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

import gpufn

IMAGES_PER_BATCH = 4


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


def build_resnet(classes: int = 10) -> nn.Module:
    """A small ResNet-18-style network for 32x32 images (stem, 4 stages of basic blocks)."""
    torch.manual_seed(0)
    widths, layers, cin = (16, 32, 64, 128), [], 16
    for i, w in enumerate(widths):
        layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
        cin = w
    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)).eval()


@gpufn.model(memory="128MiB")
def resnet() -> nn.Module:
    return build_resnet()


@gpufn.gpu(models=[resnet], batch_size=32, batch_wait_ms=2, memory="512MiB")
def classify(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Many callers' image batches in one forward pass; one label tensor back per caller."""
    model = resnet.get()
    device = gpufn.current_device()
    with torch.inference_mode():
        logits = model(torch.cat(batches).to(device))
    return list(logits.argmax(-1).cpu().split([b.shape[0] for b in batches]))


def image_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(IMAGES_PER_BATCH, 3, 32, 32, generator=g) for _ in range(n)]


def measure(n: int) -> dict:
    data = image_batches(n)
    classify.remote(data[0])  # the cluster and the model on one device: not timed
    t0 = time.perf_counter()
    labels = list(classify.map(data))
    elapsed = time.perf_counter() - t0
    sample = range(0, n, max(1, n // 16))
    with torch.inference_mode():
        local = build_resnet()
        same = all(torch.equal(labels[i], local(data[i]).argmax(-1)) for i in sample)
    devices = len(gpufn.connect().status()["devices"])
    return {"devices": devices, "images": n * IMAGES_PER_BATCH, "seconds": elapsed,
            "images_per_s": n * IMAGES_PER_BATCH / elapsed, "match_local": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--compare", action="store_true",
                    help="also run on one simulated worker (embedded cluster only)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.batches)))
        return
    runs = []
    if args.compare:  # each run its own embedded cluster: 1 simulated device, then N
        n_all = os.environ.get("GPUFN_CPU_DEVICES", "2")
        for devices in ("1", n_all):
            env = dict(os.environ, GPUFN_CPU_DEVICES=devices)
            out = subprocess.run([sys.executable, __file__, "--batches", str(args.batches), "--json"],
                                 env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    else:
        runs.append(measure(args.batches))
    for r in runs:
        print(f"{r['devices']} worker(s): {r['images']} images in {r['seconds']:.2f} s = "
              f"{r['images_per_s']:.0f} images/s, labels match a local run: {r['match_local']}")
    if len(runs) == 2:
        print(f"speed-up over one worker: {runs[1]['images_per_s'] / runs[0]['images_per_s']:.2f}x")


if __name__ == "__main__":
    main()
