"""An OpenAI-compatible chat model: a TP=2 sharded Llama behind `POST /v1/chat/completions`.

    pip install -e ".[examples]"          # transformers, the OpenAI client, the gateway
    gpufn serve --http-port 8000 &
    gpufn deploy examples/openai_chat.py --name llm
    TOKEN=$(python -c 'import json, pathlib; print(json.loads((pathlib.Path.home() / ".gpufn/cluster.json").read_text())["token"])')

    curl -N http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer $TOKEN" \\
      -H "Content-Type: application/json" \\
      -d '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "stream": true, "max_tokens": 16}'

    python -c '
    import os
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=os.environ["TOKEN"])
    for chunk in client.chat.completions.create(model="tiny-llama", stream=True,
            messages=[{"role": "user", "content": "Hello"}], max_tokens=16):
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    '

Or `python examples/openai_chat.py`, which does all of that itself (a `gpufn serve` in a
temporary home, the deploy, and both clients) and checks that the streamed text, the
non-streamed answer and `.remote_gen` agree.

`@gpufn.chat_model("tiny-llama")` above `@gpufn.gpu(...)` is all a function needs to be
served as an OpenAI chat model: it yields text pieces (and here, last, a dict with the
token counts, which the gateway reports as `usage`). The model is the seeded Llama of
`examples/llm_service.py` (no download), sharded over a gang of two devices and kept
warm; its "tokenizer" is a toy one: the prompt's UTF-8 bytes in, a made-up word per
generated token out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

import gpufn
from gpufn.parallel import tensor_parallel

CONTEXT = 200  # prompt tokens kept (the model has 256 positions)
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pu", "da", "fe", "go",
              "hi", "ju", "ba"]
WORDS = ["".join(p) for p in itertools.product(_SYLLABLES, repeat=2)]  # 256 words
WORDS += [w + "n" for w in WORDS]  # 512: one per token of the vocabulary


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    text = "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages) + "assistant:"
    return list(text.encode())[-CONTEXT:]


def piece(token: int, first: bool) -> str:
    return ("" if first else " ") + WORDS[token]


def generate(model: torch.nn.Module, messages: list[dict[str, Any]], max_tokens: int = 16,
             temperature: float = 0.0, top_p: float = 1.0, stop: list[str] | None = None,
             seed: int | None = None) -> Iterator[str | dict[str, Any]]:
    """Text pieces one token at a time with the KV cache (greedy at temperature 0, else
    seeded sampling: every rank draws the same token), then the usage."""
    prompt = prompt_ids(messages)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    ids, past, text, n, finish = torch.tensor([prompt], device=device), None, "", 0, "length"
    with torch.no_grad():
        for n in range(1, min(max_tokens, 256 - len(prompt)) + 1):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float().cpu()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, -1)
                if top_p < 1.0:
                    sorted_p, order = probs.sort(descending=True)
                    keep = sorted_p.cumsum(0) - sorted_p < top_p
                    probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
                token = int(torch.multinomial(probs, 1, generator=gen))
            else:
                token = int(logits.argmax())
            ids = torch.tensor([[token]], device=device)
            p = piece(token, n == 1)
            hit = min((i for s in stop or () if (i := (text + p).find(s)) >= 0), default=-1)
            if hit >= 0:  # the stop sequence itself is not returned
                if hit > len(text):
                    yield (text + p)[len(text):hit]
                finish = "stop"
                break
            text += p
            yield p
    yield {"usage": {"prompt_tokens": len(prompt), "completion_tokens": n}, "finish_reason": finish}


@gpufn.model(memory="8MiB", count=2)  # memory is per device
def llama() -> torch.nn.Module:
    return tensor_parallel(build_model().to(gpufn.context().device))  # this rank's shard


@gpufn.chat_model("tiny-llama")
@gpufn.gpu(count=2, models=[llama], timeout=600)
def chat(messages: list[dict[str, Any]], max_tokens: int = 16, temperature: float = 0.0,
         top_p: float = 1.0, stop: list[str] | None = None,
         seed: int | None = None) -> Iterator[str | dict[str, Any]]:
    """Chat with the tiny seeded Llama (TP=2): text pieces, then the token counts."""
    yield from generate(llama.get(), messages, max_tokens, temperature, top_p, stop, seed)


def main() -> None:  # pragma: no cover - a walk-through, checked by the tests
    import json
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from openai import OpenAI

    home = Path(tempfile.mkdtemp(prefix="gpufn-openai-"))
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("GPUFN_")}
    env["GPUFN_HOME"] = str(home)
    serve = subprocess.Popen([sys.executable, "-m", "gpufn.cli.main", "serve", "--port", "0",
                              "--http-port", "0", "--json"], env=env, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert serve.stdout is not None
        info = json.loads(serve.stdout.readline())
        token = json.loads((home / "cluster.json").read_text())["token"]
        gpufn.connect(info["address"], token=token)
        gpufn.deploy(__file__, name="llm")
        print(f"gateway: {info['http']} (dashboard: {info['http']}/)")
        oai = OpenAI(base_url=f"{info['http']}/v1", api_key=token)
        messages = [{"role": "user", "content": "Tell me about GPUs."}]
        t0 = time.perf_counter()
        streamed = []
        for chunk in oai.chat.completions.create(model="tiny-llama", messages=messages,
                                                 max_tokens=16, stream=True):
            streamed.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            print(streamed[-1], end="", flush=True)
        print(f"\n(streamed in {time.perf_counter() - t0:.2f}s)")
        answer = oai.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=16)
        text = "".join(streamed)
        print("non-streamed equals the stream:", answer.choices[0].message.content == text)
        print("usage:", answer.usage)
        pieces = gpufn.lookup("llm", "chat").remote_gen(messages, max_tokens=16)
        print(".remote_gen equals the stream:", "".join(p for p in pieces if isinstance(p, str)) == text)
    finally:
        serve.terminate()
        serve.wait(30)


if __name__ == "__main__":
    main()
