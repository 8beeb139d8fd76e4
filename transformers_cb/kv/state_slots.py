"""Per-request state slots: who owns which slot of the state layers' tensors (no tensors here).

A model with state layers (linear attention, Mamba, short convolutions: memory/state_cache.py) keeps,
per request, a fixed-size state instead of a growing KV. Each running request holds exactly one slot
from admission until it finishes or is preempted (a preempted request recomputes its state from its
tokens); a waiting request holds none. Admission needs a free slot as well as its pages.
"""

from __future__ import annotations

from ..invariants import check


class StateSlots:
    """`num_slots` slot ids, handed to requests by id."""

    def __init__(self, num_slots: int) -> None:
        check(num_slots > 0, f"a state-slot pool needs slots, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._owner)

    def has_free(self) -> bool:
        return bool(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self._owner

    def acquire(self, request_id: str) -> int:
        """A free slot for `request_id` (it must hold none and one must be free)."""
        check(
            request_id not in self._owner,
            f"{request_id} already holds state slot {self._owner.get(request_id)}",
        )
        check(bool(self._free), f"no free state slot for {request_id}")
        slot = self._free.pop()
        self._owner[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        """Give back the slot of `request_id`, if it holds one."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot_of(self, request_id: str) -> int:
        slot = self._owner.get(request_id)
        check(slot is not None, f"{request_id} holds no state slot")
        return slot  # type: ignore[return-value]

    def check_integrity(self, holders: set[str]) -> None:
        """Raise `InvariantError` unless exactly `holders` hold slots, each its own."""
        check(
            set(self._owner) == holders,
            f"state slots held by {sorted(self._owner)}, expected {sorted(holders)}",
        )
        used = list(self._owner.values())
        check(len(set(used)) == len(used), f"a state slot is held twice: {self._owner}")
        check(
            sorted(used + self._free) == list(range(self.num_slots)),
            f"state slots lost or duplicated: held {sorted(used)}, free {sorted(self._free)}",
        )
