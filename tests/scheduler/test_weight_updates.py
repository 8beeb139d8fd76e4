"""Weight updates in the scheduler (scheduler/weight_updates.py): a new weight version drops every page's
prefix key and the promises of pages being computed; the requests in flight are kept, recomputed or
aborted by the mode; a request's generated tokens record the version that produced them. No model: the
tokens are fakes, the pages and keys are the scheduler's own."""

from __future__ import annotations

import pytest

from tests.support.requests import sampling_entries
from tests.support.scheduling import scheduler_settings
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.offload import CpuOffload
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.requests import Request, RequestStatus
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.scheduler import Scheduler
from transformers_cb.scheduler.step_plan import StepPlan
from transformers_cb.scheduler.weight_updates import check_update_mode, stronger

PS = 4
SYSTEM = list(range(10, 30))  # 20 tokens: 5 full pages of 4


def scheduler_of(num_pages: int = 64, max_batch_tokens: int = 256, sharing: bool = True) -> Scheduler:
    pages = PageManager(
        [FullAttentionPolicy(PagePool(num_pages), PS)], [KVGroupSpec(FULL_ATTENTION, (0,))], sharing=sharing
    )
    return Scheduler(pages, scheduler_settings(), max_batch_tokens, 64)


def request(
    request_id: str, suffix: int, max_new_tokens: int = 6, max_staleness: int | None = None
) -> Request:
    made = Request(request_id=request_id, prompt_ids=[*SYSTEM, suffix], max_new_tokens=max_new_tokens)
    made.max_staleness = max_staleness
    return made


def step(scheduler: Scheduler) -> StepPlan:
    batch = scheduler.schedule()
    scheduler.check_integrity()
    scheduler.update(batch, [[SampledToken(99)] for _ in sampling_entries(batch)])
    scheduler.check_integrity()
    return batch


def pool(scheduler: Scheduler) -> PagePool:
    return scheduler.pages.pools[0]


def decoding(scheduler: Scheduler, *requests: Request) -> None:
    for made in requests:
        scheduler.add(made)
    while not all(len(r.generated_ids) >= 2 for r in requests):
        step(scheduler)


def test_an_update_drops_every_key_cached_or_in_use() -> None:
    scheduler = scheduler_of()
    done, running = request("done", 1, max_new_tokens=1), request("running", 2)
    scheduler.add(done)
    step(scheduler)
    assert done.is_finished and pool(scheduler).num_cached_pages > 0
    scheduler.add(running)
    step(scheduler)
    assert running.num_computed_tokens == 21 and pool(scheduler).num_keyed_pages == 5
    assert scheduler.weights_changed("keep") == []
    assert scheduler.weight_version == 1
    assert pool(scheduler).num_keyed_pages == 0 and pool(scheduler).num_cached_pages == 0
    scheduler.check_integrity()
    # A request with the same prefix finds nothing: it computes its prompt under the new weights.
    fresh = request("fresh", 3)
    scheduler.add(fresh)
    batch = step(scheduler)
    assert ("fresh", 0, 21) in [(e.request.request_id, e.start, e.num_tokens) for e in batch.entries]
    assert fresh.kv_version == 1 and running.kv_version == 0
    # The kept request keys nothing any more (its new pages attend to stale KV); the fresh one does.
    while not running.is_finished:
        step(scheduler)
    keyed = {pool(scheduler).key_of(p) for p in fresh.pages[0].page_ids} - {None}
    assert len(keyed) >= 5 and pool(scheduler).num_keyed_pages == len(keyed)
    assert scheduler.pages.prefix.dropped_keys == 5


def test_promises_of_pages_being_computed_are_withdrawn() -> None:
    """A request waiting for a running one's promised pages is not held back by pages that will never be
    keyed: it computes them itself under the new weights."""
    scheduler = scheduler_of(max_batch_tokens=8)  # the first prompt takes 3 chunks
    first, second = request("a", 1), request("b", 2)
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)
    assert second.status == RequestStatus.PENDING and first.num_promised_pages == 5
    scheduler.weights_changed("keep")
    scheduler.check_integrity()
    assert first.num_promised_pages == 0 and not scheduler.pages.waits_for_pages(second)
    while scheduler.has_work():
        step(scheduler)
    assert first.is_finished and second.is_finished
    assert second.kv_version == 1 and first.kv_version == 0


def test_recompute_drops_the_kv_of_every_request_in_flight() -> None:
    scheduler = scheduler_of()
    a, b = request("a", 1), request("b", 2)
    decoding(scheduler, a, b)
    before = {r.request_id: list(r.generated_ids) for r in (a, b)}
    assert scheduler.weights_changed("recompute") == []
    scheduler.check_integrity()
    assert scheduler.running == [] and list(scheduler.waiting) == [a, b]
    for made in (a, b):
        assert made.status == RequestStatus.EVICTED and made.num_computed_tokens == 0
        assert not made.holds_pages
    assert pool(scheduler).num_used_pages == 0 and pool(scheduler).num_keyed_pages == 0
    batch = step(scheduler)
    starts = {e.request.request_id: (e.start, e.num_tokens) for e in batch.entries}
    # a recomputes prompt + its tokens from 0; b waits for a's promised pages, then hits them.
    assert starts == {"a": (0, len(a.all_token_ids) - 1)}
    assert a.kv_version == 1
    while scheduler.has_work():
        step(scheduler)
    for made in (a, b):
        assert made.generated_ids[: len(before[made.request_id])] == before[made.request_id]
        assert made.weight_version_runs == [(0, 0), (len(before[made.request_id]), 1)]
    assert scheduler.recomputed.total > 0


def test_abort_ends_the_requests_in_flight_with_their_tokens() -> None:
    scheduler = scheduler_of(max_batch_tokens=64)
    a, b = request("a", 1), request("b", 2)
    decoding(scheduler, a, b)
    waiting = request("waiting", 3)
    scheduler.add(waiting)
    tokens = list(a.generated_ids)
    ended = scheduler.weights_changed("abort")
    scheduler.check_integrity()
    assert ended == [a, b]
    for made in ended:
        assert made.status == RequestStatus.ABORTED and made.finish_reason == "aborted"
        assert "weight version 1" in (made.error or "")
    assert a.generated_ids == tokens and a.to_output().status == RequestStatus.ABORTED
    assert list(scheduler.waiting) == [waiting] and pool(scheduler).num_used_pages == 0
    while scheduler.has_work():
        step(scheduler)
    assert waiting.status == RequestStatus.FINISHED and waiting.weight_version_runs == [(0, 1)]


def test_keep_records_the_version_of_each_token() -> None:
    scheduler = scheduler_of()
    a = request("a", 1)
    decoding(scheduler, a)
    changed_at = len(a.generated_ids)
    scheduler.weights_changed("keep")
    while scheduler.has_work():
        step(scheduler)
    output = a.to_output()
    assert output.weight_version_runs == ((0, 0), (changed_at, 1))
    assert (output.weight_version_first, output.weight_version_last) == (0, 1)
    assert output.weight_version_changed_at == changed_at
    assert output.kv_weight_version == 0  # its KV came across the update
    assert [output.weight_version_of(i) for i in range(len(output.generated_tokens))] == [0] * changed_at + [
        1
    ] * (len(output.generated_tokens) - changed_at)


def test_max_staleness_recomputes_what_would_lag_too_far() -> None:
    scheduler = scheduler_of()
    strict, lenient, free = request("strict", 1, 12, 0), request("lenient", 2, 12, 1), request("free", 3, 12)
    decoding(scheduler, strict, lenient, free)
    scheduler.weights_changed("keep")
    scheduler.check_integrity()
    assert strict.status == RequestStatus.EVICTED and strict.num_computed_tokens == 0
    assert lenient in scheduler.running and free in scheduler.running
    step(scheduler)
    assert strict.kv_version == 1
    scheduler.weights_changed("keep")  # lenient's KV now lags 2 versions behind; strict's only 1 (> 0)
    scheduler.check_integrity()
    assert lenient.status == RequestStatus.EVICTED and strict.status == RequestStatus.EVICTED
    assert free in scheduler.running and free.kv_version == 0
    while scheduler.has_work():
        step(scheduler)
    assert all(r.status == RequestStatus.FINISHED for r in (strict, lenient, free))


def test_a_waiting_request_is_untouched() -> None:
    scheduler = scheduler_of()
    waiting = request("w", 1)
    scheduler.add(waiting)
    for mode in ("keep", "recompute", "abort"):
        assert scheduler.weights_changed(check_update_mode(mode)) == []
    assert list(scheduler.waiting) == [waiting] and waiting.status == RequestStatus.PENDING
    assert scheduler.weight_version == 3


def test_without_sharing_versions_still_count() -> None:
    scheduler = scheduler_of(sharing=False)
    a = request("a", 1)
    decoding(scheduler, a)
    scheduler.weights_changed("recompute")
    scheduler.check_integrity()
    while scheduler.has_work():
        step(scheduler)
    assert a.weight_version_runs[-1][1] == 1 and a.kv_version == 1


def test_modes() -> None:
    assert stronger("keep", "abort") == "abort" and stronger("recompute", "keep") == "recompute"
    for bad in ("", "Keep", None, 1):
        with pytest.raises(ValueError, match="'keep', 'recompute', 'abort'"):
            check_update_mode(bad)


# -- the host tier (CPU offload) and forks ----------------------------------------------------------------


def offload_scheduler(host_pages: int = 32) -> Scheduler:
    pools = [PagePool(64)]
    policies = [FullAttentionPolicy(pools[0], PS)]
    return Scheduler(
        PageManager(policies, [KVGroupSpec(FULL_ATTENTION, (0,))], sharing=True),
        scheduler_settings(),
        256,
        64,
        CpuOffload(policies, host_pages),
    )


def swapped_out(mode: str, max_staleness: int | None = None) -> tuple[Scheduler, Request]:
    scheduler = offload_scheduler()
    offload = scheduler.offload
    assert offload is not None
    a, b = request("a", 1, 12, max_staleness), request("b", 2, 12)
    decoding(scheduler, a, b)
    scheduler.preempt(b, StepPlan(entries=[]))
    assert offload.is_swapped(b) and b.num_computed_tokens > 0
    scheduler.check_integrity()
    scheduler.preempt(a, StepPlan(entries=[]))  # both swapped out, at the head of the queue
    assert offload.is_swapped(a)
    scheduler.weights_changed(check_update_mode(mode))
    scheduler.check_integrity()
    return scheduler, a


@pytest.mark.parametrize(
    ("mode", "max_staleness", "kept"),
    [("keep", None, True), ("keep", 0, False), ("recompute", None, False), ("abort", None, False)],
)
def test_a_request_swapped_out_to_the_host_tier(mode: str, max_staleness: int | None, kept: bool) -> None:
    """Its KV in the host tier is in flight too: kept (swapped back in, never keyed), dropped (it recomputes
    from its prompt and tokens) or aborted, by the mode."""
    scheduler, a = swapped_out(mode, max_staleness)
    offload = scheduler.offload
    assert offload is not None
    if mode == "abort":
        assert a.status == RequestStatus.ABORTED and not offload.is_swapped(a)
        assert offload.host.num_used_pages == 0
        return
    assert offload.is_swapped(a) == kept and (a.num_computed_tokens > 0) == kept
    tokens = len(a.generated_ids)
    while scheduler.has_work():
        step(scheduler)
    assert a.status == RequestStatus.FINISHED
    assert a.kv_version == (0 if kept else 1)
    assert a.weight_version_runs == [(0, 0), (tokens, 1)]


def test_forked_siblings_inherit_their_parents_kv_version() -> None:
    """Siblings forked after a `keep` update share pages the parent computed before it: stale, so they key
    nothing either."""
    scheduler = scheduler_of(max_batch_tokens=8)  # the parent's prompt takes 3 chunks
    parent = request("p", 1, 3)
    parent.siblings = [request(f"p__child#{i}", 1, 3) for i in range(2)]
    for child in parent.siblings:
        child.fork_parent = parent
    parent.fork_children = list(parent.siblings)
    scheduler.add(parent)
    step(scheduler)
    scheduler.weights_changed("keep")
    while scheduler.has_work():
        step(scheduler)
    assert all(r.status == RequestStatus.FINISHED for r in parent.family)
    assert [r.kv_version for r in parent.family] == [0, 0, 0]
    assert pool(scheduler).num_keyed_pages == 0
