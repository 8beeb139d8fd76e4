"""The embedding store's rows in the scheduler (scheduler/media_budget.py): a request with media is
encoded when admitted, waits while the store is full, and gives its rows back once its last
placeholder is computed, or when it stops (preempted requests are encoded again)."""

from __future__ import annotations

import torch

from tests.support.requests import sampling_entries
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.memory.media_store import RequestMedia, media_digest
from transformers_cb.requests import Request
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.media_budget import MediaBudget
from transformers_cb.scheduler.plan import StepPlan
from transformers_cb.scheduler.policies import make_policy
from transformers_cb.scheduler.scheduler import Scheduler

PS = 4


def scheduler(capacity: int, max_batch_tokens: int = 64, num_pages: int = 64) -> Scheduler:
    pages = PageManager([FullAttentionPolicy(PagePool(num_pages), PS)], [KVGroupSpec(FULL_ATTENTION, (0,))])
    return Scheduler(pages, max_batch_tokens, 64, 0.0, make_policy("fifo"), media=MediaBudget(capacity))


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
