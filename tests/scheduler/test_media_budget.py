"""The embedding store's rows in the scheduler (scheduler/media_budget.py): a request with media is
encoded when admitted, waits while the store is full, and gives its rows back once its last
placeholder is computed, or when it stops (preempted requests are encoded again)."""

from __future__ import annotations

import torch

from tests.support.requests import sampling_entries
from tests.support.scheduling import scheduler_settings
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.memory.media_store import RequestMedia, media_digest
from transformers_cb.requests import Request
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.media_budget import MediaBudget
from transformers_cb.scheduler.scheduler import Scheduler
from transformers_cb.scheduler.step_plan import StepPlan

PS = 4


def scheduler(capacity: int, max_batch_tokens: int = 64, num_pages: int = 64) -> Scheduler:
    pages = PageManager([FullAttentionPolicy(PagePool(num_pages), PS)], [KVGroupSpec(FULL_ATTENTION, (0,))])
    return Scheduler(pages, scheduler_settings(), max_batch_tokens, 64, media=MediaBudget(capacity))


def with_image(request_id: str, placeholders: list[int], length: int = 12) -> Request:
    request = Request(request_id=request_id, prompt_ids=list(range(1, length + 1)), max_new_tokens=2)
    inputs = {"image": {"pixel_values": torch.zeros(1, 3, 2, 2)}}
    request.media = RequestMedia(inputs, {"image": placeholders}, media_digest(inputs))
    return request


def step(s: Scheduler) -> StepPlan:
    plan = s.schedule()
    s.update(plan, [[SampledToken(99)] for _ in sampling_entries(plan)])
    return plan


def test_rows_are_held_from_admission_to_the_last_placeholder() -> None:
    s = scheduler(capacity=8, max_batch_tokens=4)
    request = with_image("a", [2, 3, 4, 5, 6])
    s.add(request)
    plan = step(s)  # tokens 0-3: placeholders 2, 3 read; 4-6 still to come
    assert plan.encode == [request] and s.media.held == {"a": 5}
    plan = step(s)  # tokens 4-7: the last placeholder read
    assert plan.encode == [] and s.media.held == {}


def test_admission_waits_while_the_store_is_full() -> None:
    s = scheduler(capacity=6, max_batch_tokens=16)
    first, second = with_image("a", [1, 2, 3, 4, 5]), with_image("b", [1, 2, 3])
    s.add(first)
    s.add(second)
    plan = step(s)  # tokens and pages are left for the second, rows are not (5 + 3 > 6)
    assert [e.request for e in plan.entries] == [first] and s.media.held == {}
    plan = step(s)  # the first's rows went with its prefill
    assert plan.encode == [second] and s.media.held == {}


def test_a_preempted_request_gives_its_rows_back_and_is_encoded_again() -> None:
    s = scheduler(capacity=16, max_batch_tokens=4)
    request = with_image("a", [2, 3, 4, 5, 6])
    s.add(request)
    plan = step(s)
    s.preempt(request, plan)
    assert s.media.held == {}
    plan = step(s)
    assert plan.encode == [request] and request.num_computed_tokens == 4


def test_a_request_past_its_placeholders_needs_no_rows() -> None:
    budget = MediaBudget(4)
    request = with_image("a", [0, 1])
    request.num_computed_tokens = 2
    assert not budget.needs(request)
    assert budget.unfittable_reason(5) is not None and budget.unfittable_reason(4) is None


# -- blocks attending both ways (Gemma 3's images): a prefill chunk never ends inside one --------------


def with_block(request_id: str, first: int, last: int, length: int = 12) -> Request:
    request = with_image(request_id, list(range(first, last)), length)
    media = request.media
    request.media = RequestMedia(media.inputs, media.placeholders, media.digest, blocks=((first, last),))
    return request


def chunks(s: Scheduler, request_id: str) -> list[tuple[int, int]]:
    """(start, tokens) of `request_id`'s entries, step by step, until it has computed its prompt."""
    seen = []
    for _ in range(20):
        plan = step(s)
        mine = [e for e in plan.entries if e.request.request_id == request_id]
        seen += [(e.start, e.num_tokens) for e in mine]
        if any(e.start + e.num_tokens >= len(e.request.prompt_ids) for e in mine):
            return seen
    raise AssertionError(f"{request_id} did not finish its prompt: {seen}")


def test_a_chunk_is_cut_before_a_block_and_the_block_runs_whole() -> None:
    s = scheduler(capacity=16, max_batch_tokens=5)
    s.add(with_block("a", 3, 8))
    # 0-4 would end inside [3, 8): cut to 0-2; then the block whole (5 tokens), then the rest.
    assert chunks(s, "a") == [(0, 3), (3, 5), (8, 4)]


def test_a_block_waits_for_a_step_whose_budget_holds_it() -> None:
    s = scheduler(capacity=16, max_batch_tokens=5)
    busy = Request(request_id="busy", prompt_ids=[1, 2], max_new_tokens=8)
    s.add(busy)
    step(s)  # busy decodes from now on: 1 token a step, so 4 are left for "a"
    s.add(with_block("a", 0, 5, length=7))
    assert chunks(s, "a")[0] == (0, 5)  # never a part of the block
    assert not s.waiting


def test_a_block_longer_than_the_budget_is_refused_at_submission() -> None:
    budget = MediaBudget(64, max_chunk=5)
    assert budget.unfittable_reason(6, [(0, 6)]) is not None and "max_batch_tokens (5)" in str(
        budget.unfittable_reason(6, [(0, 6)])
    )
    assert budget.unfittable_reason(6, [(0, 5), (6, 11)]) is None
