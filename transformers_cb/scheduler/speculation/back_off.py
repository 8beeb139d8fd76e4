"""A speculating request's state on the scheduler's side (torch-free): where its drafts come from, and the
back-off that sets how many draft tokens it may run.

A decoding request with `Request.speculation` set runs 1 + k query tokens in a step: its last sampled
token and k draft tokens from its `DraftSource` (drafts.py: prompt lookup, prompt_lookup.py; a draft
model, shadow_planner.py). The runner verifies them against the target model (sampling/verification.py);
`record` takes the outcome and sets the next draft length to the run of draft tokens the request's
recent drafts say will be accepted (`draft_length`: verifying a draft token costs a query position even
when it is rejected, which a compute-bound model pays for), and pauses a request's drafts for a growing
number of steps after drafts that were wholly rejected, so that text that does not repeat costs
(almost) nothing. See docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from ...requests import Request
from .assisted import AssistantSchedule
from .draft_source import DraftSource
from .speculation_stats import SpeculationStats

# After this many drafts in a row with no token accepted, drafting pauses (2, 4, 8, ... steps).
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE_STEPS = 64
# Weight of the previous drafts in the acceptance estimate, per draft (recent drafts count most).
DECAY = 0.7


@dataclass
class SpeculationState:
    """One request's speculation: the source of its drafts (`source`, shared by the engine's requests),
    its settings (`max_tokens`; prompt lookup's `max_ngram`; a draft model's `assistant` schedule:
    config/draft_settings.py), the current draft length, the pause, its counts."""

    max_tokens: int
    source: DraftSource
    max_ngram: int
    num_tokens: int = 0  # current draft length (starts at the maximum)
    misses: int = 0  # drafts in a row with nothing accepted
    paused_steps: int = 0  # steps left without drafts
    # Decayed counts of accepted draft tokens and of rejections (one per draft that was cut short).
    accepted_recently: float = 0.0
    rejected_recently: float = 0.0
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    # A draft model's schedule and confidence (assisted.py); unread by prompt lookup.
    assistant: AssistantSchedule = field(default_factory=AssistantSchedule)

    def __post_init__(self) -> None:
        if self.num_tokens == 0:
            self.num_tokens = self.max_tokens


def speculation_of(request: Request) -> SpeculationState | None:
    """A request's speculation state as this room made it: `Request` knows it only by the counts it reads
    (`requests.SpeculationCounts`), and `engine.speculation.draft_setup.EngineSpeculation.attach` is its one writer."""
    return cast(SpeculationState | None, request.speculation)


def follow_schedule(state: SpeculationState, length: int | None) -> None:
    """A draft model's schedule set the next draft length (assisted.py `after_verify`; None: "constant",
    the back-off's stays): it replaces the back-off's, and no pause follows."""
    if length is None:
        return
    state.num_tokens = length
    state.misses = 0
    state.paused_steps = 0


def draft_room(request: Request) -> int:
    """How many draft tokens a source may propose for `request` now: none unless it decodes (its last
    token not run yet) and is not paused; never past `max_new_tokens` (the target's own token after the
    draft is the last one the request may have); at most its draft length."""
    state = speculation_of(request)
    if state is None or state.paused_steps or request.num_remaining_tokens != 1 or not request.generated_ids:
        return 0
    return max(0, min(state.num_tokens, request.max_new_tokens - len(request.generated_ids) - 1))


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
