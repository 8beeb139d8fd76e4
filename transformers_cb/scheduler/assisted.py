"""A draft model's side of a speculating request, on the scheduler's side (torch-free).

A request that speculates with the engine's `assistant_model` carries a `ModelDraft` as its
`SpeculationState.source`: the engine's drafter (runner/drafter.py) runs the assistant before each
schedule and leaves its draft tokens here (`tokens`); `propose` (speculation.py) takes them instead of a
prompt lookup. After verification `after_verify` moves the draft length as transformers'
`num_assistant_tokens_schedule` says: "heuristic" / "heuristic_transient" +2 after a fully accepted draft,
-1 otherwise (never under 1); "constant" keeps the engine's back-off (`speculation.record`: shorter drafts
when few are accepted, pauses after wholly rejected ones), which changes no output.
See docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .speculation import SpeculationState

HEURISTIC_SCHEDULES = ("heuristic", "heuristic_transient")


@dataclass
class ModelDraft:
    """The draft model's tokens for one request: `tokens` is this step's draft (set by the drafter before
    the schedule, taken by `propose`); `schedule` and `confidence` are the request's settings
    (config/speculation.py, `AssistantSettings`)."""

    schedule: str = "constant"
    confidence: float = 0.0
    tokens: list[int] = field(default_factory=list)
    # The heuristic schedules' draft length (kept here: `speculation.record` sets the state's own first).
    length: int = 0

    def take(self, count: int) -> list[int]:
        """At most `count` of this step's draft tokens; the draft is used up (a later schedule without a
        new draft proposes nothing)."""
        tokens, self.tokens = self.tokens[:count], []
        return tokens


def after_verify(state: SpeculationState, drafted: int, accepted: int) -> None:
    """The draft length after a verification, under the heuristic schedules (transformers'
    `AssistedCandidateGenerator.update_candidate_strategy`); "constant" leaves the back-off's."""
    source = state.source
    if not isinstance(source, ModelDraft) or source.schedule not in HEURISTIC_SCHEDULES:
        return
    source.length = source.length + 2 if accepted == drafted else max(1, source.length - 1)
    state.num_tokens = source.length
    state.misses = 0
    state.paused_steps = 0
