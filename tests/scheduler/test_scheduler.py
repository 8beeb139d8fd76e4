"""The scheduler driven by a fake model (no tensors): chunking, budgets, preemption, admission, stops."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fakes import EOS, FakeModel
from tests.support.requests import make_request, page_ids, sampling_entries
from tests.support.scheduling import scheduler_settings
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.requests import Request, RequestStatus
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.policies import DecodeFirstPolicy, PrefillLimits, SchedulingPolicy, make_policy
from transformers_cb.scheduler.scheduler import Scheduler


def make_scheduler(
    num_pages: int,
    page_size: int = 4,
    max_batch_tokens: int = 64,
    max_requests_per_batch: int = 64,
    safety_margin: float = 0.0,
    policy: str | SchedulingPolicy = "fifo",
) -> Scheduler:
    page_manager = PageManager(
        [FullAttentionPolicy(PagePool(num_pages), page_size)], [KVGroupSpec(FULL_ATTENTION, (0,))]
    )
    settings = scheduler_settings(policy if isinstance(policy, str) else "fifo", safety_margin)
    scheduler = Scheduler(page_manager, settings, max_batch_tokens, max_requests_per_batch)
    if not isinstance(policy, str):
        scheduler.policy = policy  # one at these tests' scale (`SmallDecodeFirst`)
    return scheduler


class SmallDecodeFirst(DecodeFirstPolicy):
    """`decode_first` at the scale of these tests (its real minimum budget, 256, exceeds their prompts)."""

    SPLIT = 2
    MIN_PREFILL_BUDGET = 4


@dataclass
class Run:
    # (request_id, start, num_tokens) of each entry, per step.
    steps: list[list[tuple[str, int, int]]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # ids of the requests that sampled a token, per step (`sampling_entries` is only valid before update).
    sampled: list[list[str]] = field(default_factory=list)


def run_to_completion(
    scheduler: Scheduler,
    requests: list[Request],
    model: FakeModel | None = None,
    max_steps: int = 5000,
    arrivals: dict[int, list[Request]] | None = None,
) -> Run:
    """Drive `scheduler` until no work is left, checking budgets and integrity after every step.

    `arrivals` adds requests before the given step index.
    """
    model = model or FakeModel()
    arrivals = arrivals or {}
    for request in requests:
        scheduler.add(request)
    scheduler.check_integrity()
    run = Run()
    step = 0
    while scheduler.has_work() or any(i >= step for i in arrivals):
        assert step < max_steps, f"no termination after {max_steps} steps"
        for request in arrivals.get(step, []):
            scheduler.add(request)
        batch = scheduler.schedule()
        scheduler.check_integrity()
        assert batch.num_tokens <= scheduler.max_batch_tokens
        assert len(batch.entries) <= scheduler.max_requests_per_batch
        assert len({id(e.request) for e in batch.entries}) == len(batch.entries), "request twice in a step"
        for request in batch.failed:
            assert request.status == RequestStatus.FAILED
            assert not page_ids(request)
        run.sampled.append([e.request.request_id for e in sampling_entries(batch)])
        finished = scheduler.update(batch, model.run(batch))
        scheduler.check_integrity()
        model.forget(finished + batch.failed)
        run.steps.append([(e.request.request_id, e.start, e.num_tokens) for e in batch.entries])
        run.finished.extend(batch.failed + finished)
        run.preempted.extend(r.request_id for r in batch.preempted)
        step += 1
    assert scheduler.pages.pools[0].num_free_pages == scheduler.pages.pools[0].num_pages, "pages leaked"
    assert not scheduler.running and not scheduler.waiting
    return run


def assert_finished_once(run: Run, requests: list[Request]) -> None:
    counts = Counter(r.request_id for r in run.finished)
    assert counts == Counter(r.request_id for r in requests), counts
    for request in requests:
        assert request.is_finished
        assert request.finish_time is not None


def generated(requests: list[Request]) -> dict[str, list[int]]:
    return {r.request_id: list(r.generated_ids) for r in requests}


def huge_cache_reference(specs: list[tuple[str, int, int]]) -> dict[str, list[int]]:
    requests = [make_request(*spec) for spec in specs]
    run_to_completion(make_scheduler(num_pages=10_000, max_batch_tokens=100_000), requests)
    return generated(requests)


# -- chunked prefill, mixing, caps ---------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler = make_scheduler(num_pages=64, page_size=4, max_batch_tokens=16)
    request = make_request("long", 50, 3)
    run = run_to_completion(scheduler, [request])
    assert run.steps == [
        [("long", 0, 16)],
        [("long", 16, 16)],
        [("long", 32, 16)],
        [("long", 48, 2)],  # last prompt chunk: samples the first token
        [("long", 50, 1)],
        [("long", 51, 1)],
    ]
    assert run.sampled == [[], [], [], ["long"], ["long"], ["long"]]
    assert len(request.generated_ids) == 3
    assert request.status == RequestStatus.FINISHED
    assert request.finish_reason == "length"


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    scheduler = make_scheduler(num_pages=64, page_size=4, max_batch_tokens=16)
    short, long = make_request("short", 4, 10), make_request("long", 40, 2)
    run = run_to_completion(scheduler, [short, long])
    assert run.steps[0] == [("short", 0, 4), ("long", 0, 12)]
    assert run.steps[1] == [("short", 4, 1), ("long", 12, 15)]
    assert run.steps[2] == [("short", 5, 1), ("long", 27, 13)]  # long samples its first token here
    assert run.steps[3] == [("short", 6, 1), ("long", 40, 1)]
    assert generated([short, long]) == huge_cache_reference([("short", 4, 10), ("long", 40, 2)])


def test_request_cap_per_step() -> None:
    scheduler = make_scheduler(num_pages=64, max_batch_tokens=1000, max_requests_per_batch=2)
    requests = [make_request(f"r{i}", 3, 2) for i in range(5)]
    run = run_to_completion(scheduler, requests)
    assert all(len(step) <= 2 for step in run.steps)
    assert [rid for rid, _, _ in run.steps[0]] == ["r0", "r1"]
    assert [rid for rid, _, _ in run.steps[1]] == ["r0", "r1"]
    assert [rid for rid, _, _ in run.steps[2]] == ["r2", "r3"]
    assert_finished_once(run, requests)


def test_token_budget_is_never_exceeded() -> None:
    scheduler = make_scheduler(num_pages=200, page_size=4, max_batch_tokens=7, max_requests_per_batch=100)
    specs = [(f"r{i}", 3 + 5 * i, 4) for i in range(8)]
    requests = [make_request(*spec) for spec in specs]
    run = run_to_completion(scheduler, requests)
    sizes = [sum(n for _, _, n in step) for step in run.steps]
    assert max(sizes) == 7
    assert all(size <= 7 for size in sizes)
    assert sum(sizes) == sum(3 + 5 * i for i in range(8)) + 8 * 3  # prompts + (max_new - 1) decodes
    assert_finished_once(run, requests)
    assert generated(requests) == huge_cache_reference(specs)


# -- preemption ----------------------------------------------------------------------------------


def test_preemption_evicts_newest_and_recomputes() -> None:
    specs = [("old", 4, 12), ("new", 4, 12)]
    reference = huge_cache_reference(specs)
    scheduler = make_scheduler(num_pages=6, page_size=4, max_batch_tokens=64)
    old, new = (make_request(*spec) for spec in specs)
    scheduler.add(old)
    scheduler.add(new)
    model = FakeModel()
    preempted_at, recomputed = None, False
    for step in range(200):
        if not scheduler.has_work():
            break
        batch = scheduler.schedule()
        scheduler.check_integrity()
        if batch.preempted and preempted_at is None:
            preempted_at = step
            assert batch.preempted == [new], "the newest running request is evicted"
            assert new.num_computed_tokens == 0
            assert page_ids(new) == []
            assert new.status == RequestStatus.EVICTED
            assert new.num_preemptions == 1
            assert scheduler.num_preemptions == 1
            assert new not in [e.request for e in batch.entries]
            tokens_at_eviction = list(new.all_token_ids)
            assert len(tokens_at_eviction) > len(new.prompt_ids)
        elif preempted_at is not None and any(e.request is new for e in batch.entries):
            entry = next(e for e in batch.entries if e.request is new)
            if entry.start == 0:
                # The recompute runs prompt + every token generated before the eviction.
                recomputed = True
                assert new.all_token_ids == tokens_at_eviction
                assert new.num_remaining_tokens == len(tokens_at_eviction)
                assert new.status == RequestStatus.PREFILLING
        finished = scheduler.update(batch, model.run(batch))
        scheduler.check_integrity()
        model.forget(finished)
    assert preempted_at is not None, "the cache was expected to run out"
    assert recomputed
    assert not scheduler.has_work()
    assert old.num_preemptions == 0
    assert old.status == new.status == RequestStatus.FINISHED
    assert generated([old, new]) == reference
    assert scheduler.pages.pools[0].num_free_pages == 6


def test_preemption_under_pressure_keeps_outputs() -> None:
    specs = [(f"r{i}", 3 + 4 * i, 10) for i in range(6)]
    reference = huge_cache_reference(specs)
    requests = [make_request(*spec) for spec in specs]
    # The largest request needs ceil((23 + 9) / 4) = 8 pages; the pool holds a little more.
    run = run_to_completion(make_scheduler(num_pages=10, page_size=4, max_batch_tokens=16), requests)
    assert run.preempted, "expected preemptions with this little cache"
    assert sum(r.num_preemptions for r in requests) == len(run.preempted)
    assert generated(requests) == reference
    assert_finished_once(run, requests)
    assert all(r.status == RequestStatus.FINISHED for r in requests)


def test_request_that_can_never_fit_fails_clearly() -> None:
    scheduler = make_scheduler(num_pages=2, page_size=4, max_batch_tokens=64)
    huge = make_request("huge", 20, 4)  # 23 tokens of KV need 6 pages
    run = run_to_completion(scheduler, [huge], max_steps=10)
    assert huge.status == RequestStatus.FAILED
    assert "needs more KV pages than the cache has" in huge.error
    assert "'huge'" in huge.error
    assert huge.finish_reason == "error"
    assert len(run.steps) <= 3
    assert_finished_once(run, [huge])


def test_growth_beyond_the_cache_fails_only_that_request() -> None:
    specs = [("grows", 4, 30), ("small", 3, 3)]
    reference = huge_cache_reference(specs)
    scheduler = make_scheduler(num_pages=4, page_size=4, max_batch_tokens=64)
    grows, small = (make_request(*spec) for spec in specs)  # grows needs 9 pages, small needs 2
    run = run_to_completion(scheduler, [grows, small], max_steps=100)
    assert grows.status == RequestStatus.FAILED
    assert "needs more KV pages" in grows.error
    assert len(grows.generated_ids) < 30
    assert small.status == RequestStatus.FINISHED
    assert small.generated_ids == reference["small"]
    assert grows.generated_ids == reference["grows"][: len(grows.generated_ids)]
    assert_finished_once(run, [grows, small])


# -- admission -----------------------------------------------------------------------------------


def test_safety_margin_blocks_admission_not_decodes() -> None:
    scheduler = make_scheduler(num_pages=10, page_size=4, max_batch_tokens=64, safety_margin=0.5)
    big, waiter = make_request("big", 24, 6), make_request("waiter", 4, 2)  # big takes 6-7 of 10 pages
    run = run_to_completion(scheduler, [big, waiter])
    big_steps = [i for i, step in enumerate(run.steps) if any(rid == "big" for rid, _, _ in step)]
    waiter_steps = [i for i, step in enumerate(run.steps) if any(rid == "waiter" for rid, _, _ in step)]
    assert big_steps == list(range(6)), "big decodes every step"
    assert waiter_steps[0] == 6, "the waiter is admitted only once big has finished"
    assert generated([big, waiter]) == huge_cache_reference([("big", 24, 6), ("waiter", 4, 2)])


def test_without_safety_margin_both_start_together() -> None:
    scheduler = make_scheduler(num_pages=10, page_size=4, max_batch_tokens=64, safety_margin=0.0)
    big, waiter = make_request("big", 24, 6), make_request("waiter", 4, 2)
    run = run_to_completion(scheduler, [big, waiter])
    assert run.steps[0] == [("big", 0, 24), ("waiter", 0, 4)]


def test_safety_margin_does_not_block_the_first_request() -> None:
    scheduler = make_scheduler(num_pages=4, page_size=4, max_batch_tokens=64, safety_margin=1.0)
    requests = [make_request("a", 4, 3), make_request("b", 4, 3)]
    run = run_to_completion(scheduler, requests)
    assert run.steps[0] == [("a", 0, 4)]
    assert all(r.status == RequestStatus.FINISHED for r in requests)


def test_partial_admission_with_the_last_free_page() -> None:
    """A waiting request may start with the pages left (a shorter chunk); later ones wait."""
    scheduler = make_scheduler(num_pages=6, page_size=4, max_batch_tokens=64)
    first, second, third = (
        make_request("first", 16, 2),
        make_request("second", 12, 2),
        make_request("third", 2, 2),
    )
    model = FakeModel()
    scheduler.add(first)
    batch = scheduler.schedule()
    scheduler.update(batch, model.run(batch))
    assert page_ids(first) == [0, 1, 2, 3]
    scheduler.add(second)
    scheduler.add(third)
    batch = scheduler.schedule()
    scheduler.check_integrity()
    # first's decode opens page 4; second starts with the last page (4 of its 12 tokens); third waits.
    assert [(e.request.request_id, e.start, e.num_tokens) for e in batch.entries] == [
        ("first", 16, 1),
        ("second", 0, 4),
    ]
    assert page_ids(first) == [0, 1, 2, 3, 4]
    assert page_ids(second) == [5]
    assert second.status == RequestStatus.PREFILLING
    assert third.status == RequestStatus.PENDING
    assert list(scheduler.waiting) == [third]
    assert sampling_entries(batch) == [batch.entries[0]]


def test_prefill_first_policy_orders_candidates() -> None:
    policy = make_policy("prefill_first")
    a, b, c = make_request("a", 2, 2), make_request("b", 2, 2), make_request("c", 2, 2)
    a.status, b.status = RequestStatus.DECODING, RequestStatus.PREFILLING
    assert list(policy.candidates([a, b], [c])) == [b, c, a]
    assert list(make_policy("fifo").candidates([a, b], [c])) == [a, b, c]
    with pytest.raises(ValueError, match="unknown scheduler_type 'lifo'"):
        make_policy("lifo")


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_policy_decides_who_gets_the_budget(policy: str) -> None:
    scheduler = make_scheduler(num_pages=64, page_size=4, max_batch_tokens=8, policy=policy)
    decoder, prefiller = make_request("decoder", 4, 8), make_request("prefiller", 30, 2)
    # The prefiller arrives at step 2, while decoder is decoding.
    run = run_to_completion(scheduler, [decoder], arrivals={2: [prefiller]})
    assert run.steps[:2] == [[("decoder", 0, 4)], [("decoder", 4, 1)]]
    if policy == "fifo":
        assert run.steps[2] == [("decoder", 5, 1), ("prefiller", 0, 7)]
        assert run.steps[3] == [("decoder", 6, 1), ("prefiller", 7, 7)]
    else:
        # Prefill chunks take the whole budget; the decode waits until a chunk leaves room.
        assert run.steps[2] == [("prefiller", 0, 8)]
        assert run.steps[3] == [("prefiller", 8, 8)]
        assert run.steps[4] == [("prefiller", 16, 8)]
        assert run.steps[5] == [("decoder", 5, 1), ("prefiller", 24, 6)]
    assert generated([decoder, prefiller]) == huge_cache_reference([("decoder", 4, 8), ("prefiller", 30, 2)])


# -- stopping ------------------------------------------------------------------------------------


def test_decode_first_orders_decodes_then_started_prompts_then_waiting_ones() -> None:
    policy = make_policy("decode_first")
    tail, decoding = make_request("tail", 2, 2), make_request("decoding", 2, 2)
    tail.status, decoding.status = RequestStatus.PREFILLING, RequestStatus.DECODING
    waiting = make_request("waiting", 2, 2)
    assert list(policy.candidates([tail, decoding], [waiting])) == [decoding, tail, waiting]


def test_decode_first_prefill_budget_grows_with_the_queue() -> None:
    policy = DecodeFirstPolicy()
    lone = [make_request("lone", 5000, 1)]
    assert policy.prefill_limits(8192, [], lone) == PrefillLimits(8192, 8192)  # nothing waits: it runs whole
    few = [make_request(f"f{i}", 40, 1) for i in range(4)]
    assert policy.prefill_limits(8192, [], few) == PrefillLimits(256, 128)  # 160 / 6 < the minimum, 256
    burst = [make_request(f"b{i}", 100, 1) for i in range(200)]
    assert policy.prefill_limits(8192, [], burst) == PrefillLimits(3334, 1667)  # a sixth of 20,000
    assert policy.prefill_limits(8192, [], burst[:100]).budget == 3334  # it keeps its size while it drains
    assert policy.prefill_limits(2048, [], burst).budget == 2048  # never more than the step
    assert (
        policy.prefill_limits(8192, [], []).budget == 8192
    )  # the queue emptied: the next burst starts afresh
    assert policy.prefill_limits(8192, [], few).budget == 256
    decoding = make_request("decoding", 100, 4)
    decoding.status = RequestStatus.DECODING  # a decode is not queued prefill
    assert policy.prefill_limits(8192, [decoding], lone).budget == 8192
    assert make_policy("fifo").prefill_limits(64, [], burst) == PrefillLimits(64, 64)


def test_decode_first_serves_a_burst_in_shares_with_decodes_first() -> None:
    scheduler = make_scheduler(num_pages=64, page_size=4, max_batch_tokens=64, policy=SmallDecodeFirst())
    decoder = make_request("decoder", 4, 6)
    burst = [make_request(f"b{i}", 6, 2) for i in range(6)]
    run = run_to_completion(scheduler, [decoder], arrivals={1: burst})
    assert run.steps[0] == [("decoder", 0, 4)]  # alone: it runs whole
    # 36 prompt tokens queued: a budget of 18 a step, the decode first, whole prompts while they fit.
    assert run.steps[1] == [("decoder", 4, 1), ("b0", 0, 6), ("b1", 0, 6), ("b2", 0, 6)]
    # The budget keeps its size while the burst drains: the rest in one more step, beside the decodes.
    decodes = [("decoder", 5, 1), ("b0", 6, 1), ("b1", 6, 1), ("b2", 6, 1)]
    assert run.steps[2] == [*decodes, ("b3", 0, 6), ("b4", 0, 6), ("b5", 0, 6)]
    assert_finished_once(run, [decoder, *burst])
    specs = [("decoder", 4, 6), *[(f"b{i}", 6, 2) for i in range(6)]]
    assert generated([decoder, *burst]) == huge_cache_reference(specs)


def test_decode_first_leaves_short_prompts_half_of_a_long_ones_step() -> None:
    scheduler = make_scheduler(num_pages=64, page_size=4, max_batch_tokens=64, policy=SmallDecodeFirst())
    long, short = make_request("long", 40, 1), make_request("short", 4, 1)
    run = run_to_completion(scheduler, [long, short])
    # 44 queued tokens: a budget of 22, of which a chunk takes 11 at most: the short prompt runs too.
    assert run.steps[0] == [("long", 0, 11), ("short", 0, 4)]
    # Then the long prompt's tail alone in the queue: the whole step is its own.
    assert run.steps[1] == [("long", 11, 29)]


def test_decode_first_started_prompts_keep_their_pages() -> None:
    """Found by the property test: were waiting prompts admitted before started ones, a new arrival's first
    chunk would take the pages a started long prompt needs, which then preempts itself, step after step."""
    specs = [("r0", 13, 5), ("r1", 40, 1), ("r2", 27, 1), ("r3", 1, 1), ("r4", 1, 1), ("r5", 1, 1)]
    scheduler = make_scheduler(
        num_pages=40,
        page_size=1,
        max_batch_tokens=49,
        max_requests_per_batch=3,
        safety_margin=0.15,
        policy=SmallDecodeFirst(),
    )
    requests = [make_request(*spec) for spec in specs]
    run = run_to_completion(scheduler, requests, max_steps=2000)
    assert_finished_once(run, requests)
    assert generated(requests) == huge_cache_reference(specs)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first", "decode_first"])
@pytest.mark.parametrize("big_arrives", [0, 21])
def test_a_prompt_that_fills_the_cache_is_not_starved_by_a_steady_stream(
    policy: str, big_arrives: int
) -> None:
    """Found by the hour's soak (benchmarks/soak.py): under `decode_first` a prompt whose KV fills the cache
    exactly waited as long as requests kept arriving (300 s timeouts): newer decodes, which run first, took
    its pages and preempted it, and arrivals admitted behind it took the pages freed. Now only newer
    requests are victims, a prompt with nobody newer to preempt waits with its pages, and while the rest of a
    started prompt does not fit, nobody is admitted behind it."""
    chosen: str | SchedulingPolicy = SmallDecodeFirst() if policy == "decode_first" else policy
    scheduler = make_scheduler(num_pages=16, page_size=4, max_batch_tokens=16, policy=chosen)
    big = make_request("big", 16 * 4 - 3, 4)  # prompt + max_new_tokens - 1 = 64 tokens: the whole cache
    stream = {step: [make_request(f"s{step}", 6, 8)] for step in range(0, 400, 2)}
    stream.setdefault(big_arrives, []).insert(0, big)
    run = run_to_completion(scheduler, [], arrivals=stream)
    requests = [r for arriving in stream.values() for r in arriving]
    assert_finished_once(run, requests)
    last_prompt_step = next(
        i
        for i, step in enumerate(run.steps)
        if any(rid == "big" and start + n == 61 for rid, start, n in step)
    )
    # Without the fix it finished only after the stream stopped (step 400 and later).
    assert last_prompt_step < big_arrives + 40, last_prompt_step
    assert big.generated_ids == huge_cache_reference([("big", 61, 4)])["big"]


def test_eos_stop_includes_eos() -> None:
    scheduler = make_scheduler(num_pages=16)
    stops, runs = (
        make_request("stops", 5, 10, eos=frozenset({EOS})),
        make_request("runs", 5, 4, eos=frozenset({EOS})),
    )
    run = run_to_completion(scheduler, [stops, runs], model=FakeModel(eos_at={"stops": 3}))
    assert len(stops.generated_ids) == 3
    assert stops.generated_ids[-1] == EOS
    assert EOS not in stops.generated_ids[:-1]
    assert stops.finish_reason == "stop"
    assert stops.status == RequestStatus.FINISHED
    assert len(runs.generated_ids) == 4
    assert runs.finish_reason == "length"
    assert_finished_once(run, [stops, runs])
    output = stops.to_output()
    assert output.generated_tokens == stops.generated_ids
    assert output.status == RequestStatus.FINISHED


def test_eos_on_first_token() -> None:
    scheduler = make_scheduler(num_pages=16)
    request = make_request("r", 5, 10, eos=frozenset({EOS, 3}))
    run_to_completion(scheduler, [request], model=FakeModel(eos_at={"r": 1}))
    assert request.generated_ids == [EOS]
    assert request.finish_reason == "stop"


def test_max_new_tokens_one() -> None:
    scheduler = make_scheduler(num_pages=16)
    request = make_request("r", 9, 1)
    run = run_to_completion(scheduler, [request])
    assert len(run.steps) == 1
    assert len(request.generated_ids) == 1
    assert request.finish_reason == "length"


def test_every_request_finishes_exactly_once_with_staggered_arrivals() -> None:
    scheduler = make_scheduler(num_pages=12, page_size=4, max_batch_tokens=10, max_requests_per_batch=3)
    specs = [(f"r{i}", 2 + (7 * i) % 13, 1 + i % 5) for i in range(12)]
    requests = [make_request(*spec) for spec in specs]
    arrivals = {i: [requests[i]] for i in range(12)}
    run = run_to_completion(scheduler, [], arrivals=arrivals)
    assert_finished_once(run, requests)
    assert generated(requests) == huge_cache_reference(specs)
    for request, (_, _, max_new) in zip(requests, specs, strict=True):
        assert len(request.generated_ids) == max_new


# -- property test -------------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    page_size = draw(st.integers(1, 8))
    specs = [
        (f"r{i}", draw(st.integers(1, 40)), draw(st.integers(1, 10))) for i in range(draw(st.integers(1, 8)))
    ]
    largest = max(-(-(n + m - 1) // page_size) for _, n, m in specs)
    return {
        "specs": specs,
        "page_size": page_size,
        "num_pages": draw(st.integers(largest, largest + 12)),
        "max_batch_tokens": draw(st.integers(1, 64)),
        "max_requests_per_batch": draw(st.integers(1, 8)),
        "safety_margin": draw(st.sampled_from([0.0, 0.15, 0.5])),
        "policy": draw(
            st.one_of(st.sampled_from(["fifo", "prefill_first", "decode_first"]), st.builds(SmallDecodeFirst))
        ),
    }


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_properties(workload: dict) -> None:
    workload = dict(workload)
    specs = workload.pop("specs")
    scheduler = make_scheduler(**workload)
    requests = [make_request(*spec) for spec in specs]
    run = run_to_completion(scheduler, requests, max_steps=20_000)
    assert_finished_once(run, requests)
    for request, (_, _, max_new) in zip(requests, specs, strict=True):
        assert request.status == RequestStatus.FINISHED, (request.request_id, request.error)
        assert len(request.generated_ids) == max_new
        assert page_ids(request) == []
    assert generated(requests) == huge_cache_reference(specs)


def test_every_request_that_stops_running_is_released_by_the_next_plan_once() -> None:
    """One list of ended requests (issue 38): finished in `update`, cancelled through `finish`, preempted or
    failed in `schedule`: each is in the next plan's `released` (rows, shadows) exactly once."""
    scheduler = make_scheduler(num_pages=4, page_size=4)
    done, cancelled, kept = (make_request(i, num_prompt_tokens=4, max_new_tokens=1) for i in ("d", "c", "k"))
    for request in (done, cancelled, kept):
        scheduler.add(request)
    first = scheduler.schedule()
    assert first.released == [] and len(first.entries) == 3
    finished = scheduler.update(first, [[SampledToken(7)], [SampledToken(7)], [SampledToken(7)]])
    assert finished == [done, cancelled, kept]
    scheduler.add(late := make_request("late", num_prompt_tokens=4))
    scheduler.finish(late, RequestStatus.CANCELLED)  # ended before it ever ran: released all the same
    second = scheduler.schedule()
    assert second.released == [done, cancelled, kept, late]
    assert scheduler.schedule().released == []  # once
    huge = make_request("huge", num_prompt_tokens=40)
    scheduler.add(huge)  # runs chunks until no page is left: failed in a schedule, released by that plan
    for _ in range(10):
        plan = scheduler.schedule()
        if plan.failed:
            break
        scheduler.update(plan, [])  # prefill chunks sample nothing
    assert plan.failed == [huge] and plan.released == [huge]
