"""A draft model's side of the scheduler (scheduler/speculation/assisted.py): a step runs the draft model's proposal
(not a lookup) within the same limits (budget, max_new_tokens, eos), and only in the step it was proposed
for; transformers' `num_assistant_tokens_schedule` moves the draft length after each verification; the
settings' precedence (the engine's GenerationConfig, the assistant's own, transformers' defaults) and
validation."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from tests.support.scheduling import scheduler_settings
from transformers_cb.config.draft_settings import AssistantSettings, assistant_from_configs, request_assistant
from transformers_cb.requests import Request
from transformers_cb.scheduler.speculation.assisted import AssistantSchedule, after_verify
from transformers_cb.scheduler.speculation.back_off import SpeculationState, follow_schedule, record
from transformers_cb.scheduler.speculation.draft_source import Drafts
from transformers_cb.scheduler.speculation.drafts import fit_draft
from transformers_cb.scheduler.speculation.prompt_lookup import PROMPT_LOOKUP


def apply_schedule(state, drafted: int, accepted: int) -> None:
    """What the draft model's source does after a verification (scheduler/speculation/shadow_planner.py)."""
    follow_schedule(state, after_verify(state.assistant, drafted, accepted))


class ModelSource:
    """A draft model's source as the scheduler sees it: it proposes the given drafts, and its
    `after_verify` runs the schedules (as scheduler/speculation/shadow_planner.py does)."""

    def __init__(self) -> None:
        self.drafts: Drafts = {}

    def propose(self, requests) -> Drafts:
        return {r.request_id: self.drafts[r.request_id] for r in requests if r.request_id in self.drafts}

    def after_verify(self, request: Request, drafted: int, accepted: int) -> None:
        apply_schedule(request.speculation, drafted, accepted)

    def stopped(self, request: Request) -> None:
        self.drafts.pop(request.request_id, None)


def assisted_request(
    schedule: str = "constant", num_tokens: int = 4, eos: frozenset[int] = frozenset()
) -> Request:
    # The prompt repeats: a lookup would draft [1, 2, 3, ...]; the drafter's tokens must win.
    request = Request("r", [1, 2, 3, 1, 2], max_new_tokens=20, eos_token_ids=eos)
    request.append_token(3)
    request.num_computed_tokens = request.num_tokens - 1
    schedule_ = AssistantSchedule(schedule, 0.0, length=num_tokens)
    request.speculation = SpeculationState(num_tokens, ModelSource(), 2, assistant=schedule_)
    return request


def test_a_step_runs_the_draft_models_tokens_within_the_limits() -> None:
    request = assisted_request(eos=frozenset({99}))
    assert PROMPT_LOOKUP.propose([request]) == {}  # not a lookup request: its source's drafts win
    assert fit_draft(request, 3, [7, 8, 9, 10]) == [7, 8]  # budget - 1
    assert fit_draft(request, 16, [7, 99, 8]) == [7]  # never past an eos
    request.max_new_tokens = len(request.generated_ids) + 2
    assert fit_draft(request, 16, [7, 8, 9]) == [7]  # the target's own token is the last one allowed


def test_a_draft_runs_only_in_the_step_it_was_proposed_for() -> None:
    """Drafts are handed to each schedule: a schedule without one runs none (no stale draft)."""
    from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
    from transformers_cb.kv.page_manager import PageManager
    from transformers_cb.kv.page_policies import FullAttentionPolicy
    from transformers_cb.kv.pool import PagePool
    from transformers_cb.requests import RequestStatus
    from transformers_cb.sampling.sampled_token import SampledToken
    from transformers_cb.scheduler.scheduler import Scheduler

    pages = PageManager([FullAttentionPolicy(PagePool(16), 4)], [KVGroupSpec(FULL_ATTENTION, (0,))])
    scheduler = Scheduler(pages, scheduler_settings(), 64, 8)
    request = assisted_request()
    assert pages.allocate(request, request.num_computed_tokens)
    request.set_status(RequestStatus.PREFILLING)
    request.set_status(RequestStatus.DECODING)
    scheduler.running.append(request)
    source = request.speculation.source
    source.drafts = {"r": [7, 8, 9]}
    plan = scheduler.schedule(source.propose(scheduler.running))
    assert plan.entries[0].draft == [7, 8, 9]
    scheduler.update(plan, [[SampledToken(7), SampledToken(5)]])  # 7 accepted, 8 rejected
    assert request.generated_ids[-2:] == [7, 5] and request.speculation.paused_steps == 0
    (entry,) = scheduler.schedule().entries
    assert entry.draft == [] and entry.num_tokens == 1


def test_heuristic_schedules_add_two_after_a_full_acceptance_and_drop_one_otherwise() -> None:
    for schedule in ("heuristic", "heuristic_transient"):
        request = assisted_request(schedule)
        state = request.speculation
        lengths = []
        for drafted, accepted in [(4, 4), (6, 6), (8, 3), (7, 0), (6, 0), (5, 0)]:
            record(request, drafted, accepted, accepted + 1)
            apply_schedule(state, drafted, accepted)
            lengths.append(state.num_tokens)
            assert state.paused_steps == 0  # no back-off pause under the heuristic schedules
        assert lengths == [6, 8, 7, 6, 5, 4], schedule
    request = assisted_request("heuristic", num_tokens=1)
    record(request, 1, 0, 1)
    apply_schedule(request.speculation, 1, 0)
    assert request.speculation.num_tokens == 1  # never under 1


def test_the_constant_schedule_keeps_the_back_off() -> None:
    """Under "constant" the back-off's draft length and pauses (speculation.record) stand as they are."""
    request = assisted_request("constant")
    state = request.speculation
    for drafted, accepted in [(4, 0), (4, 0), (4, 4), (3, 1)]:
        record(request, drafted, accepted, accepted + 1)
        before = (state.num_tokens, state.paused_steps, state.misses)
        apply_schedule(state, drafted, accepted)
        assert (state.num_tokens, state.paused_steps, state.misses) == before


def test_assistant_settings_precedence_and_validation() -> None:
    assert assistant_from_configs(GenerationConfig(), None, "g") == AssistantSettings(20, "constant", 0.4)
    own = GenerationConfig(num_assistant_tokens=6, num_assistant_tokens_schedule="heuristic")
    assert assistant_from_configs(GenerationConfig(), own, "g") == AssistantSettings(6, "heuristic", 0.4)
    engine = GenerationConfig(num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    assert assistant_from_configs(engine, own, "g") == AssistantSettings(3, "heuristic", 0.0)
    default = AssistantSettings(5, "constant", 0.4)
    assert request_assistant(default, {}, "r") == default
    assert request_assistant(default, {"num_assistant_tokens": None}, "r") == default
    assert request_assistant(default, {"num_assistant_tokens": 0}, "r") is None
    assert request_assistant(AssistantSettings(0), {"num_assistant_tokens": 2}, "r") == AssistantSettings(2)
    assert request_assistant(None, {}, "r") is None
    with pytest.raises(ValueError, match="request 9.*need an assistant_model"):
        request_assistant(None, {"num_assistant_tokens_schedule": "heuristic"}, "request 9")
    for bad in (
        {"num_assistant_tokens": 1.5},
        {"num_assistant_tokens": True},
        {"num_assistant_tokens_schedule": "dynamic"},
        {"assistant_confidence_threshold": -0.1},
    ):
        with pytest.raises(ValueError, match="request 9"):
            request_assistant(default, bad, "request 9")
