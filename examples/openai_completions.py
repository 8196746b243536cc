"""An OpenAI completion (and chat) model with log-probabilities: `tiny-gpt2` behind
`POST /v1/completions` and `POST /v1/chat/completions`.

    pip install -e ".[examples]"          # transformers, the OpenAI client, the gateway
    gpufn serve --http-port 8000 &
    gpufn deploy examples/openai_completions.py --name gpt
    TOKEN=$(python -c 'import json, pathlib; print(json.loads((pathlib.Path.home() / ".gpufn/cluster.json").read_text())["token"])')

    curl -s http://127.0.0.1:8000/v1/completions -H "Authorization: Bearer $TOKEN" \\
      -H "Content-Type: application/json" \\
      -d '{"model": "tiny-gpt2", "prompt": "The GPU", "echo": true, "max_tokens": 0, "logprobs": 1}'

The last request is what lm-evaluation-harness sends to score a multiple-choice answer: the
prompt's own tokens come back with their log-probabilities (`token_logprobs`, null for the
first token) and the most likely alternative at each position (`top_logprobs`).

This is the reference completion function of docs/api.md ("OpenAI models"): a GPT-2 built
from a config with seeded weights and a byte-level BPE tokenizer trained here on a few
sentences (nothing is downloaded), generating with a plain full forward per token and
computing log-probabilities with `log_softmax`. It declares the OpenAI parameters it
handles by its signature (`max_tokens`, `temperature`, `stop`, `seed`, `echo`,
`logprobs`); a request that sets any other (`logit_bias`, say) is refused with a 400
naming it. The batched engine (gpufn/engines) serves the same contract with one shared step
per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import gpufn

CONTEXT = 256
CORPUS = [
    "The GPU runs the model and the scheduler decides which device runs which call.",
    "A small model answers quickly; a large model is sharded over a gang of devices.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Question: what is two plus two? Answer: four. Question: what colour is the sky? "
    "Answer: blue.",
    "user: Hello! assistant: Hello, how can I help you today?",
] * 4


_BUILT: dict[str, Any] = {}  # per process: a by-value function keeps no lru_cache


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on CORPUS (deterministic, no download), as a
    transformers tokenizer (`save_pretrained` gives lm-evaluation-harness a local copy)."""
    if "tok" not in _BUILT:
        from tokenizers import ByteLevelBPETokenizer
        from transformers import PreTrainedTokenizerFast

        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(CORPUS, vocab_size=384, min_frequency=2, show_progress=False,
                                special_tokens=["<|endoftext|>"])
        _BUILT["tok"] = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                                eos_token="<|endoftext|>")
    return _BUILT["tok"]


def build_model(vocab_size: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=CONTEXT, n_embd=64, n_layer=2,
                        n_head=4, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config).eval()


def _top(logp: torch.Tensor, k: int, tok: Any) -> dict[str, float]:
    values, ids = logp.topk(k)
    return {tok.decode([int(i)]): float(v) for v, i in zip(values, ids, strict=True)}


def _item(tok: Any, ids: list[int], logps: list[float | None],
          tops: list[dict[str, float] | None], logprobs: int | None) -> dict[str, Any]:
    text = tok.decode(ids)
    if logprobs is None:
        return {"text": text}
    return {"text": text, "tokens": [tok.decode([i]) for i in ids], "token_logprobs": logps,
            "top_logprobs": tops}


def _held(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` may begin a stop string (held back until
    the next token says whether they do)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def complete_ids(model: torch.nn.Module, tok: Any, prompt: list[int], max_tokens: int = 16,
                 temperature: float = 0.0, stop: list[str] | None = None,
                 seed: int | None = None, echo: bool = False,
                 logprobs: int | None = None) -> Iterator[dict[str, Any]]:
    """The completion contract over token ids: the echoed prompt (with its logprobs), then
    one item per generated token, then the finish reason and usage."""
    device = next(model.parameters()).device
    ids = list(prompt[-CONTEXT:]) or [tok.eos_token_id]
    k, base = max(1, logprobs or 0), 0
    with torch.no_grad():
        if echo:
            logp = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0].float(), -1)
            lps: list[float | None] = [None] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
            tops: list[dict[str, float] | None] = [None] + [_top(logp[i - 1], k, tok)
                                                            for i in range(1, len(ids))]
            item = _item(tok, ids, lps, tops, logprobs)
            base = len(item["text"])
            yield item
        n, finish = 0, "length"
        for n, item in enumerate(_tokens(model, tok, ids, max_tokens, temperature, seed, k,
                                         logprobs, base, stop or []), 1):
            yield item
            if item.get("finish_reason"):
                n, finish = n - 1, "stop"
                break
    yield {"finish_reason": finish,
           "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}}


def _tokens(model: torch.nn.Module, tok: Any, ids: list[int], max_tokens: int,
            temperature: float, seed: int | None, k: int, logprobs: int | None, base: int,
            stops: list[str]) -> Iterator[dict[str, Any]]:
    """One item per generated token (its text held back while it may begin a stop string);
    at a stop string, the text before it and `finish_reason: stop`."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    full, sent = "", 0
    for _ in range(min(max_tokens, CONTEXT - len(ids))):
        last = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0, -1]
                                 .float().cpu(), -1)
        if temperature > 0:
            token = int(torch.multinomial(torch.softmax(last / temperature, -1), 1,
                                          generator=gen))
        else:
            token = int(last.argmax())
        ids.append(token)
        item = _item(tok, [token], [float(last[token])], [_top(last, k, tok)], logprobs)
        if logprobs is not None:
            item["text_offset"] = [base + len(full)]
        full += tok.decode([token])
        hit = min((i for s in stops if (i := full.find(s)) >= 0), default=-1)
        if hit >= 0:  # the stop string itself is not returned
            yield {"text": full[sent:hit], "finish_reason": "stop"}
            return
        safe = len(full) - _held(full, stops)
        item["text"], sent = full[sent:safe], safe
        yield item
    if sent < len(full):
        yield {"text": full[sent:]}


@gpufn.model(memory="64MiB")
def gpt2() -> torch.nn.Module:
    return build_model(len(build_tokenizer())).to(gpufn.current_device())


@gpufn.completion_model("tiny-gpt2")
@gpufn.gpu(models=[gpt2], timeout=600)
def complete(prompt: str | list[int], max_tokens: int = 16, temperature: float = 0.0,
             stop: list[str] | None = None, seed: int | None = None, echo: bool = False,
             logprobs: int | None = None) -> Iterator[dict[str, Any]]:
    """Complete one prompt (text or token ids): text pieces with their tokens and
    log-probabilities when asked, the echoed prompt first when asked, then the usage."""
    tok = build_tokenizer()
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    yield from complete_ids(gpt2.get(), tok, ids, max_tokens, temperature, stop, seed, echo,
                            logprobs)


@gpufn.chat_model("tiny-gpt2")
@gpufn.gpu(models=[gpt2], timeout=600)
def chat(messages: list[dict[str, Any]], max_tokens: int = 16, temperature: float = 0.0,
         stop: list[str] | None = None, seed: int | None = None) -> Iterator[dict[str, Any]]:
    """The same model as a chat model: the messages as one prompt, then its answer."""
    tok = build_tokenizer()
    text = "".join(f"{m.get('role')}: {m.get('content')} " for m in messages) + "assistant:"
    yield from complete_ids(gpt2.get(), tok, tok.encode(text), max_tokens, temperature, stop,
                            seed)
