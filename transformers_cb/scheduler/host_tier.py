"""The host tier as the scheduler sees it: a preempted request's KV pages (kv/offload.py `CpuOffload`)
and, for a model with state layers, its state slot (a host state slot) go out together and come back
together, so that it resumes without recomputing. A request swaps out only when both have room; a
state model's request swaps in only when a device slot is free too.
"""

from __future__ import annotations

from ..invariants import check
from ..kv.offload import CpuOffload
from ..kv.state_slots import StateSlots
from ..requests import Request
from .plan import StepPlan


class HostTier:
    """Args: offload: the pages' planner; state_slots / host_slots: the device's and the host's state
    slots of a model with state layers (None: no state layers)."""

    def __init__(
        self, offload: CpuOffload, state_slots: StateSlots | None, host_slots: StateSlots | None
    ) -> None:
        check((state_slots is None) == (host_slots is None), "state slots on one tier only")
        self.offload = offload
        self.state_slots = state_slots
        self.host_slots = host_slots

    def is_swapped(self, request: Request) -> bool:
        return self.offload.is_swapped(request)

    def swap_out(self, request: Request, plan: StepPlan) -> bool:
        """Plan `request`'s pages (and state slot) to the host; False (nothing changed) when there is no
        room or nothing computed to keep."""
        slots, host = self.state_slots, self.host_slots
        if (
            slots is not None
            and host is not None
            and not (host.has_free() and slots.holds(request.request_id))
        ):
            return False
        if not self.offload.try_swap_out(request):
            return False
        if slots is not None and host is not None:
            plan.state_swaps_out.append((slots.slot_of(request.request_id), host.acquire(request.request_id)))
        return True

    def can_swap_in(self, request: Request) -> bool:
        free_slot = self.state_slots is None or self.state_slots.has_free()
        return free_slot and self.offload.can_swap_in(request)

    def swap_in(self, request: Request) -> None:
        """Give `request` its pages back (copies planned); its state follows once it holds a slot
        (`state_back`)."""
        self.offload.swap_in(request)

    def state_back(self, request: Request, slot: int, plan: StepPlan) -> None:
        """A swapped-in request's state, into its new device `slot` (planned)."""
        if self.host_slots is not None:
            plan.state_swaps_in.append((self.host_slots.slot_of(request.request_id), slot))
            self.host_slots.release(request.request_id)

    def discard(self, request: Request) -> None:
        """Forget what `request` has on the host (its pages and state slot), if anything."""
        self.offload.discard(request)
        if self.host_slots is not None:
            self.host_slots.release(request.request_id)

    def check_integrity(self, waiting: list[Request]) -> None:
        """Host pages and slots match the swapped-out requests, which all wait (`InvariantError`)."""
        self.offload.check_integrity({request.request_id for request in waiting})
        if self.host_slots is not None:
            self.host_slots.check_integrity({r.request_id for r in waiting if self.offload.is_swapped(r)})
