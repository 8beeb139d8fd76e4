"""Speculation on the scheduler's side (torch-free): draft tokens proposed by prompt lookup, the
per-request back-off, and the acceptance counts.

A decoding request with `Request.speculation` set runs 1 + k query tokens in a step: its last sampled
token and k draft tokens copied from its own prompt + output (`propose`, the n-gram lookup of
transformers' `PromptLookupCandidateGenerator`). The runner verifies them against the target model
(sampling/verification.py); `record` takes the outcome and sets the next draft length to the run of
draft tokens the request's recent drafts say will be accepted (`draft_length`: verifying a draft token
costs a query position even when it is rejected, which a compute-bound model pays for), and pauses a
request's lookup for a growing number of steps after drafts that were wholly rejected, so that text that
does not repeat costs (almost) nothing. See docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from ..requests import Request
from ..sampling.sampled_token import SampledToken
from .assisted import ModelDraft, after_verify

# After this many drafts in a row with no token accepted, lookup pauses (2, 4, 8, ... steps).
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE_STEPS = 64
# Shortest n-gram match that yields a draft (vLLM's `prompt_lookup_min`; never above the request's
# `max_matching_ngram_size`). A one-token match is weak evidence: on SmolLM2 rewriting a passage, drafts
# after a 1-gram match had their first token accepted 29 % of the time, after a 2-gram match 89 %.
MIN_MATCH_NGRAM = 2
# Weight of the previous drafts in the acceptance estimate, per draft (recent drafts count most).
DECAY = 0.7


@dataclass
class SpeculationStats:
    """Counts of verification steps: drafted / accepted draft tokens, tokens emitted by those steps."""

    steps: int = 0  # steps in which the request ran draft tokens
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended by those steps (accepted + the target's own token)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verification step appended on average (1.0 would be plain decoding)."""
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted


@dataclass
class SpeculationState:
    """One request's speculation: its settings (`prompt_lookup_num_tokens`, `max_matching_ngram_size`:
    config/speculation.py), the current draft length, the pause, its counts."""

    max_tokens: int
    max_ngram: int
    num_tokens: int = 0  # current draft length (starts at the maximum)
    misses: int = 0  # drafts in a row with nothing accepted
    paused_steps: int = 0  # steps left without lookup
    # Decayed counts of accepted draft tokens and of rejections (one per draft that was cut short).
    accepted_recently: float = 0.0
    rejected_recently: float = 0.0
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    # Where drafts come from: None, prompt lookup; a `ModelDraft`, the engine's assistant model (assisted.py).
    source: ModelDraft | None = None

    def __post_init__(self) -> None:
        if self.num_tokens == 0:
            self.num_tokens = self.max_tokens


def speculation_of(request: Request) -> SpeculationState | None:
    """A request's speculation state as this room made it: `Request` knows it only by the counts it reads
    (`requests.SpeculationCounts`), and `engine.speculation_support.EngineSpeculation.attach` is its one
    writer."""
    return cast(SpeculationState | None, request.speculation)


def lookup(tokens: list[int], max_ngram: int, num_tokens: int, min_ngram: int = 1) -> list[int]:
    """The draft of transformers' `PromptLookupCandidateGenerator`: for n from `max_ngram` down to
    `min_ngram` (transformers: 1), the first (leftmost) earlier occurrence of the last n tokens that has a
    continuation, and up to `num_tokens` tokens after it."""
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


def propose(request: Request, budget: int) -> list[int]:
    """Draft tokens for a decoding `request` this step (empty: none), at most `budget - 1` (the step's
    token budget also runs its last token) and never past `max_new_tokens` (the target's own token
    after the draft is the last one the request may have)."""
    state = speculation_of(request)
    if state is None or budget < 2:
        return []
    if state.paused_steps:
        state.paused_steps -= 1
        return []
    room = request.max_new_tokens - len(request.generated_ids) - 1
    count = min(state.num_tokens, budget - 1, room)
    if count <= 0:
        return []
    if state.source is not None:  # the draft model's tokens, drafted before this schedule
        draft = state.source.take(count)
    else:
        draft = lookup(request.all_token_ids, state.max_ngram, count, min(MIN_MATCH_NGRAM, state.max_ngram))
    if request.eos_token_ids:  # as transformers: no draft beyond an eos (the request would end there)
        for i, token in enumerate(draft):
            if token in request.eos_token_ids:
                return draft[:i]
    return draft


def draft_length(state: SpeculationState) -> int:
    """The next draft length: the accepted run the recent drafts predict. Draft tokens are accepted one
    after the other while they are right, so with p the chance that the next one is (estimated from the
    decayed counts: accepted / (accepted + rejections)) a run is p / (1 - p) tokens long on average;
    drafting more mostly buys rejected positions, so the run is rounded down. Never more than the
    request's maximum, never under 1."""
    if state.rejected_recently == 0:
        return state.max_tokens
    p = state.accepted_recently / (state.accepted_recently + state.rejected_recently)
    if p >= 1.0:
        return state.max_tokens
    return max(1, min(state.max_tokens, int(p / (1.0 - p))))


def record(request: Request, drafted: int, accepted: int, emitted: int) -> None:
    """The outcome of a verification step: counts, then the next draft length and the pause."""
    state = speculation_of(request)
    if state is None:
        return
    state.stats.add(drafted, accepted, emitted)
    state.accepted_recently = DECAY * state.accepted_recently + accepted
    state.rejected_recently = DECAY * state.rejected_recently + (1 if accepted < drafted else 0)
    state.num_tokens = draft_length(state)
    if accepted:
        state.misses = 0
        return
    state.misses += 1
    if state.misses >= MISSES_BEFORE_PAUSE:
        state.paused_steps = min(MAX_PAUSE_STEPS, 2 ** (state.misses - MISSES_BEFORE_PAUSE + 1))


def append_verified(
    request: Request, num_drafted: int, run: list[SampledToken], stats: SpeculationStats
) -> str | None:
    """A speculating request's verified tokens (`run`: its accepted draft tokens, then the target's own)
    appended one at a time until one ends the request, exactly as plain decoding would; the outcome
    recorded (`stats`, the request's back-off, a draft model's schedule). Returns the stop reason, or
    None when the request goes on."""
    reason = None
    appended = 0
    for token in run:
        request.append_token(token.token_id, token.logprob, token.top_logprobs)
        appended += 1
        reason = request.stop_reason()
        if reason is not None:
            break
    accepted = min(appended, len(run) - 1)
    stats.add(num_drafted, accepted, appended)
    record(request, num_drafted, accepted, appended)
    state = speculation_of(request)
    if state is not None:  # a draft model's schedule (assisted.py)
        after_verify(state, num_drafted, accepted)
    return reason
