"""An OpenAI chat model served by continuous batching: a Llama of ~12M parameters built from
a config with seeded weights and a tokenizer trained locally (nothing is downloaded),
behind gpufn's transformers engine, so every call on a device shares each decoding step.
`tiny-llama` is both an OpenAI chat model and a completion model (with log-probabilities:
lm-evaluation-harness's `local-completions` runs against it).

    pip install -e ".[http,examples]"
    gpufn serve --http-port 8000 &
    gpufn deploy examples/llm_openai.py --name llm
    TOKEN=$(python -c 'import json, pathlib; print(json.loads((pathlib.Path.home() / ".gpufn/cluster.json").read_text())["token"])')

    curl -N http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer $TOKEN" \\
      -H "Content-Type: application/json" \\
      -d '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "stream": true, "max_tokens": 16}'

    python -c '
    import os
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=os.environ["TOKEN"])
    print(client.chat.completions.create(model="tiny-llama", max_tokens=16,
          messages=[{"role": "user", "content": "Hello"}]).choices[0].message.content)
    '

Or `python examples/llm_openai.py`, which does all of that itself (a `gpufn serve` in a
temporary home, the deploy, 32 concurrent chats through the `openai` client) and prints
what the batch did.

The engine is a `@gpufn.model`: loaded once per device and shared. `concurrency=32` lets
32 calls run on a device at once; each submits its request with `gpufn.engines.chat_pieces`
and the engine steps them together. `memory=` is what each call holds while it runs: its
sequence's KV cache at full length (1,024 tokens x 6 layers x keys and values x 2 heads x
64 x 4 bytes = 6 MiB).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gpufn
from gpufn.engines import SamplingParams, chat_pieces, completion_pieces

MAX_BATCH = 32


@gpufn.model(memory="64MiB")
def tiny_llama() -> Any:
    """The transformers engine over the seeded tiny Llama (~12M parameters)."""
    from gpufn.engines import TransformersEngine
    from gpufn.engines.testing import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(seed=0, max_positions=1024)
    return TransformersEngine(model.to(gpufn.current_device()), tokenizer, max_batch=MAX_BATCH)


@gpufn.chat_model("tiny-llama")
@gpufn.gpu(models=[tiny_llama], concurrency=MAX_BATCH, memory="8MiB", timeout=600)
def chat(messages: list[dict[str, Any]], max_tokens: int = 16, temperature: float = 0.0,
         top_p: float = 1.0, stop: list[str] | None = None,
         seed: int | None = None) -> Iterator[str | dict[str, Any]]:
    """Chat with the tiny Llama: text pieces as the batch makes them, then the usage."""
    tokenizer = tiny_llama.get().tokenizer
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            stop=tuple(stop or ()), seed=seed)
    yield from chat_pieces(tiny_llama, prompt, params)


@gpufn.completion_model("tiny-llama")
@gpufn.gpu(models=[tiny_llama], concurrency=MAX_BATCH, memory="8MiB", timeout=600)
def complete(prompt: str | list[int], max_tokens: int = 16, temperature: float = 0.0,
             top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None,
             echo: bool = False, logprobs: int | None = None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0,
             logit_bias: dict[str, float] | None = None) -> Iterator[dict[str, Any]]:
    """Complete a prompt (what lm-evaluation-harness asks for log-likelihoods: echo with
    logprobs, max_tokens 0): text, tokens and their logprobs as the batch makes them."""
    params = SamplingParams(max_tokens=max(max_tokens, 1), temperature=temperature,
                            top_p=top_p, stop=tuple(stop or ()), seed=seed, logprobs=logprobs,
                            presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty,
                            logit_bias={int(k): v for k, v in (logit_bias or {}).items()})
    yield from completion_pieces(tiny_llama, prompt, params, echo=echo, max_tokens=max_tokens)


def main() -> None:  # pragma: no cover - a walk-through, checked by the tests
    import concurrent.futures as cf
    import json
    import os
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from openai import OpenAI

    home = Path(tempfile.mkdtemp(prefix="gpufn-llm-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFN_")}
    env["GPUFN_HOME"] = str(home)
    serve = subprocess.Popen([sys.executable, "-m", "gpufn.cli.main", "serve", "--port", "0",
                              "--http-port", "0", "--cpu-devices", "1", "--json"], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        info = json.loads(serve.stdout.readline())
        token = json.loads((home / "cluster.json").read_text())["token"]
        gpufn.connect(info["address"], token=token)
        gpufn.deploy(__file__, name="llm")
        oai = OpenAI(base_url=f"{info['http']}/v1", api_key=token)
        ask = [{"role": "user", "content": "Tell me about GPUs."}]
        first = oai.chat.completions.create(model="tiny-llama", messages=ask, max_tokens=16)
        print("one:", repr(first.choices[0].message.content), first.usage)

        def one(i: int) -> str:
            msgs = [{"role": "user", "content": f"Question {i}: what is a GPU?"}]
            r = oai.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=32)
            return r.choices[0].message.content or ""

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(32) as pool:
            texts = list(pool.map(one, range(32)))
        took = time.perf_counter() - t0
        print(f"32 concurrent chats of 32 tokens in {took:.2f}s "
              f"({32 * 32 / took:.0f} output tokens/s); the first: {texts[0]!r}")
    finally:
        serve.terminate()
        serve.wait(30)


if __name__ == "__main__":
    main()
