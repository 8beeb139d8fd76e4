"""`StateSlots`: one slot per running request of a model with state layers; acquire, release, integrity."""

from __future__ import annotations

import pytest

from transformers_cb.invariants import InvariantError
from transformers_cb.kv.state_slots import StateSlots


def test_slots_are_handed_out_lowest_first_and_come_back() -> None:
    slots = StateSlots(3)
    assert [slots.acquire(r) for r in ("a", "b", "c")] == [0, 1, 2]
    assert not slots.has_free() and slots.num_free == 0 and slots.num_in_use == 3
    slots.release("b")
    assert slots.num_free == 1 and not slots.holds("b")
    assert slots.acquire("d") == 1  # the freed slot, not a new one
    assert slots.slot_of("d") == 1 and slots.slot_of("a") == 0
    slots.check_integrity({"a", "c", "d"})


def test_release_of_a_request_without_a_slot_changes_nothing() -> None:
    slots = StateSlots(2)
    slots.acquire("a")
    slots.release("never")
    slots.release("a")
    slots.release("a")  # twice: still one slot back, not two
    assert slots.num_free == 2
    slots.check_integrity(set())


def test_no_slot_twice_and_none_beyond_the_pool() -> None:
    slots = StateSlots(1)
    slots.acquire("a")
    with pytest.raises(InvariantError, match="already holds"):
        slots.acquire("a")
    with pytest.raises(InvariantError, match="no free state slot"):
        slots.acquire("b")
    with pytest.raises(InvariantError, match="holds no state slot"):
        slots.slot_of("b")
    with pytest.raises(InvariantError):
        StateSlots(0)


def test_integrity_names_wrong_holders_and_lost_slots() -> None:
    slots = StateSlots(3)
    slots.acquire("a")
    slots.acquire("b")
    with pytest.raises(InvariantError, match="expected"):
        slots.check_integrity({"a"})  # b holds a slot although it is not running
    with pytest.raises(InvariantError, match="expected"):
        slots.check_integrity({"a", "b", "c"})  # c runs without a slot
    slots._free.append(0)  # a slot both free and held (a corrupted pool)
    with pytest.raises(InvariantError, match="lost or duplicated"):
        slots.check_integrity({"a", "b"})
