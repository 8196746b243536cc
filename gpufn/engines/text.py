"""A request's text as its tokens arrive: incremental detokenization (a small window of
context, held back while a UTF-8 character is incomplete) and stop strings (never
emitted: text that could still begin a stop string is held back until it cannot)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded with the first ones (leading-space rules)


class IncrementalText:
    """Feed token ids one at a time; get back the text they add, stops applied."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""  # everything decoded so far
        self.emitted = 0  # how much of `text` has been handed out
        self.stopped_by: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False))

    def add(self, token_id: int) -> str:
        """Add a token; return the text now safe to emit. After a stop string matches,
        `stopped_by` names it and the text ends just before it."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release()

    def _release(self) -> str:
        if self._stop:
            start = max(0, self.emitted - self._longest)
            hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                end, self.stopped_by = min(hits)
                self.text = self.text[:end]
                return self._emit(end)
            return self._emit(len(self.text) - self._held_back())
        return self._emit(len(self.text))

    def _held_back(self) -> int:
        """The longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out

    def flush(self) -> str:
        """At the end (not by a stop string): whatever was held back, and the bytes of an
        unfinished character (decoded with replacement characters)."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before):
            self.text += after[len(before):]
            self._prefix = self._read = len(self._ids)
        return self._emit(len(self.text))
