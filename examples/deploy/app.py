"""A small app to deploy once and call from anywhere, without its source:

    gpufn serve &                                   # the head (or use an existing one)
    gpufn deploy examples/deploy/app.py --name demo
    python -c 'import gpufn; print(gpufn.lookup("demo", "similarity").remote("gpu", "gpus"))'

`textfeatures` is a local module: it travels with the app, pickled by value, so worker
hosts need neither file. The encoder is built from a config with seeded weights.
"""

from __future__ import annotations

import time

import textfeatures
import torch

import gpufn


@gpufn.model(memory="256MiB")
def encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(textfeatures.DIM, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 16)).eval()


@gpufn.gpu(models=[encoder])
def embed(text: str) -> list[float]:
    """A 16-number embedding of `text` (the model stays resident between calls)."""
    model = encoder.get()
    device = next(model.parameters()).device
    with torch.no_grad():
        x = torch.tensor([textfeatures.features(text)], device=device)
        return model(x)[0].cpu().tolist()


@gpufn.gpu
def similarity(a: str, b: str) -> float:
    """Cosine similarity of two texts; its embed calls stay on this app version."""
    ea, eb = torch.tensor(embed.remote(a)), torch.tensor(embed.remote(b))
    score = float(torch.nn.functional.cosine_similarity(ea, eb, dim=0))
    print(f"similarity({a!r}, {b!r}) = {score:.3f}")
    return score


@gpufn.gpu
def slow_square(x: int, seconds: float = 1.0) -> int:
    """A stand-in for real work, to watch progress (and Ctrl-C) in a notebook."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
    return x * x
