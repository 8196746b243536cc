"""A diffusion-style pipeline over three devices: text encoder, a UNet-like denoiser run
for several steps, and a decoder, one stage per device, in bf16 autocast.

    python examples/diffusion_pipeline.py [--prompts 8] [--steps 10]

`@gpu(count=3)` gives the function a gang of three devices; `gpufn.parallel.pipeline_parallel`
puts one stage on each and streams micro-batches of prompts through them (while the
denoiser works on one micro-batch the encoder already encodes the next).
`@gpu(autocast="bf16")` runs the whole function under `torch.autocast` with no code change
("fp16" is the usual choice on GPUs), and `@gpu(device_args=True)` moves the prompt
tensor to each rank's device. The images match a single-process float32 run within a
bf16 tolerance. On the embedded cluster without GPUs this runs on three simulated
devices (set here when nothing else is configured); the same file runs on GPUs.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

os.environ.setdefault("GPUFN_CPU_DEVICES", "3")  # simulated devices only; GPUs are counted

import gpufn

VOCAB, TOKENS, WIDTH, LATENT, SIZE = 512, 16, 64, 4, 16
TOLERANCE = 0.05  # max |difference| of pixels in [-1, 1], bf16 vs float32


class TextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(tokens)).mean(dim=1)  # [B, WIDTH]


class Denoiser(nn.Module):
    """A tiny conditioned UNet (down, middle, up with a skip), applied `steps` times."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.register_buffer("noise", torch.randn(LATENT, SIZE, SIZE))
        self.down = nn.Conv2d(LATENT, 32, 3, 2, 1)
        self.mid = nn.Conv2d(32, 32, 3, 1, 1)
        self.film = nn.Linear(WIDTH, 64)
        self.up = nn.ConvTranspose2d(32, 32, 4, 2, 1)
        self.out = nn.Conv2d(32 + LATENT, LATENT, 3, 1, 1)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        latent = self.noise.expand(text.shape[0], -1, -1, -1)
        scale, shift = self.film(text)[:, :, None, None].chunk(2, dim=1)
        for _ in range(self.steps):
            h = torch.relu(self.down(latent))
            h = torch.relu(self.mid(h) * (1 + scale) + shift)
            eps = self.out(torch.cat([torch.relu(self.up(h)), latent], dim=1))
            latent = latent - 0.1 * eps
        return latent


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.ConvTranspose2d(LATENT, 16, 4, 2, 1), nn.ReLU(),
                                 nn.Conv2d(16, 3, 3, 1, 1), nn.Tanh())

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.net(latent)  # [B, 3, 2*SIZE, 2*SIZE]


def build_pipeline(steps: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(TextEncoder(), Denoiser(steps), Decoder()).eval()


@gpufn.gpu(count=3, autocast="bf16", device_args=True, timeout=600)
def generate(tokens: torch.Tensor, steps: int, microbatches: int) -> torch.Tensor:
    from gpufn.parallel import pipeline_parallel

    ctx = gpufn.context()
    assert tokens.device == torch.device(ctx.device)  # moved by device_args=True
    pipe = pipeline_parallel(build_pipeline(steps).to(ctx.device), stages=3,
                             microbatches=microbatches)
    return pipe(tokens).float().cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    tokens = torch.randint(0, VOCAB, (args.prompts, TOKENS), generator=torch.Generator().manual_seed(3))
    images = generate.remote(tokens, args.steps, args.microbatches)
    with torch.no_grad():
        single = build_pipeline(args.steps)(tokens)  # one process, float32
    diff = float((images - single).abs().max())
    print(f"{args.prompts} images {tuple(images.shape[1:])} from 3 pipeline stages, "
          f"{args.steps} denoising steps, bf16 autocast")
    print(f"max |difference| vs a single-process float32 run: {diff:.4f} (tolerance {TOLERANCE}): "
          f"{'match' if diff <= TOLERANCE else 'MISMATCH'}")


if __name__ == "__main__":
    main()
