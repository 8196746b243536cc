"""The sharded step loop (issue 31 item 5): a tiny Llama sharded over a 2-rank gang
(tensor parallel over gloo, two real processes) stepped in lockstep, requests entering on
rank 0 at different steps: each step is one collective forward on both ranks, and every
request's greedy text equals the single-device engine's (run alone)."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

from gpufn.engines import driver as engine_driver

from ._lockstep_ranks import REQUESTS, build, params, rank_dies, rank_main

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_sharded_engine_steps_in_lockstep_and_equals_the_single_device_one() -> None:
    alone = []
    engine = build(False)
    for prompt, n, stop, _, _ in REQUESTS:
        alone.append("".join(engine_driver.text(engine, prompt, params(n, stop))))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (texts, steps)) for r, texts, steps in (out.get(timeout=280) for _ in procs))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    texts, steps = got[0]
    assert texts == alone
    assert got[1][0] == alone  # rank 1's twins ended with the same outputs (discarded in a gang)
    assert got[1][1] == steps  # one step on each rank for each step of the gang
    tokens = sum(n for _, n, _, _, _ in REQUESTS)
    assert steps < tokens / 2, f"{steps} steps for {tokens} tokens: the requests did not share steps"


def test_a_gang_call_streams_its_sharded_engines_text_from_rank_0() -> None:
    """Through gpufn: a generator on a 2-device gang over the TP-sharded engine model; each
    call's request enters rank 0's lockstep, both ranks step it, rank 0's text streams."""
    from ..conftest import cluster_with
    from .lockstep_funcs import lockstep_steps, sharded_complete

    engine = build(False)
    chosen = REQUESTS[:3]
    alone = ["".join(engine_driver.text(engine, p, params(n, stop))) for p, n, stop, _, _ in chosen]
    with cluster_with(GPUFN_CPU_DEVICES=2):
        got = ["".join(sharded_complete.remote_gen(p, n, stop)) for p, n, stop, _, _ in chosen]
        steps = lockstep_steps.remote()
    assert got == alone
    assert [name for name, _ in steps] == ["Leader", "Follower"]
    assert steps[0][1] == steps[1][1] > 0  # every step on both ranks


def test_a_rank_that_dies_fails_rank_0s_requests_instead_of_hanging() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_dies, args=(r, _free_port() if r < 0 else port, out))
             for port in [_free_port()] for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, why, pieces = out.get(timeout=200)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
    assert rank == 0 and pieces >= 5, (rank, why, pieces)
    assert "lockstep failed" in why, why
    assert procs[1].exitcode == 17
