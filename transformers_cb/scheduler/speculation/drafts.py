"""Draft tokens on the scheduler's side (torch-free): how much of a
proposal a step runs (`fit_draft`), and a verified run applied to its request (`append_verified`).

Drafts travel as data: before each schedule the engine asks its sources for `{request id: tokens}`
(`DraftSource.propose`, draft_source.py: prompt lookup, prompt_lookup.py; the draft model, shadow_planner.py) and hands
them to `Scheduler.schedule`, which cuts each to what the step fits (`fit_draft`). After verification the
request's source hears the outcome (`DraftSource.after_verify`). Nothing is written into a `Request` but
its tokens and its back-off (back_off.py). See docs/speculative_decoding.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...requests import Request
from ...sampling.sampled_token import SampledToken
from .back_off import record, speculation_of
from .speculation_stats import SpeculationStats


def fit_draft(request: Request, budget: int, proposed: list[int], speculating: bool = True) -> list[int]:
    """The tokens of `proposed` (`request`'s draft) this step runs (empty: none): none unless the step
    speculates (`speculating`: `Scheduler.speculates_now`) and the request decodes its next token with
    speculation on; then at most `budget - 1` (the step's token budget also runs its last token), its
    draft length and never past `max_new_tokens` (the target's own token after the draft is the last one
    the request may have), and, as transformers does, nothing from an eos on (the request would end
    there). A paused request counts one step of its pause down instead."""
    state = speculation_of(request)
    if not speculating or state is None or request.num_remaining_tokens != 1 or not request.generated_ids:
        return []
    if budget < 2:
        return []
    if state.paused_steps:
        state.paused_steps -= 1
        return []
    room = request.max_new_tokens - len(request.generated_ids) - 1
    count = min(state.num_tokens, budget - 1, room)
    if count <= 0:
        return []
    draft = proposed[:count]
    if request.eos_token_ids:
        for i, token in enumerate(draft):
            if token in request.eos_token_ids:
                return draft[:i]
    return draft


def append_verified(
    request: Request, num_drafted: int, run: Sequence[SampledToken], stats: SpeculationStats
) -> str | None:
    """A speculating request's verified tokens (`run`: its accepted draft tokens, then the target's own)
    appended one at a time until one ends the request, exactly as plain decoding would; the outcome
    recorded (`stats`, the request's back-off, its source). Returns the stop reason, or None when the
    request goes on."""
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
    if state is not None:
        state.source.after_verify(request, num_drafted, accepted)
    return reason
