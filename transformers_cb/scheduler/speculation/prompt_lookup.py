"""Prompt lookup as a draft source (torch-free): draft tokens copied from the request's own prompt and
output, the n-gram lookup of transformers' `PromptLookupCandidateGenerator`. See
docs/speculative_decoding.md."""

from __future__ import annotations

from collections.abc import Sequence

from ...requests import Request
from .back_off import draft_room, speculation_of
from .draft_source import Drafts

# Shortest n-gram match that yields a draft (vLLM's `prompt_lookup_min`; never above the request's
# `max_matching_ngram_size`). A one-token match is weak evidence: on SmolLM2 rewriting a passage, drafts
# after a 1-gram match had their first token accepted 29 % of the time, after a 2-gram match 89 %.
MIN_MATCH_NGRAM = 2


def lookup(tokens: list[int], max_ngram: int, num_tokens: int, min_ngram: int = 1) -> list[int]:
    """The draft of transformers' `PromptLookupCandidateGenerator`: for n from `max_ngram` down to
    `min_ngram` (transformers: 1), the first (leftmost) earlier occurrence of the last n tokens that has a
    continuation, and up to `num_tokens` tokens after it. The match does not depend on `num_tokens`, so a
    shorter draft is a prefix of a longer one."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), max(min_ngram, 1) - 1, -1):
        tail = tokens[length - n :]
        last = tail[-1]
        end = n - 1  # the index of a window's last token
        while True:
            try:
                end = tokens.index(
                    last, end, length - 1
                )  # the window ending at length - 1 has no continuation
            except ValueError:
                break
            if tokens[end - n + 1 : end + 1] == tail:
                return tokens[end + 1 : min(end + 1 + num_tokens, length)]
            end += 1
    return []


class PromptLookup:
    """The prompt-lookup `DraftSource` (stateless: one serves every request, `PROMPT_LOOKUP`)."""

    def propose(self, requests: Sequence[Request]) -> Drafts:
        """Each lookup request's draft at its full room (`draft_room`); the schedule keeps a prefix."""
        drafts: Drafts = {}
        for request in requests:
            state = speculation_of(request)
            if state is None or state.source is not self:
                continue
            count = draft_room(request)
            if count > 0:
                min_ngram = min(MIN_MATCH_NGRAM, state.max_ngram)
                drafts[request.request_id] = lookup(request.all_token_ids, state.max_ngram, count, min_ngram)
        return drafts

    def after_verify(self, request: Request, drafted: int, accepted: int) -> None:
        """Nothing: the back-off (back_off.py `record`) is all a lookup request adapts."""

    def stopped(self, request: Request) -> None:
        """Nothing: a lookup holds nothing per request."""


PROMPT_LOOKUP = PromptLookup()
