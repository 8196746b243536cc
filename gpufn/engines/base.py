"""The step interface every engine speaks (add a request, step, abort), what a request asks
for (`SamplingParams`) and what each step hands back per request (`RequestOutput`)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gpufn.exceptions import InvalidSpec

Prompt = str | Sequence[int]
MAX_LOGPROBS = 20


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"  # cancelled
    ERROR = "error"  # this request failed; `RequestOutput.error` says why


def _bad(name: str, value: object, fix: str) -> InvalidSpec:
    return InvalidSpec(f"SamplingParams({name}={value!r}): {fix}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates. `temperature=0` is greedy (the default); a `seed` makes
    sampling reproducible and independent of the other requests in the batch."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the text returned never includes them
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # chosen token's logprob plus this many top alternatives
    echo: bool = False  # the first output's text starts with the prompt's text
    prompt_logprobs: int | None = None  # logprobs of each prompt token, with top alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        self._check_numbers()
        self._check_lists()

    def _check_numbers(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "give a whole number of tokens >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature,
                       "use 0 for greedy decoding or a positive number (e.g. 0.7)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "use a number in (0, 1]; 1 keeps every token")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise _bad("seed", self.seed, "use an integer, or None for an unseeded request")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                raise _bad(name, value, "use a number in [-2, 2] (0 turns it off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise _bad(name, value, f"use None, or how many alternatives: 0..{MAX_LOGPROBS}")

    def _check_lists(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "give non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise _bad("stop_token_ids", self.stop_token_ids, "give token ids (ints >= 0)")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise _bad("logit_bias", {tok: bias}, "keys are token ids (ints >= 0)")
            if not _finite(bias) or not -100 <= bias <= 100:
                raise _bad("logit_bias", {tok: bias}, "biases are numbers in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    logprob: float
    token: str  # the token's text as decoded alone


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position: the chosen token and the `top` most likely ones (most likely first)."""

    chosen: Logprob
    top: tuple[Logprob, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: the new tokens and the text they add (a
    delta; concatenated over outputs it is the whole completion), and whether it finished.
    Token counts are totals so far."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per new token, when asked
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # first output only
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None

    @classmethod
    def failed(cls, request_id: str, error: str, *, prompt_tokens: int = 0,
               completion_tokens: int = 0) -> RequestOutput:
        return cls(request_id, finished=True, finish_reason=FinishReason.ERROR, error=error,
                   prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    @classmethod
    def aborted(cls, request_id: str, *, prompt_tokens: int = 0,
                completion_tokens: int = 0) -> RequestOutput:
        return cls(request_id, finished=True, finish_reason=FinishReason.ABORT,
                   prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


@runtime_checkable
class Engine(Protocol):
    """A model that steps many requests together. `add_request` queues one (raising
    `ValueError`/`InvalidSpec` for one it can never run); each `step()` advances every
    running request by at most one token and returns one output per request that produced
    something or finished; `abort` ends one at the next step (its last output says
    'abort'). vLLM's and SGLang's engines have this shape (see `gpufn.engines.vllm`)."""

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    priority: int = 0) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...


@runtime_checkable
class KVAccounting(Protocol):
    """Optional: what each sequence's KV cache costs, so a scheduler can charge it to the
    device's ledger and admit by bytes as well as by count."""

    kv_bytes_per_token: int

    def bytes_for(self, prompt: Prompt, params: SamplingParams) -> int:
        """The most KV bytes this request can ever hold (prompt plus `max_tokens`)."""
        ...


@runtime_checkable
class Preemptible(Protocol):
    """Optional: take a running request out of the batch (its KV freed) and bring it back
    later, recomputing its KV, with the same final text as if it had never left."""

    def suspend(self, request_id: str) -> None: ...

    def resume(self, request_id: str) -> None: ...
