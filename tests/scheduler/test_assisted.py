"""A draft model's side of the scheduler (scheduler/assisted.py): `propose` takes the drafter's tokens instead
of a lookup, within the same limits (budget, max_new_tokens, eos), and only once; transformers'
`num_assistant_tokens_schedule` moves the draft length after each verification; the settings' precedence
(the engine's GenerationConfig, the assistant's own, transformers' defaults) and validation."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from transformers_cb.config.speculation import AssistantSettings, assistant_from_configs, request_assistant
from transformers_cb.requests import Request
from transformers_cb.scheduler.assisted import ModelDraft, after_verify
from transformers_cb.scheduler.speculation import SpeculationState, propose, record


def assisted_request(
    schedule: str = "constant", num_tokens: int = 4, eos: frozenset[int] = frozenset()
) -> Request:
    # The prompt repeats: a lookup would draft [1, 2, 3, ...]; the drafter's tokens must win.
    request = Request("r", [1, 2, 3, 1, 2], max_new_tokens=20, eos_token_ids=eos)
    request.append_token(3)
    request.num_computed_tokens = request.num_tokens - 1
    source = ModelDraft(schedule, 0.0, length=num_tokens)
    request.speculation = SpeculationState(num_tokens, 2, source=source)
    return request


def test_propose_takes_the_drafters_tokens_within_the_limits_and_once() -> None:
    request = assisted_request(eos=frozenset({99}))
    source = request.speculation.source
    source.tokens = [7, 8, 9, 10]
    assert propose(request, budget=3) == [7, 8]  # budget - 1
    assert propose(request, budget=16) == []  # used up: no stale draft next step
    source.tokens = [7, 99, 8]
    assert propose(request, budget=16) == [7]  # never past an eos
    request.max_new_tokens = len(request.generated_ids) + 2
    source.tokens = [7, 8, 9]
    assert propose(request, budget=16) == [7]  # the target's own token is the last one allowed


def test_heuristic_schedules_add_two_after_a_full_acceptance_and_drop_one_otherwise() -> None:
    for schedule in ("heuristic", "heuristic_transient"):
        request = assisted_request(schedule)
        state = request.speculation
        lengths = []
        for drafted, accepted in [(4, 4), (6, 6), (8, 3), (7, 0), (6, 0), (5, 0)]:
            record(request, drafted, accepted, accepted + 1)
            after_verify(state, drafted, accepted)
            lengths.append(state.num_tokens)
            assert state.paused_steps == 0  # no back-off pause under the heuristic schedules
        assert lengths == [6, 8, 7, 6, 5, 4], schedule
    request = assisted_request("heuristic", num_tokens=1)
    record(request, 1, 0, 1)
    after_verify(request.speculation, 1, 0)
    assert request.speculation.num_tokens == 1  # never under 1


def test_the_constant_schedule_keeps_the_back_off() -> None:
    """Under "constant" the back-off's draft length and pauses (speculation.record) stand as they are."""
    request = assisted_request("constant")
    state = request.speculation
    for drafted, accepted in [(4, 0), (4, 0), (4, 4), (3, 1)]:
        record(request, drafted, accepted, accepted + 1)
        before = (state.num_tokens, state.paused_steps, state.misses)
        after_verify(state, drafted, accepted)
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
