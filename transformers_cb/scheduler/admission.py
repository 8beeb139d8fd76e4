"""Admission: whether a waiting request starts this step, and with how many tokens.

A waiting request swaps back in from the host tier (CPU offload), or takes its cached prefix (unless a
running request is computing the next page of it: it waits to hit that page) and the pages its first chunk
needs, while the free share of pages stays above the safety margin and its media fit the embedding store;
all behind the step's FIFO gate (`AdmissionGate`, policies.py). `Scheduler` (scheduler.py) mixes this in
and calls `_admit` from its candidate loop.
"""

from __future__ import annotations

from ..kv.offload import CpuOffload
from ..requests import Request
from .media_budget import block_cut
from .plan import StepPlan
from .policies import AdmissionGate
from .scheduler_state import SchedulerState


class Admission(SchedulerState):
    """Mixed into `Scheduler`."""

    def _admit(self, request: Request, budget: int, gate: AdmissionGate, plan: StepPlan) -> int | None:
        """A waiting request's first tokens if it starts this step (moved to the running list, pages
        allocated), else None: it keeps waiting (holding nothing), or failed because it can never fit."""
        swapped_in = False
        if self.offload is not None and self.offload.is_swapped(request):
            swapped_in = self._swap_in(self.offload, request, gate.is_open)
            if not swapped_in and self.offload.is_swapped(request):  # it waits, and so do later ones
                gate.close()
                return None
        if not swapped_in:  # it starts from nothing: its KV is computed with the weights of now
            request.kv_version = self.weight_version
        # A swapped-in request has its own KV back: no prefix lookup, no waiting for pages.
        looks_up = gate.is_open and not swapped_in
        hit = looks_up and self._attach_prefix(request)
        if looks_up and self._waits_for_pages(request, hit):
            return None
        num_tokens = block_cut(request, self.pages.num_fitting_tokens(request, self._wanted(request, budget)))
        # A swapped-in request holds its pages (and slot) again: it is admitted (at least one token fits).
        # Without a free state slot nothing fits (`PageManager.num_fitting_tokens`).
        # A request with placeholders still to compute waits for room in the embedding store; one swapped
        # back in mid-image is already admitted and takes its rows past the capacity (they go soon).
        if not (
            swapped_in or (gate.is_open and num_tokens > 0 and self._admits() and self._media_fits(request))
        ):
            gate.close()
            if hit:  # waiting requests hold no pages: the hit goes back to the cache
                self.pages.detach_prefix(request)
                num_tokens = block_cut(
                    request, self.pages.num_fitting_tokens(request, self._wanted(request, budget))
                )
            if not self.running and num_tokens == 0:
                self._fail_unfittable(request, plan)
                gate.open()  # it blocked nobody: the next waiting request may start
            return None
        self._allocate(request, num_tokens)
        self.waiting.remove(request)
        self.running.append(request)
        self.pages.promise(request)
        if self.media is not None and self.media.needs(request):
            self.media.hold(request)
            plan.encode.append(request)
        # A request swapped back in before an image block this step's budget cannot hold runs in a later step.
        return num_tokens if num_tokens > 0 else None

    def _media_fits(self, request: Request) -> bool:
        return self.media is None or not self.media.needs(request) or self.media.fits(request)

    def _attach_prefix(self, request: Request) -> bool:
        """Take the cached pages of the request's prefix (prefix sharing on). True if any hit.

        Requests asking for prompt logprobs compute every prompt position, so they take none."""
        if request.wants_prompt_logprobs:
            return False
        return self.pages.attach_prefix(request) > 0

    def _waits_for_pages(self, request: Request, hit: bool) -> bool:
        """Leave `request` waiting (holding nothing) while a running request computes the next page
        of its prefix: it will hit that page in a later step instead of computing it again."""
        if request.wants_prompt_logprobs or not self.pages.waits_for_pages(request):
            return False
        if hit:
            self.pages.detach_prefix(request)
        return True

    def _admits(self) -> bool:
        if not self.running:
            return True
        return self.pages.free_fraction >= self.safety_margin

    def _swap_in(self, offload: CpuOffload, request: Request, admitting: bool) -> bool:
        """Take a swapped-out request back from the host tier if it may start now. With nothing running
        and no room (pages kept by other swapped-out requests), it recomputes instead of waiting forever."""
        if admitting and self._admits() and offload.can_swap_in(request):
            offload.swap_in(request)
            return True
        if not self.running:
            offload.discard(request)
            self._drop_kv(request)
        return False
