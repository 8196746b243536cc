"""An OpenAI embedding model: `mini-bert` behind `POST /v1/embeddings`, requests batched.

    pip install -e ".[examples]"          # transformers, the OpenAI client, the gateway
    gpufn serve --http-port 8000 &
    gpufn deploy examples/embeddings.py --name emb
    TOKEN=$(python -c 'import json, pathlib; print(json.loads((pathlib.Path.home() / ".gpufn/cluster.json").read_text())["token"])')

    curl -s http://127.0.0.1:8000/v1/embeddings -H "Authorization: Bearer $TOKEN" \\
      -H "Content-Type: application/json" \\
      -d '{"model": "mini-bert", "input": ["a GPU", "two GPUs"], "dimensions": 32}'

    python -c '
    import os
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=os.environ["TOKEN"])
    print(client.embeddings.create(model="mini-bert", input=["a GPU", "two GPUs"]).usage)
    '

A small BERT encoder built from a config with seeded weights and a WordPiece tokenizer
trained here on a few sentences (nothing is downloaded); an input's embedding is the mean
of its last hidden states over its tokens, L2-normalised. Each input of a request is one
call, and `@gpu(batch_size=32, batch_wait_ms=5)` runs the calls that arrive together (from
one request or many) as one padded forward. `dimensions` is declared by the signature, so
a request may ask for fewer dimensions (the first ones, normalised again); the function
returns each embedding with its token count, which the gateway reports as `usage`.
"""

from __future__ import annotations

from typing import Any

import torch

import gpufn

HIDDEN = 64
CORPUS = [
    "The GPU runs the model and the scheduler decides which device runs which call.",
    "A small model answers quickly; a large model is sharded over a gang of devices.",
    "Embeddings map text to vectors; similar texts get similar vectors.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
] * 4


_BUILT: dict[str, Any] = {}  # per process: a by-value function keeps no lru_cache


def build_tokenizer() -> Any:
    """A WordPiece tokenizer trained on CORPUS (deterministic, no download)."""
    if "tok" not in _BUILT:
        from tokenizers import BertWordPieceTokenizer
        from transformers import PreTrainedTokenizerFast

        wp = BertWordPieceTokenizer(lowercase=True)
        wp.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, show_progress=False)
        _BUILT["tok"] = PreTrainedTokenizerFast(
            tokenizer_object=wp._tokenizer, pad_token="[PAD]", unk_token="[UNK]",
            cls_token="[CLS]", sep_token="[SEP]")
    return _BUILT["tok"]


def build_model(vocab_size: int) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=128)
    return BertModel(config).eval()


def embed_batch(model: torch.nn.Module, tok: Any, inputs: list[str | list[int]],
                dimensions: list[int | None]) -> list[dict[str, Any]]:
    """Mean-pooled, normalised embeddings of texts (or token ids), one padded forward."""
    ids = [tok.encode(x, truncation=True, max_length=128) if isinstance(x, str) else list(x)[:128]
           for x in inputs]
    width = max(len(x) for x in ids)
    pad = tok.pad_token_id
    batch = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    device = next(model.parameters()).device
    with torch.no_grad():
        hidden = model(input_ids=batch.to(device), attention_mask=mask.to(device)).last_hidden_state
    mask_f = mask.to(hidden.device, hidden.dtype)[:, :, None]
    pooled = (hidden * mask_f).sum(1) / mask_f.sum(1)
    out = []
    for row, x, dims in zip(pooled.float().cpu(), ids, dimensions, strict=True):
        vec = row[:dims] if dims else row
        out.append({"embedding": torch.nn.functional.normalize(vec, dim=0).tolist(),
                    "tokens": len(x)})
    return out


@gpufn.model(memory="64MiB")
def bert() -> torch.nn.Module:
    return build_model(len(build_tokenizer())).to(gpufn.current_device())


@gpufn.embedding_model("mini-bert")
@gpufn.gpu(models=[bert], batch_size=32, batch_wait_ms=5)
def embed(input: list[str | list[int]], dimensions: list[int | None]) -> list[dict[str, Any]]:
    """A batch of inputs (texts or token ids): each one's embedding and token count."""
    if any(d is not None and not 1 <= d <= HIDDEN for d in dimensions):
        raise ValueError(f"dimensions is at most {HIDDEN} for mini-bert")
    return embed_batch(bert.get(), build_tokenizer(), input, dimensions)
