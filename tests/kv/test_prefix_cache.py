"""Prefix sharing at the page level (PageManager, PagePool): exact page ids, refcounts, LRU eviction, forks, hybrid groups."""

from __future__ import annotations

import pytest

from tests.support.requests import page_ids, sampling_entries
from tests.support.scheduling import scheduler_settings
from transformers_cb.invariants import InvariantError
from transformers_cb.kv.layer_groups import FULL_ATTENTION, SLIDING_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_keys import ROOT_KEY, page_key, request_keys
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy, SlidingWindowPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.requests import Request, RequestStatus
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.scheduler import Scheduler
from transformers_cb.scheduler.step_plan import StepPlan

PS = 4


def sharing_scheduler(num_pages: int, max_batch_tokens: int = 64, sharing: bool = True) -> Scheduler:
    page_manager = PageManager(
        [FullAttentionPolicy(PagePool(num_pages), PS)],
        [KVGroupSpec(FULL_ATTENTION, (0,))],
        sharing=sharing,
    )
    return Scheduler(page_manager, scheduler_settings(), max_batch_tokens, 64)


def hybrid_scheduler(num_pages: int, window: int) -> Scheduler:
    pools = [PagePool(num_pages), PagePool(num_pages)]
    policies = [
        FullAttentionPolicy(pools[0], PS, 0),
        SlidingWindowPolicy(pools[1], PS, window, 1),
    ]
    specs = [KVGroupSpec(FULL_ATTENTION, (0,)), KVGroupSpec(SLIDING_ATTENTION, (1,), window)]
    return Scheduler(PageManager(policies, specs, sharing=True), scheduler_settings(), 64, 64)


def request(request_id: str, prompt: list[int], max_new_tokens: int = 2) -> Request:
    return Request(request_id=request_id, prompt_ids=list(prompt), max_new_tokens=max_new_tokens)


def step(scheduler: Scheduler, token: int = 99) -> StepPlan:
    """One step with a fake model that samples `token`; integrity checked before and after."""
    batch = scheduler.schedule()
    scheduler.check_integrity()
    scheduler.update(batch, [[SampledToken(token)] for _ in sampling_entries(batch)])
    scheduler.check_integrity()
    return batch


def drain(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        step(scheduler)


PROMPT = list(range(10, 30))  # 20 tokens = 5 full pages of 4


# -- PagePool's prefix cache ----------------------------------------------------------------------


def test_keys_chain_over_the_whole_prefix_and_are_stable() -> None:
    first = page_key(ROOT_KEY, [1, 2, 3, 4])
    assert first == page_key(ROOT_KEY, [1, 2, 3, 4])  # a digest, not Python's salted hash()
    assert len(first) == 16
    assert page_key(first, [5, 6, 7, 8]) != page_key(ROOT_KEY, [5, 6, 7, 8])  # same tokens, other prefix
    assert page_key(ROOT_KEY, [1, 2, 3, 4]) != page_key(ROOT_KEY, [1, 2, 3, 5])


def test_released_keyed_pages_are_cached_and_found_again() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)
    assert pages == [0, 1]
    key = page_key(ROOT_KEY, (1, 2))
    assert pool.register(0, key, ROOT_KEY, (1, 2))
    assert not pool.register(1, key, ROOT_KEY, (1, 2))  # the key already has a page
    pool.release([0, 1])
    assert list(pool._free) == [2, 3, 1]
    assert list(pool._cached) == [0]
    assert pool.num_free_pages == 4 and pool.num_cached_pages == 1
    pool.check_integrity([])
    assert pool.lookup(key, ROOT_KEY, (1, 2)) == 0
    assert pool.lookup(key, ROOT_KEY, (1, 3)) is None  # verified against the recorded tokens
    assert pool.lookup(key, key, (1, 2)) is None  # and the recorded parent
    pool.acquire(0)
    assert pool.refcount(0) == 1 and pool.num_cached_pages == 0
    pool.check_integrity([[0]])
    pool.acquire(0)  # a second holder of an in-use keyed page
    assert pool.refcount(0) == 2
    pool.check_integrity([[0], [0]])


def test_allocation_takes_free_pages_first_then_evicts_least_recently_used() -> None:
    pool = PagePool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for page in (0, 1, 2):
        pool.register(page, page_key(ROOT_KEY, (page,)), ROOT_KEY, (page,))
    pool.release([2])
    pool.release([0])
    pool.release([3])  # unkeyed: truly free
    pool.release([1])
    assert list(pool._free) == [3] and list(pool._cached) == [2, 0, 1]
    assert pool.allocate(2) == [3, 2]  # free first, then the oldest cached page
    assert pool.num_evictions == 1
    assert pool.key_of(2) is None
    assert pool.lookup(page_key(ROOT_KEY, (2,)), ROOT_KEY, (2,)) is None  # its key is forgotten
    assert pool.allocate(1) == [0]
    assert pool.allocate(1) == [1]
    assert pool.allocate(1) is None
    assert pool.num_evictions == 3
    pool.check_integrity([[3, 2, 0, 1]])


def test_integrity_covers_keys_and_both_free_lists() -> None:
    pool = PagePool(3)
    pool.allocate(1)
    pool.register(0, b"k" * 16, ROOT_KEY, (1,))
    pool.release([0])
    pool._free.append(0)  # cached and free at once
    with pytest.raises(InvariantError, match="both free and cached"):
        pool.check_integrity()
    pool._free.pop()
    pool._page_of[b"x" * 16] = 0  # a second key pointing at the page
    with pytest.raises(InvariantError, match="one to one"):
        pool.check_integrity()


def test_acquire_of_an_unkeyed_page_is_a_bug() -> None:
    pool = PagePool(2)
    pool.allocate(1)
    with pytest.raises(InvariantError):
        pool.acquire(0)


# -- hits at admission ---------------------------------------------------------------------------


def test_full_hit_takes_every_page_but_the_one_holding_the_last_token() -> None:
    scheduler = sharing_scheduler(num_pages=16)
    first = request("a", PROMPT)
    scheduler.add(first)
    step(scheduler)
    assert page_ids(first) == [0, 1, 2, 3, 4]
    drain(scheduler)
    pool = scheduler.pages.pools[0]
    assert pool.num_cached_pages == 5  # pages 0-4 full (20 prompt tokens); 5 held only the sampled token
    second = request("b", PROMPT)
    scheduler.add(second)
    batch = step(scheduler)
    # Pages 0-3 are hits; page 4 holds the last prompt token, which must run to give logits.
    assert [(e.request.request_id, e.start, e.num_tokens) for e in batch.entries] == [("b", 16, 4)]
    assert page_ids(second)[:4] == [0, 1, 2, 3]
    assert page_ids(second)[4] not in (0, 1, 2, 3)
    assert scheduler.pages.prefix.stats.hit_tokens == 16


def test_partial_hit_and_miss() -> None:
    scheduler = sharing_scheduler(num_pages=32)
    scheduler.add(request("a", PROMPT))
    drain(scheduler)
    partial = request("b", PROMPT[:9] + [7, 7, 7, 7, 7, 7, 7])  # shares 2 full pages (8 tokens)
    miss = request("c", [5] + PROMPT[1:])  # differs in the first token: no page matches
    scheduler.add(partial)
    scheduler.add(miss)
    batch = step(scheduler)
    assert [(e.request.request_id, e.start) for e in batch.entries] == [("b", 8), ("c", 0)]
    assert page_ids(partial)[:2] == [0, 1]
    assert not set(page_ids(miss)) & {0, 1, 2, 3, 4}


def test_shared_pages_are_refcounted_while_both_run() -> None:
    scheduler = sharing_scheduler(num_pages=32)
    scheduler.add(request("a", PROMPT, max_new_tokens=6))
    step(scheduler)
    step(scheduler)  # a's full prompt pages are keyed after its first step
    second = request("b", PROMPT + [1], max_new_tokens=2)
    scheduler.add(second)
    step(scheduler)
    pool = scheduler.pages.pools[0]
    assert page_ids(second)[:5] == [0, 1, 2, 3, 4]
    assert [pool.refcount(p) for p in range(5)] == [2] * 5
    scheduler.finish(second, RequestStatus.CANCELLED)  # cancel: references drop, pages stay with a
    assert [pool.refcount(p) for p in range(5)] == [1] * 5
    scheduler.check_integrity()


def test_refcounts_after_preemption_and_finish() -> None:
    scheduler = sharing_scheduler(num_pages=32)
    first = request("a", PROMPT, max_new_tokens=8)
    scheduler.add(first)
    step(scheduler)
    batch = StepPlan(entries=[])
    scheduler.preempt(first, batch)
    pool = scheduler.pages.pools[0]
    assert pool.num_used_pages == 0 and pool.num_cached_pages == 5
    assert first.num_registered_pages == 0
    back = step(scheduler)  # the preempted request comes back and hits its own pages
    assert [(e.start, e.num_tokens) for e in back.entries] == [(20, 1)]
    assert page_ids(first)[:5] == [0, 1, 2, 3, 4]
    drain(scheduler)
    assert first.is_finished
    assert all(pool.refcount(p) == 0 for p in range(32))
    assert pool.num_cached_pages == 6  # 27 tokens of KV (the last token's is never computed): 6 full pages


def test_not_admitted_hit_goes_back_to_the_cache() -> None:
    scheduler = sharing_scheduler(num_pages=16)
    scheduler.safety_margin = 0.99
    scheduler.add(request("a", PROMPT, max_new_tokens=1))
    drain(scheduler)
    scheduler.add(request("busy", [3] * 8, max_new_tokens=30))
    step(scheduler)
    waiting = request("b", PROMPT)
    scheduler.add(waiting)
    step(scheduler)  # the safety margin refuses admission: b holds nothing
    assert waiting.status == RequestStatus.PENDING and not waiting.holds_pages
    assert waiting.num_computed_tokens == 0
    assert scheduler.pages.prefix.stats.hit_tokens == 0


def test_eviction_under_pressure_keeps_outputs_correct() -> None:
    scheduler = sharing_scheduler(num_pages=8)
    scheduler.add(request("a", PROMPT))
    drain(scheduler)
    scheduler.add(request("b", [1] * 20))  # needs 6 pages: evicts cached ones, oldest first
    drain(scheduler)
    assert scheduler.pages.num_evictions >= 3
    third = request("c", PROMPT)
    scheduler.add(third)
    batch = step(scheduler)
    assert batch.entries[0].start < 16  # some of a's pages were evicted


def test_sharing_off_never_hits() -> None:
    scheduler = sharing_scheduler(num_pages=16, sharing=False)
    scheduler.add(request("a", PROMPT))
    drain(scheduler)
    assert scheduler.pages.pools[0].num_cached_pages == 0
    scheduler.add(request("b", PROMPT))
    assert step(scheduler).entries[0].start == 0


def test_prompt_logprob_requests_compute_every_position() -> None:
    scheduler = sharing_scheduler(num_pages=32)
    scheduler.add(request("a", PROMPT))
    drain(scheduler)

    class WantsPromptLogprobs(Request):
        wants_prompt_logprobs = True

    second = WantsPromptLogprobs(request_id="b", prompt_ids=list(PROMPT), max_new_tokens=2)
    scheduler.add(second)
    assert step(scheduler).entries[0].start == 0


# -- hybrid models -------------------------------------------------------------------------------


def test_hybrid_hit_needs_the_window_pages_of_the_sliding_group() -> None:
    scheduler = hybrid_scheduler(num_pages=32, window=6)
    first = request("a", PROMPT, max_new_tokens=1)
    scheduler.add(first)
    drain(scheduler)
    full_pool, sliding_pool = scheduler.pages.pools
    assert full_pool.num_cached_pages == 5 and sliding_pool.num_cached_pages == 5
    second = request("b", PROMPT + [1, 2, 3, 4])
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.entries[0].start == 20
    sliding = second.pages[1]
    # Queries from 20 read keys (14, 20]: logical pages 3 and 4 only.
    assert sliding.first_page == 3 and sliding.page_ids[:2] == [3, 4]
    assert second.pages[0].page_ids[:5] == [0, 1, 2, 3, 4]
    scheduler.update(batch, [[SampledToken(99)]] * len(sampling_entries(batch)))
    scheduler.check_integrity()


def test_hybrid_hit_stops_where_a_window_page_is_missing() -> None:
    scheduler = hybrid_scheduler(num_pages=32, window=6)
    scheduler.add(request("a", PROMPT, max_new_tokens=1))
    drain(scheduler)
    full_pool, sliding_pool = scheduler.pages.pools
    evicted = sliding_pool._page_of[request_keys(request("x", PROMPT), 5, PS)[4]]
    del sliding_pool._cached[evicted]  # evict logical page 4 of the sliding group by hand
    sliding_pool._forget(evicted)
    sliding_pool._free.append(evicted)
    scheduler.check_integrity()
    second = request("b", PROMPT + [1, 2, 3, 4])
    scheduler.add(second)
    batch = scheduler.schedule()
    # 20 would need sliding pages 3-4; 16 needs pages 2-3, all there.
    assert batch.entries[0].start == 16
    assert second.pages[1].first_page == 2
    scheduler.update(batch, [[SampledToken(99)]] * len(sampling_entries(batch)))
    scheduler.check_integrity()


# -- forks ---------------------------------------------------------------------------------------


def forked_parent(prompt: list[int], num_children: int, max_new_tokens: int = 3) -> Request:
    parent = request("p", prompt, max_new_tokens)
    parent.siblings = [request(f"p__child#{i}", prompt, max_new_tokens) for i in range(num_children)]
    for child in parent.siblings:
        child.fork_parent = parent
    parent.fork_children = list(parent.siblings)
    return parent


def test_fork_shares_full_pages_and_copies_the_last_prompt_page() -> None:
    scheduler = sharing_scheduler(num_pages=32)
    parent = forked_parent(list(range(10, 28)), num_children=2)  # 18 tokens: last one on page 4
    scheduler.add(parent)
    first = step(scheduler)
    assert [e.request.request_id for e in first.entries] == ["p"]
    child0, child1 = parent.siblings
    assert page_ids(parent) == [0, 1, 2, 3, 4]
    assert page_ids(child0) == [0, 1, 2, 3, 5] and page_ids(child1) == [0, 1, 2, 3, 6]
    pool = scheduler.pages.pools[0]
    assert [pool.refcount(p) for p in range(7)] == [3, 3, 3, 3, 1, 1, 1]
    second = step(scheduler)
    assert second.copies == [(0, 4, 5), (0, 4, 6)]
    # The siblings recompute the last prompt token in their own copy and sample their first token.
    assert [(e.request.request_id, e.start, e.num_tokens) for e in second.entries] == [
        ("p", 18, 1),
        ("p__child#0", 17, 1),
        ("p__child#1", 17, 1),
    ]
    drain(scheduler)
    assert all(r.is_finished and len(r.generated_ids) == 3 for r in parent.family)
    assert scheduler.pages.prefix.stats.forks == 2


def test_fork_without_a_free_page_falls_back_to_independent_requests() -> None:
    scheduler = sharing_scheduler(num_pages=5)
    parent = forked_parent(list(range(10, 27)), num_children=1, max_new_tokens=1)  # 17 tokens: 5 pages
    scheduler.add(parent)
    step(scheduler)
    (child,) = parent.siblings
    assert child.status == RequestStatus.PENDING and child in scheduler.waiting
    drain(scheduler)
    assert child.is_finished and child.generated_ids == [99]


def test_cancelling_an_unforked_sibling_and_a_parent_before_its_fork() -> None:
    scheduler = sharing_scheduler(num_pages=32)
    parent = forked_parent(PROMPT, num_children=2)
    scheduler.add(parent)
    child0, child1 = parent.siblings
    scheduler.finish(child0, RequestStatus.CANCELLED)
    assert parent.fork_children == [child1]
    scheduler.finish(parent, RequestStatus.CANCELLED)  # its last sibling goes on alone
    assert child1 in scheduler.waiting and not parent.fork_children
    drain(scheduler)
    assert child1.status == RequestStatus.FINISHED


def test_without_sharing_siblings_are_queued_as_requests() -> None:
    scheduler = sharing_scheduler(num_pages=32, sharing=False)
    parent = forked_parent(PROMPT, num_children=2)
    scheduler.add(parent)
    assert list(scheduler.waiting) == parent.family


def test_requests_submitted_together_wait_for_the_first_ones_prefix_pages() -> None:
    scheduler = sharing_scheduler(num_pages=32, max_batch_tokens=64)
    first, second = request("a", PROMPT + [1], max_new_tokens=4), request("b", PROMPT + [2])
    other = request("c", [3] * 9)
    for r in (first, second, other):
        scheduler.add(r)
    batch = step(scheduler)
    # b would compute a's five pages again in the same step: it waits, c does not.
    assert [e.request.request_id for e in batch.entries] == ["a", "c"]
    assert second.status == RequestStatus.PENDING and not second.holds_pages
    batch = step(scheduler)
    assert [(e.request.request_id, e.start, e.num_tokens) for e in batch.entries][-1] == ("b", 20, 1)
    assert page_ids(second)[:5] == page_ids(first)[:5]


def test_a_preempted_promiser_releases_the_waiters() -> None:
    scheduler = sharing_scheduler(num_pages=32, max_batch_tokens=8)  # a's prompt takes 3 chunks
    first, second = request("a", PROMPT + [1]), request("b", PROMPT + [2])
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)
    assert second.status == RequestStatus.PENDING
    scheduler.preempt(first, StepPlan(entries=[]))
    scheduler.check_integrity()  # promises withdrawn with the pages
    assert not scheduler.pages.prefix._in_flight or first.num_promised_pages == 0
    drain(scheduler)
    assert first.is_finished and second.is_finished
