"""`StateSlotPolicy`: one slot per running request of a model with state layers; acquire, release, integrity;
the slot group behind `PageManager` (fit, allocate, free, fork, integrity) and the host tier (`CpuOffload`)."""

from __future__ import annotations

import pytest

from tests.support.requests import make_request
from transformers_cb.invariants import InvariantError, present
from transformers_cb.kv.layer_groups import KVGroupSpec
from transformers_cb.kv.offload import CpuOffload
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.kv.state_slots import StateSlotPolicy


def test_slots_are_handed_out_lowest_first_and_come_back() -> None:
    slots = StateSlotPolicy(3)
    assert [slots.acquire(r) for r in ("a", "b", "c")] == [0, 1, 2]
    assert not slots.has_free() and slots.num_free == 0 and slots.num_in_use == 3
    slots.release("b")
    assert slots.num_free == 1 and not slots.holds("b")
    assert slots.acquire("d") == 1  # the freed slot, not a new one
    assert slots.slot_of("d") == 1 and slots.slot_of("a") == 0
    slots.check_integrity({"a", "c", "d"})


def test_release_of_a_request_without_a_slot_changes_nothing() -> None:
    slots = StateSlotPolicy(2)
    slots.acquire("a")
    slots.release("never")
    slots.release("a")
    slots.release("a")  # twice: still one slot back, not two
    assert slots.num_free == 2
    slots.check_integrity(set())


def test_no_slot_twice_and_none_beyond_the_pool() -> None:
    slots = StateSlotPolicy(1)
    slots.acquire("a")
    with pytest.raises(InvariantError, match="already holds"):
        slots.acquire("a")
    with pytest.raises(InvariantError, match="no free state slot"):
        slots.acquire("b")
    with pytest.raises(InvariantError, match="holds no state slot"):
        slots.slot_of("b")
    with pytest.raises(InvariantError):
        StateSlotPolicy(0)


def test_integrity_names_wrong_holders_and_lost_slots() -> None:
    slots = StateSlotPolicy(3)
    slots.acquire("a")
    slots.acquire("b")
    with pytest.raises(InvariantError, match="expected"):
        slots.check_integrity({"a"})  # b holds a slot although it is not running
    with pytest.raises(InvariantError, match="expected"):
        slots.check_integrity({"a", "b", "c"})  # c runs without a slot
    slots.pool._free.append(0)  # a slot both free and held (a corrupted pool)
    with pytest.raises(InvariantError, match="lost or duplicated"):
        slots.check_integrity({"a", "b"})


# -- the slot group behind the page manager ----------------------------------------------------------


def manager(num_pages: int, num_slots: int, page_size: int = 4) -> PageManager:
    """One full-attention KV group of `num_pages` pages and a slot group of `num_slots` slots."""
    spec = KVGroupSpec("full_attention", (0,))
    policy = FullAttentionPolicy(PagePool(num_pages), page_size, 0)
    return PageManager([policy], [spec], page_size=page_size, slots=StateSlotPolicy(num_slots))


def test_a_request_without_a_slot_fits_nothing_until_one_is_free() -> None:
    pages = manager(num_pages=16, num_slots=1)
    a, b = make_request("a", 8), make_request("b", 8)
    assert pages.num_fitting_tokens(a, 8) == 8
    assert pages.allocate(a, 8) and present(pages.slots).slot_of(a) == 0 and pages.state_slot(a) == 0
    assert pages.num_fitting_tokens(a, 4) == 4  # it holds its slot: only its pages count
    assert pages.num_fitting_tokens(b, 8) == 0 and not pages.allocate(b, 8)
    assert not b.holds_pages  # check-then-commit: the refused allocation took no page
    pages.check_integrity([a, b], [a])
    pages.free(a)
    assert not present(pages.slots).holds(a) and pages.num_fitting_tokens(b, 8) == 8
    pages.check_integrity([a, b], [])


def test_a_pure_state_manager_has_only_the_slot_group() -> None:
    pages = PageManager([], [], page_size=4, slots=StateSlotPolicy(2))
    assert pages.slot_group == 0 and pages.num_fitting_tokens(make_request("a"), 10**6) == 10**6
    requests = [make_request(name) for name in "abc"]
    assert [pages.allocate(r, 100) for r in requests] == [True, True, False]
    with pytest.raises(InvariantError, match="state slots held by"):
        pages.check_integrity(requests, requests[:1])  # b holds a slot but is not running


def test_a_state_fork_copies_the_pages_then_the_slot_in_the_slot_group() -> None:
    pages = manager(num_pages=16, num_slots=2)
    parent, child, other = make_request("p", 9), make_request("c", 9), make_request("o", 9)
    assert pages.allocate(parent, 9)
    parent.num_computed_tokens = 8
    copies = present(pages.copy_for_fork(parent, child))
    slots = present(pages.slots)
    assert copies[-1] == (pages.slot_group, slots.slot_of(parent), slots.slot_of(child)) == (1, 0, 1)
    assert [g for g, _, _ in copies[:-1]] == [0, 0, 0] and child.num_computed_tokens == 8
    used = pages.policies[0].pool.num_used_pages
    assert pages.copy_for_fork(parent, other) is None  # no free slot: nothing changes
    assert pages.policies[0].pool.num_used_pages == used and not other.holds_pages
    pages.check_integrity([parent, child, other], [parent, child])


# -- the slot group of the host tier -------------------------------------------------------------------


def test_a_state_swaps_out_and_back_with_its_pages_as_one_more_group() -> None:
    pages = manager(num_pages=16, num_slots=2)
    offload = CpuOffload(pages.policies, 8, pages.slots)
    a, b = make_request("a", 8), make_request("b", 8)
    assert pages.allocate(a, 8) and pages.allocate(b, 8)
    a.num_computed_tokens = b.num_computed_tokens = 8
    assert offload.try_swap_out(b)
    pages.free(b)
    plan = offload.take_plan()
    assert plan.num_groups == 2 and plan.pairs(1) == ([(1, 0)], []) and len(plan.out_src[0]) == 2
    assert offload.swap_out_pages == 2  # pages only: a slot is not a KV page
    host_slots = present(offload.host.slots)
    assert host_slots.slot_of(b) == 0 and offload.host.num_used_pages == 2
    offload.check_integrity({"b"})
    assert pages.allocate(make_request("c", 4), 4)  # c takes b's device slot: b cannot come back
    assert not offload.can_swap_in(b)


def test_a_state_swap_needs_a_host_slot_and_comes_back_into_a_free_device_slot() -> None:
    pages = manager(num_pages=16, num_slots=1)
    offload = CpuOffload(pages.policies, 8, pages.slots)
    offload.host.slots = StateSlotPolicy(1)
    present(offload.host.slots).acquire("elsewhere")  # the host's only slot is taken
    a = make_request("a", 8)
    assert pages.allocate(a, 8)
    a.num_computed_tokens = 8
    assert not offload.try_swap_out(a) and offload.num_fallbacks == 0  # nothing changed
    assert offload.take_plan().is_empty
    present(offload.host.slots).release("elsewhere")
    assert offload.try_swap_out(a)
    pages.free(a)
    offload.take_plan()
    assert offload.can_swap_in(a)
    offload.swap_in(a)
    plan = offload.take_plan()
    assert plan.pairs(1) == ([], [(0, present(pages.slots).slot_of(a))])
    assert not present(offload.host.slots).holds(a)
    assert plan.head(1).num_groups == 1 and plan.head(1).in_src == [plan.in_src[0]]
    offload.check_integrity(set())


def test_discarding_a_swapped_state_frees_its_host_slot_and_its_unrun_copy() -> None:
    pages = manager(num_pages=16, num_slots=1)
    offload = CpuOffload(pages.policies, 8, pages.slots)
    a = make_request("a", 8)
    assert pages.allocate(a, 8)
    a.num_computed_tokens = 8
    assert offload.try_swap_out(a)
    pages.free(a)
    offload.discard(a)
    assert offload.take_plan().is_empty and present(offload.host.slots).num_in_use == 0
    offload.check_integrity(set())
