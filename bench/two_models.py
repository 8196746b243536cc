"""Two models on one device, stepped by priority: a high-priority model's inter-token latency
alone, and while a low-priority model runs a full batch beside it, with the engines taking
turns by priority (gpufn's `Arbiter`) and, as the baseline, first come first served. In one
process (what a worker does with two resident engines), the seeded tiny Llama twice.

    python bench/two_models.py [--batch 32] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from typing import Any

from gpufn.engines import SamplingParams
from gpufn.engines.driver import Arbiter, Driver
from gpufn.engines.testing import tiny_model_and_tokenizer
from gpufn.engines.transformers_engine import TransformersEngine


class FirstCome(Arbiter):
    """The baseline: every engine's step at the same priority (first come first served)."""

    def acquire(self, priority: int, owner: object = None) -> None:
        super().acquire(0, owner)

    def release(self, owner: object = None, again: int | None = None) -> None:
        super().release(owner, None if again is None else 0)


def engine(seed: int, batch: int) -> Any:
    model, tokenizer = tiny_model_and_tokenizer(seed=seed)
    return TransformersEngine(model, tokenizer, max_batch=batch)


def itl_ms(driver: Driver, tokens: int, priority: int, tag: str) -> float:
    """Median gap between one request's tokens, in ms."""
    stream = driver.submit(tag, [11, 12, 13, 14, 15, 16, 17, 18],
                           SamplingParams(max_tokens=tokens, ignore_eos=True), priority=priority)
    times = []
    while True:
        with stream.cond:
            while not stream.outputs:
                stream.cond.wait(0.05)
            out = stream.outputs.popleft()
        times.append(time.perf_counter())
        if out.finished:
            break
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]  # after the first token
    return statistics.median(gaps) * 1000


def background(driver: Driver, batch: int, stop: threading.Event, tag: str) -> None:
    """Keep `batch` long low-priority requests running until `stop`."""
    n = 0
    streams = {}
    while not stop.is_set():
        for rid in [r for r, s in streams.items() if s.done]:
            del streams[rid]
        while len(streams) < batch:
            n += 1
            rid = f"{tag}{n}"
            streams[rid] = driver.submit(rid, list(range(20, 36)),
                                         SamplingParams(max_tokens=256, ignore_eos=True))
        time.sleep(0.01)
    for rid in streams:
        driver.cancel(rid)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {"alone": [], "priority": [], "first come": []}
    for r in range(args.repeats):
        for name, arbiter in (("alone", Arbiter()), ("priority", Arbiter()),
                              ("first come", FirstCome())):
            high = Driver(engine(0, 4), arbiter=arbiter)  # fresh engines: no run leaks into the next
            low = Driver(engine(1, args.batch), arbiter=arbiter)
            stop = threading.Event()
            t = threading.Thread(target=background, args=(low, args.batch, stop, f"l{r}{name}"))
            if name != "alone":
                t.start()
                time.sleep(1.0)  # the low model's batch is full and stepping
            rows[name].append(itl_ms(high, args.tokens, 10, f"h{r}{name}"))
            stop.set()
            if t.is_alive():
                t.join()
            time.sleep(0.5)
    alone = statistics.median(rows["alone"])
    for name, vals in rows.items():
        print(f"{name:>10}: high-priority inter-token latency {min(vals):6.1f} / "
              f"{statistics.median(vals):6.1f} ms (min / median)   "
              f"{statistics.median(vals) / alone:5.2f}x alone")
    print(f"\nwith a full low-priority batch beside it: {statistics.median(rows['priority']) / alone:.2f}x"
          f" its latency alone by priority (target <= 2), "
          f"{statistics.median(rows['first come']) / alone:.2f}x first come first served")


if __name__ == "__main__":
    main()
