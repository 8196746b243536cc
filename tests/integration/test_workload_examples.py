"""The workload examples run (reduced) and print the right results."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.timeout(400)


def _run(script: str, *args: str, **env: str) -> str:
    full = dict(os.environ, GPUFN_PROGRESS="0", PYTHONPATH=str(ROOT), **env)
    full.pop("GPUFN_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], env=full,
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_llm_evaluation_reruns_from_the_cache() -> None:
    out = _run("llm_evaluation.py", "--prompts", "10")
    assert "run 1: 30 requests, 30 computed, 0 from cache" in out
    assert "run 2: 30 requests, 0 computed, 30 from cache" in out
    assert "run 3 (+2 prompts): 36 requests, 6 computed, 30 from cache" in out
    assert "identical results from cache: True" in out
    saving = float(re.search(r"cache hit saving ([\d.]+)%", out).group(1))
    assert saving > 50


def test_vision_data_parallel_matches_a_local_run() -> None:
    out = _run("vision_data_parallel.py", "--batches", "100")
    m = re.search(r"2 worker\(s\): 400 images in [\d.]+ s = (\d+) images/s, labels match a local run: (\w+)", out)
    assert m, out
    assert int(m.group(1)) > 0 and m.group(2) == "True"


@pytest.mark.slow
def test_vision_compares_with_one_worker() -> None:
    out = _run("vision_data_parallel.py", "--batches", "300", "--compare")
    assert re.search(r"^1 worker\(s\): 1200 images .* match a local run: True$", out, re.M), out
    assert re.search(r"^2 worker\(s\): 1200 images .* match a local run: True$", out, re.M), out
    assert re.search(r"speed-up over one worker: [\d.]+x", out)


def test_distributed_calibration_within_its_error_bound() -> None:
    out = _run("distributed_calibration.py", "--batches", "4")
    assert "quantised 6 linear layers on 2 ranks" in out
    assert "scales equal a single-process calibration: True" in out
    m = re.search(r"relative error of the int8 model vs float: ([\d.]+)% \(bound 3%\): within", out)
    assert m and float(m.group(1)) < 3, out


def test_diffusion_pipeline_matches_a_single_process_run() -> None:
    out = _run("diffusion_pipeline.py", "--prompts", "4", "--steps", "3", "--microbatches", "2",
               GPUFN_CPU_DEVICES="3")
    assert "4 images (3, 32, 32) from 3 pipeline stages, 3 denoising steps, bf16 autocast" in out
    m = re.search(r"max \|difference\| vs a single-process float32 run: ([\d.]+) \(tolerance 0.05\): match", out)
    assert m, out
    assert 0 < float(m.group(1)) <= 0.05  # bf16 made a difference, and a small one
