"""Choosing each request's next token from its own row of logits: logit bias, presence and
frequency penalties, greedy or seeded temperature/top-p sampling, and log-probabilities."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from gpufn.engines.base import Logprob, SamplingParams, TokenLogprobs

_seeds = random.Random()


class RowSampler:
    """One request's sampling state: its generator (seeded per request, so its draws do
    not depend on its batch-mates), its bias and its token counts for the penalties."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else _seeds.getrandbits(63)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        bias = params.logit_bias
        self._bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self._bias = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        penalized = params.presence_penalty != 0 or params.frequency_penalty != 0
        self.counts = torch.zeros(vocab_size, device=device) if penalized else None

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this request's logits (a [vocab] float32 tensor it owns)."""
        p = self.params
        if len(self._bias_ids):
            logits.index_add_(0, self._bias_ids, self._bias)
        if self.counts is not None:
            logits -= p.presence_penalty * (self.counts > 0) + p.frequency_penalty * self.counts
        if p.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_p < 1:
            probs = _top_p(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def count(self, token_id: int) -> None:
        if self.counts is not None:
            self.counts[token_id] += 1


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose mass first reaches `top_p` (at least one)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[before >= top_p] = 0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def token_logprobs(logprobs: torch.Tensor, chosen: int, top: int,
                   text: Callable[[int], str]) -> TokenLogprobs:
    """The chosen token's log-probability and the `top` most likely (from one row of
    log_softmax over the model's raw logits)."""
    alts: tuple[Logprob, ...] = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        alts = tuple(Logprob(int(i), float(v), text(int(i)))
                     for v, i in zip(values.tolist(), ids.tolist(), strict=True))
    return TokenLogprobs(Logprob(chosen, float(logprobs[chosen]), text(chosen)), alts)
