"""One rank of a TP=2 gang (gloo, real processes) stepping a sharded tiny Llama's engine
in lockstep: concurrent requests enter on rank 0 (their twins on rank 1, at other times),
and rank 0's texts go back to the test."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpufn.engines import SamplingParams
from gpufn.engines import driver as engine_driver

SMALL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
# prompt, max_tokens, stop, when it arrives on rank 0 and on rank 1 (s)
REQUESTS = [("The quick brown fox", 12, (), 0.0, 0.3), ("Hello! How are", 20, (), 0.05, 0.0),
            ("Numbers: 0 1 2", 6, (), 0.1, 0.2), ("Models are loaded once", 16, (" the",), 0.0, 0.1),
            ("To be or not", 24, (), 0.2, 0.0), ("def add(a, b):", 14, ("\n",), 0.15, 0.4),
            ("Call me Ishmael.", 9, (), 0.3, 0.05), ("Water boils at", 18, (), 0.25, 0.25)]


def build(tp: bool) -> Any:
    from gpufn.engines import TransformersEngine
    from gpufn.engines.testing import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(seed=0, **SMALL)
    if tp:
        from gpufn.parallel import tensor_parallel

        model = tensor_parallel(model)
    return TransformersEngine(model, tokenizer, max_batch=8)


def params(n: int, stop: tuple[str, ...]) -> SamplingParams:
    return SamplingParams(max_tokens=n, stop=stop, ignore_eos=True)


def rank_main(rank: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A gang out of step fails in a minute instead of waiting 30 for its peer.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        engine = build(True)
        from gpufn.engines.lockstep import lockstep_driver

        driver = engine_driver._drivers[engine] = lockstep_driver(engine, rank)
        texts: dict[int, str] = {}

        def one(i: int) -> None:
            prompt, n, stop, at0, at1 = REQUESTS[i]
            time.sleep(at0 if rank == 0 else at1)
            texts[i] = "".join(engine_driver.text(engine, prompt, params(n, stop),
                                                  request_id=f"r{i}"))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(REQUESTS))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 150
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        deadline = time.monotonic() + 60  # the gang at rest before its group goes
        while time.monotonic() < deadline and (
                driver._thread is not None if rank else not getattr(driver, "resting", False)):
            time.sleep(0.01)
        out.put((rank, [texts.get(i) for i in range(len(REQUESTS))], driver.steps))
    finally:
        dist.destroy_process_group()


def rank_dies(rank: int, port: int, out: Any) -> None:
    """Rank 1 dies mid-generation: rank 0's request must fail, not wait for ever."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    engine = build(True)
    from gpufn.engines.lockstep import lockstep_driver

    driver = engine_driver._drivers[engine] = lockstep_driver(engine, rank)
    got: list[str] = []
    try:
        for piece in engine_driver.text(engine, "The quick brown fox", params(500, ()),
                                        request_id="r"):
            got.append(piece)
            if rank == 1 and driver.steps >= 10:
                os._exit(17)  # mid-generation, without a word to rank 0
        out.put((rank, "finished", len(got)))
    except engine_driver.RequestFailed as e:
        out.put((rank, str(e), len(got)))
    out.close()
    out.join_thread()  # sent before the exit below
    os._exit(0)  # the group's peer is gone: no orderly teardown
