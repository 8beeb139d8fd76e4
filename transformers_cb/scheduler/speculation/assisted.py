"""A draft model's per-request schedule on the scheduler's side (torch-free).

A request that speculates with the engine's `assistant_model` has the draft model's source
(shadow_planner.py) as its `SpeculationState.source` and its settings here (`AssistantSchedule`,
`SpeculationState.assistant`): the confidence under which the drafter stops a draft, and how the draft
length moves after each verification, as transformers' `num_assistant_tokens_schedule` says (`after_verify`):
"heuristic" / "heuristic_transient" +2 after a fully accepted draft, -1 otherwise (never under 1);
"constant" keeps the engine's back-off (`back_off.record`: shorter drafts when few are accepted, pauses
after wholly rejected ones), which changes no output. See docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass

HEURISTIC_SCHEDULES = ("heuristic", "heuristic_transient")


@dataclass
class AssistantSchedule:
    """One request's draft-model settings (config/draft_settings.py, `AssistantSettings`): `schedule`,
    `confidence`, and the heuristic schedules' draft length (kept here: `back_off.record` sets the
    state's own first)."""

    schedule: str = "constant"
    confidence: float = 0.0
    length: int = 0


def after_verify(assistant: AssistantSchedule, drafted: int, accepted: int) -> int | None:
    """The draft length after a verification under the heuristic schedules (transformers'
    `AssistedCandidateGenerator.update_candidate_strategy`), kept in `assistant`; None under "constant",
    which leaves the back-off's (back_off.py `follow_schedule` applies it)."""
    if assistant.schedule not in HEURISTIC_SCHEDULES:
        return None
    assistant.length = assistant.length + 2 if accepted == drafted else max(1, assistant.length - 1)
    return assistant.length
