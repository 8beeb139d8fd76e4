"""`StateSlotPolicy`: the per-request state slots of a model with state layers, as one more page group.

A model with state layers (linear attention, Mamba, short convolutions: memory/state_cache.py) keeps,
per request, a fixed-size state instead of a growing KV. Seen from the page manager, that is a group
whose request holds exactly one "page" (its slot) from admission until it stops running: the page never
grows, never trims, has no prefix key and is never shared. So the slots sit behind `PageManager` as its
slot group (after the KV groups: `PageManager.slot_group`), and the same calls cover them: fit and
allocate (a request without a slot needs a free one), free, fork (the child's slot is a copy of the
parent's: a copy entry of the slot group), swap (one more group of the host tier's `SwapPlan`,
offload.py) and the integrity check. A preempted request that does not swap out recomputes its state
from its tokens; a waiting request holds no slot.

The slot ids come from a `PagePool` of `num_slots` pages (pool.py), used without keys or sharing.
"""

from __future__ import annotations

from ..invariants import InvariantError, check
from ..requests import Request
from .pool import PagePool


class StateSlotPolicy:
    """`num_slots` slot ids, one per request that holds one (by request id)."""

    def __init__(self, num_slots: int) -> None:
        check(num_slots > 0, f"a state-slot pool needs slots, got {num_slots}")
        self.pool = PagePool(num_slots)
        self._owner: dict[str, int] = {}

    @property
    def num_slots(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free_pages

    @property
    def num_in_use(self) -> int:
        return len(self._owner)

    def has_free(self) -> bool:
        return self.pool.num_free_pages > 0

    def holds(self, request: Request | str) -> bool:
        return _id(request) in self._owner

    def acquire(self, request: Request | str) -> int:
        """A free slot for `request` (it must hold none and one must be free)."""
        request_id = _id(request)
        check(
            request_id not in self._owner,
            f"{request_id} already holds state slot {self._owner.get(request_id)}",
        )
        taken = self.pool.allocate(1)
        check(bool(taken), f"no free state slot for {request_id}")
        slot = taken[0]  # type: ignore[index]
        self._owner[request_id] = slot
        return slot

    def release(self, request: Request | str) -> None:
        """Give back the slot of `request`, if it holds one."""
        slot = self._owner.pop(_id(request), None)
        if slot is not None:
            self.pool.release([slot])

    def slot_of(self, request: Request | str) -> int:
        slot = self._owner.get(_id(request))
        check(slot is not None, f"{_id(request)} holds no state slot")
        return slot  # type: ignore[return-value]

    def check_integrity(self, holders: set[str]) -> None:
        """Raise `InvariantError` unless exactly `holders` hold slots, each its own."""
        check(
            set(self._owner) == holders,
            f"state slots held by {sorted(self._owner)}, expected {sorted(holders)}",
        )
        used = list(self._owner.values())
        check(len(set(used)) == len(used), f"a state slot is held twice: {self._owner}")
        try:
            self.pool.check_integrity([[slot] for slot in used])
        except InvariantError as error:
            raise InvariantError(f"state slots lost or duplicated: {error}") from error


def _id(request: Request | str) -> str:
    return request if isinstance(request, str) else request.request_id
