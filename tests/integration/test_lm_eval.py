"""lm-evaluation-harness against a deployed completion model, as its users run it: the
`local-completions` model over `POST /v1/completions`, a log-likelihood multiple-choice task
and a generation task, both custom task YAMLs over a local JSONL (nothing downloaded: the
tokenizer is the example's own, saved to a folder; HF_*_OFFLINE are set), to completion."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("transformers")
if not any((Path(p) / "lm_eval").is_dir() for p in sys.path if p):
    pytest.skip("lm-evaluation-harness is not installed (pip install -e '.[eval]'); it is "
                "left out of the test extra: its dependencies (datasets, pyarrow, pandas, "
                "scikit-learn, scipy, evaluate, sacrebleu, nltk) add about 600 MB",
                allow_module_level=True)

import gpufn

from .http_served import ServedGateway

pytestmark = pytest.mark.timeout(420)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

MC = [{"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "blue"],
       "answer": 0},
      {"question": "What colour is the sky?", "choices": ["four", "blue"], "answer": 1},
      {"question": "What is two plus two?", "choices": ["four", "Paris", "GPU"], "answer": 0}]
GEN = [{"question": "What runs the model?", "answer": "the GPU"},
       {"question": "What is the capital of Germany?", "answer": "Berlin"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    s = ServedGateway(tmp_path_factory.mktemp("lmeval"))
    s.start()
    try:
        client = s.client()
        try:
            s.wait_ready(client)
            gpufn.deploy(EXAMPLES / "openai_completions.py", name="gpt", client=client)
        finally:
            client.close()
        yield s
    finally:
        s.stop()


def _tasks(folder: Path) -> None:
    (folder / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC))
    (folder / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN))
    (folder / "gpufn_mc.yaml").write_text(f"""task: gpufn_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (folder / "gpufn_gen.yaml").write_text(f"""task: gpufn_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}} A:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_lm_eval_loglikelihood_and_generation_tasks(served: ServedGateway, tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import openai_completions
    finally:
        sys.path.remove(str(EXAMPLES))
    openai_completions.build_tokenizer().save_pretrained(tmp_path / "tokenizer")
    _tasks(tmp_path)
    env = {**os.environ, "OPENAI_API_KEY": served.token, "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    args = (f"model=tiny-gpt2,base_url={served.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tmp_path / 'tokenizer'},num_concurrent=1,max_retries=1,"
            "tokenized_requests=True")
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
         "--tasks", "gpufn_mc,gpufn_gen", "--include_path", str(tmp_path), "--output_path",
         str(tmp_path / "out"), "--log_samples"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    results = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results_*.json")]
    assert results, proc.stdout[-2000:]
    got = results[-1]["results"]
    assert 0.0 <= got["gpufn_mc"]["acc,none"] <= 1.0
    assert 0.0 <= got["gpufn_gen"]["exact_match,none"] <= 1.0
    samples = [json.loads(line) for p in (tmp_path / "out").rglob("samples_gpufn_mc_*.jsonl")
               for line in p.read_text().splitlines()]
    assert len(samples) == len(MC)
    for s in samples:  # every choice scored with a finite log-likelihood from the server
        assert all(math.isfinite(float(r[0][0])) for r in s["resps"]), s["resps"]
