"""Turning a growing list of token ids into text pieces, and cutting the text at stop strings.

`IncrementalDetokenizer` never emits half a character: a token that ends in the
middle of a multi-byte UTF-8 character decodes to U+FFFD, so its text is held
back until a later token completes the character (or the request ends). Each
step decodes only a short window of recent tokens, not the whole output:

    ids:  ... | prefix_offset ......... read_offset | new tokens
                 (already emitted: context)           (to emit)

The concatenation of the pieces plus `flush()` equals
`tokenizer.decode(all_ids, skip_special_tokens=True)`, less the U+FFFD of a character that the last tokens
left incomplete (a `max_tokens` cut inside an emoji): those bytes are dropped, as transformers serve and
vLLM drop them, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The held-back text at the end of the request; the bytes of a character left incomplete (decoded
        as trailing U+FFFD) are dropped."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :].rstrip(REPLACEMENT_CHAR)


@dataclass
class StopScanner:
    """Finds the first stop string in streamed text; text that might begin a stop string is held back.

    OpenAI semantics: the returned text ends right before the stop string, which is not included.
    """

    stops: list[str]
    pending: str = ""
    stopped: bool = False

    def push(self, text: str) -> str:
        """Text safe to emit now. Sets `stopped` when a stop string completes (the rest is dropped)."""
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = self._longest_stop_prefix_suffix()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:length]):
                    best = length
                    break
        return best
