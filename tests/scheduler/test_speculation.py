"""Prompt lookup's drafts (the same as transformers' `PromptLookupCandidateGenerator`), their limits, and
the per-request back-off."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from tests.support.scheduling import scheduler_settings
from transformers_cb.config.draft_settings import LookupSettings, lookup_settings, request_lookup
from transformers_cb.requests import Request
from transformers_cb.scheduler.speculation.back_off import (
    MAX_PAUSE_STEPS,
    SpeculationState,
    draft_length,
    record,
)
from transformers_cb.scheduler.speculation.drafts import fit_draft
from transformers_cb.scheduler.speculation.prompt_lookup import PROMPT_LOOKUP, lookup


def propose(request: Request, budget: int) -> list[int]:
    """What a step with `budget` tokens left runs of the request's lookup draft (the source proposes,
    the schedule cuts)."""
    return fit_draft(request, budget, PROMPT_LOOKUP.propose([request]).get(request.request_id, []))


def lookup_schedule(scheduler):
    """A schedule handed prompt lookup's drafts for the running requests, as the engine does."""
    return scheduler.schedule(PROMPT_LOOKUP.propose(scheduler.running))


@pytest.mark.parametrize("seed", range(40))
def test_lookup_matches_transformers_prompt_lookup(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
    num_tokens, max_ngram = rng.randint(1, 6), rng.randint(1, 4)
    generator = PromptLookupCandidateGenerator(
        num_output_tokens=num_tokens, max_matching_ngram_size=max_ngram, max_length=1000
    )
    candidates, _ = generator.get_candidates(torch.tensor([tokens]))
    expected = candidates[0, len(tokens) :].tolist()
    assert lookup(tokens, max_ngram, num_tokens) == expected


def test_lookup_prefers_the_longest_ngram() -> None:
    # the 1-gram [3] first occurs before "9 3", the 2-gram [9, 3] later: the 2-gram's continuation wins
    tokens = [3, 4, 5, 9, 3, 7, 8, 1, 9, 3]
    assert lookup(tokens, 2, 2) == [7, 8]
    assert lookup(tokens, 1, 2) == [4, 5]
    assert lookup([1, 2, 3], 2, 4) == []


def test_lookup_min_ngram_skips_shorter_matches() -> None:
    tokens = [3, 4, 5, 9, 6, 7, 8, 1, 2, 3]  # the last 2-gram [2, 3] never occurred before; [3] did
    assert lookup(tokens, 2, 2) == [4, 5]
    assert lookup(tokens, 2, 2, min_ngram=2) == []
    assert lookup([9, 3, 4, 5, 9, 3], 2, 2, min_ngram=2) == [4, 5]


def test_propose_drafts_only_after_a_two_token_match() -> None:
    # vLLM's prompt_lookup_min: a 1-gram match proposes nothing unless the request's n-gram size is 1
    one_gram = _decoding([3, 4, 5, 9, 6, 7, 8, 1, 2], [3], max_new=20, settings=LookupSettings(4, 2))
    assert propose(one_gram, budget=100) == []
    only_ones = _decoding([3, 4, 5, 9, 6, 7, 8, 1, 2], [3], max_new=20, settings=LookupSettings(4, 1))
    assert propose(only_ones, budget=100) == [4, 5, 9, 6]
    two_gram = _decoding([3, 4, 5, 9, 6, 7, 8, 2, 3, 1, 2], [3], max_new=20, settings=LookupSettings(4, 2))
    assert propose(two_gram, budget=100) == [1, 2, 3]


def _decoding(prompt: list[int], generated: list[int], max_new: int, settings: LookupSettings) -> Request:
    request = Request("r", prompt, max_new, eos_token_ids=frozenset({0}))
    for token in generated:
        request.append_token(token)
    request.num_computed_tokens = request.num_tokens - 1  # decoding: its last token not run yet
    request.speculation = SpeculationState(settings.num_tokens, PROMPT_LOOKUP, settings.max_ngram)
    return request


def test_propose_respects_budget_max_new_tokens_and_eos() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 5, 6]
    request = _decoding(prompt, [7], max_new=20, settings=LookupSettings(4, 2))
    assert propose(request, budget=100) == [8, 9, 10, 5]
    assert propose(request, budget=3) == [8, 9]  # the last token runs too
    assert propose(request, budget=1) == []
    short = _decoding(prompt, [7], max_new=3, settings=LookupSettings(4, 2))
    assert propose(short, budget=100) == [8]  # 1 generated + 1 draft + the target's own = 3
    with_eos = _decoding([5, 6, 7, 0, 9, 5, 6], [7], max_new=20, settings=LookupSettings(4, 2))
    assert propose(with_eos, budget=100) == []  # the draft starts with eos: nothing past it


def test_back_off_follows_the_acceptance_and_pauses() -> None:
    request = _decoding([1, 2, 3, 1, 2], [3], max_new=50, settings=LookupSettings(8, 2))
    state = request.speculation
    assert state is not None and state.num_tokens == 8
    record(request, drafted=8, accepted=8, emitted=9)
    assert state.num_tokens == 8  # nothing rejected yet: the maximum
    record(request, drafted=8, accepted=3, emitted=4)
    assert state.num_tokens == 8  # p = (0.7 * 8 + 3) / (... + 1) ~ 0.9: runs of ~9 expected
    for _ in range(12):  # one token accepted, then a rejection, again and again: p -> 1/2
        record(request, drafted=4, accepted=1, emitted=2)
    assert state.num_tokens == 1
    for _ in range(8):  # long runs again: the draft grows back
        record(request, drafted=state.num_tokens, accepted=state.num_tokens, emitted=state.num_tokens + 1)
    assert state.num_tokens >= 6
    record(request, drafted=6, accepted=0, emitted=1)
    assert state.paused_steps == 0  # one miss: no pause yet
    record(request, drafted=5, accepted=0, emitted=1)
    assert state.paused_steps == 2
    assert propose(request, budget=100) == [] and propose(request, budget=100) == []
    assert propose(request, budget=100) != []  # the pause is over
    for _ in range(20):
        record(request, drafted=1, accepted=0, emitted=1)
    assert state.paused_steps == MAX_PAUSE_STEPS and state.num_tokens == 1
    assert state.stats.steps == 2 + 12 + 8 + 2 + 20


def test_draft_length_is_the_expected_accepted_run() -> None:
    state = SpeculationState(10, PROMPT_LOOKUP, 2)
    assert draft_length(state) == 10
    state.accepted_recently, state.rejected_recently = 4.0, 1.0  # p = 0.8: runs of 4
    assert draft_length(state) == 4
    state.accepted_recently, state.rejected_recently = 1.0, 1.0  # p = 0.5: runs of 1
    assert draft_length(state) == 1
    state.accepted_recently, state.rejected_recently = 0.0, 3.0
    assert draft_length(state) == 1
    state.accepted_recently, state.rejected_recently = 99.0, 1.0
    assert draft_length(state) == 10


def test_settings_validation_and_per_request_override() -> None:
    default = lookup_settings(5, None, "GenerationConfig")
    assert default == LookupSettings(5, 2)
    assert lookup_settings(0, 3, "x") is None
    assert request_lookup(default, {}, "r") == default
    assert request_lookup(default, {"prompt_lookup_num_tokens": 0}, "r") is None
    assert request_lookup(default, {"max_matching_ngram_size": 4}, "r") == LookupSettings(5, 4)
    assert request_lookup(None, {"prompt_lookup_num_tokens": 3}, "r") == LookupSettings(3, 2)
    for bad in (
        {"prompt_lookup_num_tokens": -1},
        {"prompt_lookup_num_tokens": 2.5},
        {"max_matching_ngram_size": 0},
    ):
        with pytest.raises(ValueError, match="request 7"):
            request_lookup(default, bad, "request 7")


# -- the scheduler's side of a verification step ---------------------------------------------------


def _speculating_scheduler(eos: frozenset[int] = frozenset(), max_batch_tokens: int = 64):
    from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
    from transformers_cb.kv.page_manager import PageManager
    from transformers_cb.kv.page_policies import FullAttentionPolicy
    from transformers_cb.kv.pool import PagePool
    from transformers_cb.scheduler.scheduler import Scheduler

    pages = PageManager(
        [FullAttentionPolicy(PagePool(16), 4)], [KVGroupSpec(FULL_ATTENTION, (0,))], sharing=True
    )
    scheduler = Scheduler(pages, scheduler_settings(), max_batch_tokens, 8)
    request = Request("r", [5, 6, 7, 8, 9, 5, 6], 20, eos_token_ids=eos)
    request.speculation = SpeculationState(4, PROMPT_LOOKUP, 2)
    scheduler.add(request)
    while not request.generated_ids:  # the prompt, in chunks under a tight budget
        plan = lookup_schedule(scheduler)
        scheduler.update(plan, [[SampledToken(7)]] if plan.entries[0].samples else [])
    return scheduler, request


from transformers_cb.sampling.sampled_token import SampledToken  # noqa: E402


def test_the_budget_counts_draft_tokens_and_rejected_pages_go_back() -> None:
    scheduler, request = _speculating_scheduler()
    plan = lookup_schedule(scheduler)
    (entry,) = plan.entries
    assert entry.draft == [8, 9, 5, 6] and entry.num_tokens == 5 and plan.num_tokens == 5
    assert entry.token_ids == [7, 8, 9, 5, 6]
    pool = scheduler.pages.pools[0]
    assert len(request.pages[0].page_ids) == 3  # 12 tokens of KV: 7 + 5
    # The target accepts 8, rejects 9 and says 1 instead.
    scheduler.update(plan, [[SampledToken(8), SampledToken(1)]])
    assert request.generated_ids == [7, 8, 1]
    assert request.num_computed_tokens == 9  # prompt, 7 and 8: the KV of the accepted tokens only
    assert len(request.pages[0].page_ids) == 3 and pool.num_free_pages == 16 - 3
    assert request.num_registered_pages == 2  # full pages of accepted tokens only
    scheduler.check_integrity()
    stats = request.speculation.stats
    assert (stats.drafted, stats.accepted, stats.emitted) == (4, 1, 2)
    assert scheduler.speculation.accepted == 1


def test_a_rollback_is_one_decision_the_next_plan_carries() -> None:
    """The pages of rejected draft tokens go back in `update`; the block-table side of that rollback (the
    columns the rows forget, with each group's end page right after the release) rides in the next plan's
    `taken_back`, once, for the runner to execute before it packs."""
    from transformers_cb.scheduler.step_plan import TakeBack

    scheduler, request = _speculating_scheduler()
    plan = lookup_schedule(scheduler)
    assert plan.taken_back == [] and plan.entries[0].draft == [8, 9, 5, 6]
    assert len(request.pages[0].page_ids) == 3  # 12 tokens of KV
    scheduler.update(plan, [[SampledToken(1)]])  # the first draft token is rejected
    assert request.num_computed_tokens == 8 and len(request.pages[0].page_ids) == 2
    assert scheduler.taken_back == [TakeBack(request, (2,))]
    following = lookup_schedule(scheduler)
    assert following.taken_back == [TakeBack(request, (2,))] and scheduler.taken_back == []
    scheduler.update(following, [[SampledToken(3)] for entry in following.entries if entry.samples][:1])
    assert lookup_schedule(scheduler).taken_back == []


def test_a_tight_budget_shortens_the_draft() -> None:
    scheduler, request = _speculating_scheduler(max_batch_tokens=3)
    (entry,) = lookup_schedule(scheduler).entries
    assert entry.draft == [8, 9] and entry.num_tokens == 3


def test_eos_inside_a_verified_run_ends_the_request_there() -> None:
    """A run whose accepted tokens hold an eos (a draft model may propose one) stops at it: the tokens
    after it are dropped, the pages freed."""
    scheduler, request = _speculating_scheduler(eos=frozenset({9}))
    plan = lookup_schedule(scheduler)
    (entry,) = plan.entries
    assert entry.draft == [8]  # lookup drafts stop before an eos
    entry.draft = [8, 9, 5]  # as a draft model could propose
    scheduler.update(plan, [[SampledToken(8), SampledToken(9), SampledToken(5), SampledToken(3)]])
    assert request.generated_ids == [7, 8, 9] and request.finish_reason == "stop"
    assert request.is_finished and scheduler.pages.pools[0].num_used_pages == 0


def test_no_drafts_in_steps_with_more_running_requests_than_the_speculation_limit() -> None:
    """vLLM's `disable_by_batch_size`: with more running requests than `speculation_max_batch`, nobody
    drafts this step (a large batch's step is compute-bound); at or under it, drafting resumes."""
    scheduler, request = _speculating_scheduler()
    scheduler.speculation_max_batch = 1
    assert scheduler.speculates_now()
    other = Request("o", [1, 2, 3], 20)
    scheduler.add(other)
    scheduler.update(
        lookup_schedule(scheduler), [[SampledToken(7)], [SampledToken(4)]]
    )  # "o" joins the batch
    assert len(scheduler.running) == 2 and not scheduler.speculates_now()
    plan = lookup_schedule(scheduler)
    assert all(entry.draft == [] for entry in plan.entries) and plan.num_tokens == 2
    scheduler.speculation_max_batch = 2
    assert scheduler.speculates_now()


def test_the_speculation_limit_is_validated_and_resolved_per_device() -> None:
    from transformers_cb.config.continuous_batching import (
        CPU_SPECULATION_MAX_BATCH,
        ContinuousBatchingConfig,
        resolve_speculation_max_batch,
    )

    with pytest.raises(ValueError, match="speculation_max_batch_size"):
        ContinuousBatchingConfig(speculation_max_batch_size=0).validate()
    assert resolve_speculation_max_batch(ContinuousBatchingConfig(), "cpu") == CPU_SPECULATION_MAX_BATCH
    assert resolve_speculation_max_batch(ContinuousBatchingConfig(), "cuda") is None
    assert resolve_speculation_max_batch(ContinuousBatchingConfig(speculation_max_batch_size=3), "cuda") == 3
