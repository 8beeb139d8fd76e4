"""Partial-page prefix hits (kv/prefix_cache.py, kv/pool.py): a page's first tokens, in steps of `PARTIAL_STEP`,
are keyed as the page fills; a request whose next page starts with such tokens gets a page of its own holding a
copy of the cached one (a `PageCopy` in the next plan, its source pinned until the plan after) and skips them."""

from __future__ import annotations

import pytest

from tests.support.requests import page_ids, sampling_entries
from tests.support.scheduling import scheduler_settings
from transformers_cb.invariants import InvariantError
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_keys import PARTIAL_STEP, ROOT_KEY, partial_key
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.requests import Request, RequestStatus
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.scheduler import Scheduler
from transformers_cb.scheduler.step_plan import StepPlan

PS = 64  # four partial steps of 16 per page
SYSTEM = list(range(100, 150))  # 50 tokens: three partial steps (48) and two more


def scheduler_of(num_pages: int, max_batch_tokens: int = 512) -> Scheduler:
    pages = PageManager(
        [FullAttentionPolicy(PagePool(num_pages), PS)], [KVGroupSpec(FULL_ATTENTION, (0,))], sharing=True
    )
    return Scheduler(pages, scheduler_settings(), max_batch_tokens, 64)


def request(request_id: str, prompt: list[int], max_new_tokens: int = 2) -> Request:
    return Request(request_id=request_id, prompt_ids=list(prompt), max_new_tokens=max_new_tokens)


def step(scheduler: Scheduler) -> StepPlan:
    plan = scheduler.schedule()
    scheduler.check_integrity()
    scheduler.update(plan, [[SampledToken(7)] for _ in sampling_entries(plan)])
    scheduler.check_integrity()
    return plan


def drain(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        step(scheduler)


def test_a_prompt_sharing_part_of_a_finished_request_s_page_copies_it() -> None:
    scheduler = scheduler_of(8)
    first = request("a", SYSTEM + [1, 2, 3])
    scheduler.add(first)
    step(scheduler)
    source = page_ids(first)[0]
    drain(scheduler)
    pool = scheduler.pages.pools[0]
    assert pool.num_cached_pages == 1  # a page with partial keys only is kept for later hits
    second = request("b", SYSTEM + [4, 5])
    scheduler.add(second)
    plan = step(scheduler)
    # 48 of the 50 shared tokens (three steps of 16) come from a copy of a's page into b's own page
    assert [(e.request.request_id, e.start, e.num_tokens) for e in plan.entries] == [("b", 48, 4)]
    assert plan.copies == [(0, source, page_ids(second)[0])]
    assert page_ids(second)[0] != source
    assert scheduler.pages.prefix.stats.hit_tokens == 48


def test_a_running_request_s_page_is_copied_up_to_its_computed_tokens() -> None:
    scheduler = scheduler_of(8)
    first = request("a", SYSTEM, max_new_tokens=20)
    scheduler.add(first)
    step(scheduler)  # a computed its 50 prompt tokens: 48 are keyed
    second = request("b", SYSTEM + [4])
    scheduler.add(second)
    plan = step(scheduler)
    entries = {e.request.request_id: (e.start, e.num_tokens) for e in plan.entries}
    assert entries == {"a": (50, 1), "b": (48, 3)}
    assert plan.copies == [(0, page_ids(first)[0], page_ids(second)[0])]
    drain(scheduler)


def test_a_prompt_never_skips_its_last_token_and_a_short_share_is_a_miss() -> None:
    scheduler = scheduler_of(8)
    scheduler.add(request("a", SYSTEM))
    drain(scheduler)
    exact = request("b", SYSTEM[:48])  # 48 shared tokens, the last of which must run: 32 skipped
    short = request("c", SYSTEM[:15] + [9] * 20)  # under one partial step in common
    scheduler.add(exact)
    scheduler.add(short)
    plan = step(scheduler)
    assert [(e.request.request_id, e.start) for e in plan.entries] == [("b", 32), ("c", 0)]
    assert len(plan.copies) == 1


def test_the_copy_source_stays_pinned_until_the_plan_after_its_own() -> None:
    scheduler = scheduler_of(2)
    scheduler.add(request("a", SYSTEM))
    drain(scheduler)
    pool = scheduler.pages.pools[0]
    source = next(iter(pool._cached))
    second = request("b", SYSTEM + [4], max_new_tokens=4)
    third = request("c", [9] * 20, max_new_tokens=1)
    scheduler.add(second)
    scheduler.add(third)
    plan = scheduler.schedule()
    scheduler.check_integrity()
    # b took the one free page; the source is pinned (neither free nor cached): c has no page yet
    assert plan.copies == [(0, source, page_ids(second)[0])]
    assert pool.num_free_pages == 0 and third.status == RequestStatus.PENDING
    scheduler.update(plan, [[SampledToken(7)] for _ in sampling_entries(plan)])
    scheduler.schedule()  # this plan's hand-out unpins the source: it is cached again
    assert source in pool._cached


def test_a_hit_that_is_not_admitted_drops_its_copy_and_unpins_the_source() -> None:
    scheduler = scheduler_of(8)
    scheduler.safety_margin = 0.99
    scheduler.add(request("a", SYSTEM, max_new_tokens=1))
    drain(scheduler)
    scheduler.add(request("busy", [3] * 8, max_new_tokens=30))
    step(scheduler)
    waiting = request("b", SYSTEM + [4])
    scheduler.add(waiting)
    plan = step(scheduler)  # the safety margin refuses admission: b holds nothing, copies nothing
    assert plan.copies == [] and not waiting.holds_pages and waiting.num_computed_tokens == 0
    assert not scheduler.pages.pools[0]._pins


def test_pool_partial_keys_are_verified_and_go_with_an_evicted_page() -> None:
    pool = PagePool(2)
    (page,) = pool.allocate(1) or []
    content = tuple(range(PARTIAL_STEP))
    key = partial_key(ROOT_KEY, content)
    assert pool.register_partial(page, key, ROOT_KEY, content)
    assert not pool.register_partial(page, key, ROOT_KEY, content)  # one page per key
    assert pool.lookup_partial(key, ROOT_KEY, content) == page
    assert pool.lookup_partial(key, ROOT_KEY, content[:-1] + (0,)) is None  # a collision reads as a miss
    pool.release([page])
    assert pool.num_cached_pages == 1
    pool.check_integrity([])
    assert pool.allocate(2) is not None  # the cached page is evicted, its partial keys with it
    assert pool.lookup_partial(key, ROOT_KEY, content) is None
    pool.check_integrity([[0], [1]])


def test_pins_are_counted_and_checked() -> None:
    pool = PagePool(2)
    (page,) = pool.allocate(1) or []
    pool.register_partial(page, partial_key(ROOT_KEY, (1,) * 16), ROOT_KEY, (1,) * 16)
    pool.pin(page)
    pool.release([page])  # idle but pinned: neither free nor cached
    assert pool.num_free_pages == 1
    pool.check_integrity([])
    pool.unpin(page)
    assert pool.num_cached_pages == 1
    with pytest.raises(InvariantError, match="not pinned"):
        pool.unpin(page)
    pool._partials_of[page].append(b"x" * 16)  # a key the index does not hold
    with pytest.raises(InvariantError, match="partial keys"):
        pool.check_integrity([])


def test_requests_submitted_together_wait_for_the_first_one_s_partial_page() -> None:
    scheduler = scheduler_of(8)
    first, second = request("a", SYSTEM + [1], max_new_tokens=3), request("b", SYSTEM + [2, 3])
    other = request("c", [9] * 30)  # shares nothing: admitted beside a
    for r in (first, second, other):
        scheduler.add(r)
    plan = step(scheduler)
    # b waits (holding nothing) while a computes the tokens they share; c does not
    assert [e.request.request_id for e in plan.entries] == ["a", "c"]
    assert second.status == RequestStatus.PENDING and not second.holds_pages
    plan = step(scheduler)
    assert ("b", 48, 4) in [(e.request.request_id, e.start, e.num_tokens) for e in plan.entries]
    assert plan.copies == [(0, page_ids(first)[0], page_ids(second)[0])]
    drain(scheduler)
    assert not scheduler.pages.prefix._partial_promises
