"""A caller on an embedded cluster whose GPUFN_SHM_DIR is a nearly full tmpfs: sends big
tensors and bytes (64 MiB and more) and checks every result; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch

import gpufn

MiB = 2**20


@gpufn.gpu
def doubled(t: torch.Tensor) -> torch.Tensor:
    return t * 2


@gpufn.gpu
def both(a: torch.Tensor, b: bytes) -> tuple[float, int, bytes]:
    return float(a.sum()), len(b), b[:4] + b[-4:]


def main() -> None:
    sizes = [int(x) for x in sys.argv[1:]] or [64]
    ok: list[bool] = []
    files_seen = 0
    gpufn.connect()
    for mib in sizes:
        t = torch.ones(mib * MiB // 4, dtype=torch.float32)
        got = doubled.remote(t)
        ok.append(bool(torch.equal(got, t * 2)))
        del got
        # The caller's pooled argument files stay (free, for reuse) after a call: any
        # there shows the tmpfs took some payloads.
        seen = [n for n in os.listdir(os.environ["GPUFN_SHM_DIR"]) if n.startswith("gpufn-")]
        files_seen = max(files_seen, len(seen))
        b = bytes(range(256)) * (mib * MiB // 256)
        s, n, ends = both.remote(t, b)
        ok.append(s == t.numel() and n == len(b) and ends == b[:4] + b[-4:])
    print(json.dumps({"ok": ok, "files_seen": files_seen}), flush=True)


if __name__ == "__main__":
    main()
