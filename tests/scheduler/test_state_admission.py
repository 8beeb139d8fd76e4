"""The scheduler with per-request state slots (a model with state layers): a running request holds one
slot, admission waits for a free one, preemption and finishing release it, the integrity check sees them;
with no KV group at all (a pure state-space model) requests hold no pages."""

from __future__ import annotations

import pytest

from tests.scheduler.test_scheduler import make_scheduler, run_to_completion
from tests.support.fakes import FakeModel
from tests.support.requests import make_request
from tests.support.scheduling import scheduler_settings
from transformers_cb.invariants import InvariantError
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.state_slots import StateSlotPolicy
from transformers_cb.requests import Request
from transformers_cb.scheduler.scheduler import Scheduler


def with_slots(scheduler: Scheduler, num_slots: int) -> Scheduler:
    """The scheduler's page manager with a slot group of `num_slots` state slots."""
    scheduler.pages.slots = StateSlotPolicy(num_slots)
    return scheduler


def slots_of(scheduler: Scheduler) -> StateSlotPolicy:
    slots = scheduler.pages.slots
    assert slots is not None
    return slots


def pure_state_scheduler(num_slots: int, max_batch_tokens: int = 16) -> Scheduler:
    """No KV group: a Mamba-style model whose requests hold a state slot and no page."""
    pages = PageManager([], [], page_size=4, slots=StateSlotPolicy(num_slots))
    return Scheduler(pages, scheduler_settings(), max_batch_tokens, 64)


def test_admission_waits_for_a_free_slot() -> None:
    """Pages for everyone, two slots: the third request starts only when one of the first two finishes,
    in the step after, with the freed slot."""
    scheduler = with_slots(make_scheduler(num_pages=256, max_batch_tokens=64), 2)
    requests = [make_request("a", 4, 2), make_request("b", 4, 5), make_request("c", 4, 2)]
    run = run_to_completion(scheduler, requests)
    for step in run.steps:
        assert len(step) <= 2, step
    first_c = next(i for i, step in enumerate(run.steps) if any(rid == "c" for rid, _, _ in step))
    last_a = max(i for i, step in enumerate(run.steps) if any(rid == "a" for rid, _, _ in step))
    assert first_c == last_a + 1
    assert slots_of(scheduler).num_free == 2


def test_entries_carry_their_requests_slots() -> None:
    scheduler = with_slots(make_scheduler(num_pages=256), 3)
    for name in ("a", "b"):
        scheduler.add(make_request(name, 4, 3))
    plan = scheduler.schedule()
    assert [(e.request.request_id, e.state_slot) for e in plan.entries] == [("a", 0), ("b", 1)]
    scheduler.check_integrity()


def test_preemption_releases_the_slot_and_recompute_takes_one_again() -> None:
    """A cache too small for both: the newer request is preempted (its slot freed with its pages), then
    readmitted with a slot; the integrity check after every step holds slots to the running requests."""
    scheduler = with_slots(make_scheduler(num_pages=6, page_size=4, max_batch_tokens=64), 2)
    requests = [make_request("a", 8, 10), make_request("b", 8, 10)]
    model = FakeModel()
    for request in requests:
        scheduler.add(request)
    saw_preemption = False
    while scheduler.has_work():
        plan = scheduler.schedule()
        for victim in plan.preempted:
            saw_preemption = True
            assert not slots_of(scheduler).holds(victim.request_id)
        for entry in plan.entries:
            assert slots_of(scheduler).slot_of(entry.request.request_id) == entry.state_slot
        scheduler.check_integrity()
        finished = scheduler.update(plan, model.run(plan))
        scheduler.check_integrity()
        model.forget(finished)
        for request in finished:
            assert not slots_of(scheduler).holds(request.request_id)
    assert saw_preemption, "the cache never forced a preemption"
    assert slots_of(scheduler).num_free == 2


def test_integrity_catches_a_slot_held_by_a_waiting_request() -> None:
    scheduler = with_slots(make_scheduler(num_pages=256), 3)
    scheduler.add(make_request("a", 4, 3))
    scheduler.add(make_request("b", 4, 3))
    scheduler.schedule()
    scheduler.check_integrity()
    slots_of(scheduler).acquire("ghost")  # a slot nobody running owns
    with pytest.raises(InvariantError, match="state slots held by"):
        scheduler.check_integrity()


def test_pure_state_model_holds_no_pages_and_is_bounded_by_budget_and_slots() -> None:
    scheduler = pure_state_scheduler(num_slots=2, max_batch_tokens=16)
    requests = [make_request(name, 20, 4) for name in ("a", "b", "c")]
    run = run_to_completion_without_pools(scheduler, requests)
    assert all(sum(n for _, _, n in step) <= 16 for step in run)
    assert all(len(step) <= 2 for step in run)
    assert run[0] == [("a", 0, 16)]  # chunked by the budget alone
    assert all(r.is_finished and len(r.generated_ids) == 4 for r in requests)
    assert scheduler.pages.unfittable_reason(10**9) is None  # no page can be missing
    assert slots_of(scheduler).num_free == 2


def run_to_completion_without_pools(scheduler: Scheduler, requests) -> list[list[tuple[str, int, int]]]:
    model = FakeModel()
    for request in requests:
        scheduler.add(request)
    steps = []
    for _ in range(500):
        if not scheduler.has_work():
            break
        plan = scheduler.schedule()
        scheduler.check_integrity()
        assert not plan.preempted and not plan.failed
        finished = scheduler.update(plan, model.run(plan))
        scheduler.check_integrity()
        model.forget(finished)
        steps.append([(e.request.request_id, e.start, e.num_tokens) for e in plan.entries])
    assert not scheduler.has_work()
    return steps


def _with_sibling(parent: Request) -> Request:
    child = Request(
        request_id=f"{parent.request_id}__child#0",
        prompt_ids=list(parent.prompt_ids),
        max_new_tokens=parent.max_new_tokens,
        fork_parent=parent,
    )
    parent.fork_children = [child]
    return child


def test_a_state_fork_copies_pages_and_slot_before_the_last_prompt_token() -> None:
    """The parent's prefill stops before its last prompt token; then its sibling gets copies of its pages
    (its own, no sharing) and a slot planned as a copy of the parent's, and both run that token next."""
    scheduler = with_slots(make_scheduler(num_pages=64, page_size=4, max_batch_tokens=64), 4)
    parent = make_request("p", 10, 3)
    child = _with_sibling(parent)
    scheduler.add(parent)
    assert child not in scheduler.waiting
    plan = scheduler.schedule()
    assert [(e.request.request_id, e.start, e.num_tokens) for e in plan.entries] == [("p", 0, 9)]
    scheduler.update(plan, [])
    assert child in scheduler.running and child.num_computed_tokens == 9
    plan = scheduler.schedule()
    slots = slots_of(scheduler)
    parent_pages, child_pages = parent.group_pages(0).page_ids, child.group_pages(0).page_ids
    # The pages' copies in KV group 0, then the slot's in the slot group (after the KV groups).
    assert scheduler.pages.slot_group == 1
    assert [(g, src, dst) for g, src, dst in plan.copies] == [
        *((0, s, d) for s, d in zip(parent_pages, child_pages, strict=True)),
        (1, slots.slot_of("p"), slots.slot_of(child.request_id)),
    ]
    assert not set(parent_pages) & set(child_pages)
    assert [(e.request.request_id, e.start, e.num_tokens) for e in plan.entries] == [
        ("p", 9, 1),
        (child.request_id, 9, 1),
    ]
    scheduler.check_integrity()


def test_a_state_fork_without_a_free_slot_queues_the_sibling_on_its_own() -> None:
    scheduler = with_slots(make_scheduler(num_pages=64, page_size=4, max_batch_tokens=64), 1)
    parent = make_request("p", 6, 3)
    child = _with_sibling(parent)
    scheduler.add(parent)
    plan = scheduler.schedule()
    scheduler.update(plan, [])
    assert child in scheduler.waiting and child.num_computed_tokens == 0 and not child.holds_pages
    assert scheduler.schedule().copies == []
    scheduler.check_integrity()


def test_a_one_token_prompt_does_not_fork_its_state() -> None:
    scheduler = with_slots(make_scheduler(num_pages=64), 4)
    parent = make_request("p", 1, 3)
    child = _with_sibling(parent)
    scheduler.add(parent)
    assert child in scheduler.waiting and parent.fork_children == []
