"""`POST /v1/embeddings` over the functions declared `@gpufn.embedding_model(NAME)`.

Each input of a request (a string, a list of strings, a list of token ids or a list of
such lists) is one call of the model function, `input=` that input and every parameter the
function declares (`dimensions`), null where the request leaves it out: calls batched by
`@gpu(batch_size=...)` then always carry the same names, so requests are batched together.
A call returns the input's embedding, a list of floats, or `{"embedding": [...],
"tokens": N}` (N counts in `usage`). `encoding_format: "base64"` answers each embedding as
the base64 of its little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

from gpufn.http.errors import HTTPError
from gpufn.http.openai_params import bad

MAX_INPUTS = 2048


def inputs(body: dict[str, Any]) -> list[str | list[int]]:
    """The request's inputs, one per call."""
    raw = body.get("input")

    def ids(x: Any) -> bool:
        return (isinstance(x, list) and bool(x)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x))

    if isinstance(raw, str) and raw:
        out: list[str | list[int]] = [str(raw)]
    elif ids(raw):
        out = [list(raw or [])]
    elif isinstance(raw, list) and raw and (all(isinstance(x, str) and x for x in raw)
                                            or all(ids(x) for x in raw)):
        out = list(raw)
    else:
        raise bad("input", "input must be a non-empty string, a list of them, a list of token "
                  "ids or a list of lists of token ids")
    if len(out) > MAX_INPUTS:
        raise bad("input", f"at most {MAX_INPUTS} inputs per request, got {len(out)}")
    return out


def encoding(body: dict[str, Any]) -> str:
    fmt = body.get("encoding_format")
    if fmt is None:
        return "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"encoding_format is 'float' or 'base64', got {fmt!r}")
    return str(fmt)


def _fail(message: str) -> HTTPError:
    return HTTPError(500, "BadEmbedding", f"an embedding model returned {message} (see "
                     "docs/api.md, 'OpenAI models')", code="bad_model_output")


def item(value: bytes, index: int, fmt: str, dimensions: int | None) -> tuple[dict[str, Any], int]:
    """One call's value (JSON text) as an embedding object, and its token count."""
    v = json.loads(value)
    tokens = 0
    if isinstance(v, dict):
        tokens = v.get("tokens", 0)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise _fail(f"'tokens': {tokens!r}, not a count")
        v = v.get("embedding")
    if (not isinstance(v, list) or not v or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in v)):
        raise _fail("no embedding (a non-empty list of finite numbers, or a dict with one "
                    "under 'embedding')")
    if dimensions is not None and len(v) != dimensions:
        raise _fail(f"{len(v)} dimensions where {dimensions} were asked for")
    emb: list[float] | str = [float(x) for x in v]
    if fmt == "base64":
        emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
    return {"object": "embedding", "index": index, "embedding": emb}, tokens
