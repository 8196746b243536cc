"""`TransformersEngine`: continuous batching for any transformers causal LM, through the
model's own forward: requests join between steps and leave alone, and batching never
changes a request's result (the rule below; docs/engines.md says more)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpufn.engines.base import FinishReason, Prompt, RequestOutput, SamplingParams, TokenLogprobs
from gpufn.engines.kv_rows import (
    PLAN_KWARG,
    RowCache,
    RowPlan,
    Segment,
    SeqKV,
    cache_kwarg,
    row_invariant_from,
    use_row_attention,
)
from gpufn.engines.sampling import RowSampler, token_logprobs
from gpufn.engines.text import IncrementalText
from gpufn.engines.waiting import WaitingQueue

# Exactness rule. Every step is one packed forward of [1, T] tokens: the prompts of the
# requests joining and one token of each running request, T padded to at least `min_rows`,
# and the logits kept for at least `min_rows` positions. The row-wise ops (embedding,
# linear layers, norms, activations, rotary) then see each token as one row of a GEMM or
# an elementwise op with at least `min_rows` rows, and attention runs per request on its
# own queries (copied out) against its own keys at their exact length; sampling runs on
# the request's own copy of its logits with its own generator. So a request's numbers go
# through the same shapes and layouts alone as in any batch, except the GEMMs' row count
# M, and BLAS computes each row bit-identically for every M >= 12 (measured, MKL fp32 on
# 1-8 threads: M = 1..3 and, on 2 or more threads, 5..11 take other kernels; see
# bench/engine_exactness.py). Resuming after preemption replays the generated tokens
# one decode step at a time (not one long prefill) for the same reason.
MIN_ROWS = 16


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"


@dataclass(eq=False)
class _Seq:
    request_id: str
    params: SamplingParams
    priority: int
    order: int
    prompt: list[int]
    capacity: int
    sampler: RowSampler
    text: IncrementalText
    state: _State = _State.WAITING
    kv: SeqKV | None = None
    generated: list[int] | None = None
    feed: list[int] | None = None  # tokens to feed next; all but the last are a replay
    started: bool = False  # its first output went out

    def tokens(self) -> list[int]:
        assert self.generated is not None
        return self.generated


@dataclass(eq=False)
class _Work:
    """One request's part of a step's forward: tokens from position `start`; its logits
    at every position (`keep_all`, for prompt logprobs) or the last; `sample` unless
    it is replaying after a resume."""

    seq: _Seq
    tokens: list[int]
    start: int
    keep_all: bool
    sample: bool
    first_row: int = 0  # its first row in the forward's kept logits


class TransformersEngine:
    """Steps up to `max_batch` requests of one transformers causal LM together.
    `min_rows` pads each forward (see the exactness rule above; 1 turns padding off and
    with it the guarantee; "auto" measures this machine's threshold for this model's
    layers at construction, `row_invariant_from`, and raises if there is none).
    `prefill_tokens` bounds the prompt tokens that join in one step (so a burst of long
    prompts does not stall the running requests for long; prompts are never split). `max_len` caps prompt plus completion (default: the
    model's `max_position_embeddings`)."""

    def __init__(self, model: Any, tokenizer: Any, max_batch: int = 32, *,
                 min_rows: int | str = MIN_ROWS, max_len: int | None = None,
                 prefill_tokens: int = 2048,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: give at least 1")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.min_rows = max_batch, _min_rows(model, min_rows)
        self.prefill_tokens = prefill_tokens
        self.device = next(model.parameters()).device
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_len = int(max_len or getattr(config, "max_position_embeddings", 0) or 2048)
        self.eos_token_ids = frozenset(_eos_ids(model, tokenizer) if eos_token_ids is None
                                       else eos_token_ids)
        use_row_attention(model)
        self._cache_kwarg = cache_kwarg(model)
        self._cache = RowCache()
        self._seqs: dict[str, _Seq] = {}
        self._waiting: WaitingQueue[_Seq] = WaitingQueue()
        self._running: list[_Seq] = []
        self._aborts: list[str] = []
        self.kv_bytes_per_token = self._probe_kv_bytes()

    # -- the Engine interface ------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    priority: int = 0) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        ids = self._prompt_ids(prompt)
        self._check(ids, params)
        seq = _Seq(request_id, params, priority, self._waiting.next_order(), ids,
                   self._capacity(len(ids), params),
                   RowSampler(params, self.vocab_size, self.device),
                   IncrementalText(self.tokenizer, ids, params.stop))
        self._seqs[request_id] = seq
        self._waiting.push(request_id, seq, priority, seq.order)

    def step(self) -> list[RequestOutput]:
        """Remove aborted requests, admit waiting ones into free slots (higher priority
        first), then one packed forward: the prompts of those joining and one token of
        every other running request."""
        outputs = self._reap_aborts()
        joined = self._admit()
        work = [self._work_for(s, joined=True) for s in joined]
        work += [self._work_for(s, joined=False) for s in self._running if s not in joined]
        if work:
            with torch.inference_mode():
                self._run(work, outputs)
        return outputs

    def abort(self, request_id: str) -> None:
        if request_id in self._seqs and request_id not in self._aborts:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- KV accounting and preemption ------------------------------------------------------

    def bytes_for(self, prompt: Prompt, params: SamplingParams) -> int:
        return self._capacity(len(self._prompt_ids(prompt)), params) * self.kv_bytes_per_token

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of KV buffers held now (each running sequence's, allocated at its prefill)."""
        return sum(s.kv.nbytes() for s in self._running if s.kv is not None)

    def suspend(self, request_id: str) -> None:
        """Take a running or waiting request out: its KV is freed and it waits for
        `resume` (by then it recomputes; its final text is unchanged)."""
        seq = self._seqs[request_id]
        if seq.state is _State.RUNNING:
            self._running.remove(seq)
            seq.kv = None
            if seq.generated is not None:
                seq.feed = list(seq.generated)
        else:
            self._waiting.remove(request_id)
        seq.state = _State.SUSPENDED

    def resume(self, request_id: str) -> None:
        """Queue a suspended request again, in its original place among its priority."""
        seq = self._seqs[request_id]
        if seq.state is _State.SUSPENDED:
            seq.state = _State.WAITING
            self._waiting.push(request_id, seq, seq.priority, seq.order)

    def preempt(self, request_id: str) -> None:
        """Suspend and queue again at once: it rejoins when a slot is free and nothing of
        higher priority (or earlier at its priority) waits."""
        self.suspend(request_id)
        self.resume(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- admission ---------------------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The token ids this engine runs for `prompt` (a string is encoded as it is)."""
        return self._prompt_ids(prompt)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _capacity(self, prompt_len: int, params: SamplingParams) -> int:
        return min(prompt_len + params.max_tokens, self.max_len)

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine's max_len is "
                             f"{self.max_len}: shorten it")
        v = self.vocab_size
        for name, tokens in (("prompt", ids), ("logit_bias", list(params.logit_bias)),
                             ("stop_token_ids", list(params.stop_token_ids))):
            bad = [t for t in tokens if not 0 <= t < v]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                 f"(0..{v - 1})")

    def _admit(self) -> list[_Seq]:
        """Waiting requests into free slots, in priority order, while their prompts fit
        `prefill_tokens` for this step (the first always joins)."""
        joined: list[_Seq] = []
        tokens = 0
        while len(self._running) < self.max_batch and (seq := self._waiting.peek()) is not None:
            if joined and tokens + len(seq.prompt) > self.prefill_tokens:
                break
            self._waiting.pop()
            tokens += len(seq.prompt)
            seq.state = _State.RUNNING
            self._running.append(seq)
            joined.append(seq)
        return joined

    def _reap_aborts(self) -> list[RequestOutput]:
        outputs = []
        for rid in self._aborts:
            seq = self._seqs.get(rid)
            if seq is not None:
                self._drop(seq)
                outputs.append(RequestOutput.aborted(
                    rid, prompt_tokens=len(seq.prompt),
                    completion_tokens=len(seq.generated or ())))
        self._aborts.clear()
        return outputs

    def _drop(self, seq: _Seq) -> None:
        self._seqs.pop(seq.request_id, None)
        if seq.state is _State.RUNNING:
            self._running.remove(seq)
        elif seq.state is _State.WAITING:
            self._waiting.remove(seq.request_id)
        seq.kv = None

    # -- the packed forward -----------------------------------------------------------------

    def _work_for(self, seq: _Seq, joined: bool) -> _Work:
        """A joining request's prompt (its KV allocated), or one token of a running one."""
        if joined:
            seq.kv = SeqKV(seq.capacity)
            resumed = seq.generated is not None
            if resumed:  # replay what it had generated, one decode step per token
                seq.feed = list(seq.tokens())
            else:
                seq.generated = []
            keep_all = seq.params.prompt_logprobs is not None and not seq.started
            return _Work(seq, seq.prompt, 0, keep_all, sample=not resumed)
        assert seq.feed and seq.kv is not None
        token = seq.feed.pop(0)
        return _Work(seq, [token], seq.kv.length, False, sample=not seq.feed)

    def _run(self, work: list[_Work], outputs: list[RequestOutput]) -> None:
        """One packed forward for every request's work, then each request's own token."""
        ids: list[int] = []
        pos: list[int] = []
        keep: list[int] = []
        segments = []
        for w in work:
            off, n = len(ids), len(w.tokens)
            ids += w.tokens
            pos += range(w.start, w.start + n)
            segments.append(Segment(w.seq.kv, off, n))  # type: ignore[arg-type]
            w.first_row = len(keep)
            keep += range(off, off + n) if w.keep_all else [off + n - 1]
        try:
            logits = self._forward(segments, ids, pos, keep)
        except Exception as exc:  # the forward failed: every request in it fails
            for w in work:
                self._fail(w.seq, outputs, f"forward failed: {exc!r}")
            return
        for w in work:
            if not w.sample:
                continue
            if w.keep_all:
                rows = logits[w.first_row:w.first_row + len(w.tokens)]
                self._guard(w.seq, outputs, self._emit_first, w.seq, rows, outputs)
            else:
                self._guard(w.seq, outputs, self._emit, w.seq, logits[w.first_row], outputs)

    def _forward(self, segments: list[Segment], ids: list[int], pos: list[int],
                 keep: list[int]) -> torch.Tensor:
        """Logits [len(keep), vocab] of the kept positions. The token rows and the kept
        rows are padded to `min_rows` (the exactness rule above)."""
        total = max(len(ids), self.min_rows)
        pad = total - len(ids)
        keep = keep + [0] * max(0, self.min_rows - len(keep))
        dev = self.device
        plan = RowPlan(segments, total)
        self._cache.plan = plan
        try:
            out = self.model(
                input_ids=torch.tensor([ids + [0] * pad], device=dev),
                position_ids=torch.tensor([pos + [0] * pad], device=dev), use_cache=True,
                logits_to_keep=torch.tensor(keep, device=dev),
                **{self._cache_kwarg: self._cache, PLAN_KWARG: plan})
        finally:
            self._cache.plan = None
        for seg in segments:
            seg.kv.length += seg.n
        return out.logits[0]

    def _guard(self, seq: _Seq, outputs: list[RequestOutput], fn: Any, *args: Any) -> None:
        """Run one request's own work; an exception fails that request alone."""
        try:
            fn(*args)
        except Exception as exc:
            self._fail(seq, outputs, repr(exc))

    def _fail(self, seq: _Seq, outputs: list[RequestOutput], error: str) -> None:
        if seq.request_id in self._seqs:
            self._drop(seq)
            outputs.append(RequestOutput.failed(
                seq.request_id, error, prompt_tokens=len(seq.prompt),
                completion_tokens=len(seq.generated or ())))

    # -- one token out -------------------------------------------------------------------

    def _emit_first(self, seq: _Seq, rows: torch.Tensor, outputs: list[RequestOutput]) -> None:
        """The first token of a request that asked for its prompt's logprobs (`rows`: the
        logits at every prompt position)."""
        self._emit(seq, rows[-1], outputs, self._prompt_logprobs(seq, rows[:-1]))

    def _emit(self, seq: _Seq, row: torch.Tensor, outputs: list[RequestOutput],
              prompt_lp: tuple[TokenLogprobs | None, ...] | None = None) -> None:
        logits = row.float().clone()  # its own aligned copy: same numbers alone or batched
        raw = logits.clone() if seq.params.logprobs is not None else None
        token = seq.sampler.choose(logits)
        seq.sampler.count(token)
        generated = seq.tokens()
        generated.append(token)
        seq.feed = [token]
        reason, stop_reason, text = self._after(seq, token)
        lp = None
        if raw is not None:
            lp = (token_logprobs(torch.log_softmax(raw, -1), token, seq.params.logprobs or 0,
                                 self._token_text),)
        if not seq.started:
            seq.started = True
            if seq.params.echo:
                text = self._decode_text(seq.prompt) + text
        outputs.append(RequestOutput(
            seq.request_id, (token,), text, reason is not None, reason, len(seq.prompt),
            len(generated), lp, prompt_lp, stop_reason))
        if reason is not None:
            self._drop(seq)

    def _after(self, seq: _Seq, token: int) -> tuple[FinishReason | None, str | int | None, str]:
        """Whether `token` ends the request, why, and the text it adds."""
        p = seq.params
        if token in p.stop_token_ids:
            return FinishReason.STOP, token, seq.text.flush()
        if token in self.eos_token_ids and not p.ignore_eos:
            return FinishReason.STOP, None, seq.text.flush()
        text = seq.text.add(token)
        if seq.text.stopped_by is not None:
            return FinishReason.STOP, seq.text.stopped_by, text
        n = len(seq.tokens())
        if n >= p.max_tokens or len(seq.prompt) + n >= self.max_len:
            return FinishReason.LENGTH, None, text + seq.text.flush()
        return None, None, text

    def _prompt_logprobs(self, seq: _Seq, rows: torch.Tensor) -> tuple[TokenLogprobs | None, ...]:
        """From the logits at prompt positions 0..n-2 (each predicts the next token)."""
        top = seq.params.prompt_logprobs or 0
        lps = torch.log_softmax(rows.float(), dim=-1)
        rest = (token_logprobs(lps[i], t, top, self._token_text)
                for i, t in enumerate(seq.prompt[1:]))
        return (None, *rest)

    def _token_text(self, token_id: int) -> str:
        return self._decode_text([token_id])

    def _decode_text(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True,
                                         clean_up_tokenization_spaces=False))

    def _probe_kv_bytes(self) -> int:
        """KV bytes per token, measured: one token through the model into a probe buffer."""
        probe = SeqKV(1)
        with torch.inference_mode():
            self._forward([Segment(probe, 0, 1)], [0], [0], [0])
        return probe.nbytes()


def _min_rows(model: Any, min_rows: int | str) -> int:
    if min_rows != "auto":
        return max(1, int(min_rows))
    measured = row_invariant_from(model)
    if measured is None:
        raise ValueError("min_rows='auto': this device's matrix products give rows that depend "
                         "on the row count at every size measured, so batching would change "
                         "results; give min_rows explicitly to run without that guarantee")
    return measured


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids
