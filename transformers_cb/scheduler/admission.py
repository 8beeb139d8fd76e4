"""Admission: whether one waiting request starts this step, and with how many tokens.

`Admission.admit` allocates for the request or refuses it, against the device pages, the host tier, the
embedding store and the safety margin, behind the step's FIFO gate (`AdmissionGate`, policies.py), as
mini-sglang's `PrefillAdder` does; `Scheduler` (scheduler.py) calls it from its candidate loop and does the
rest: it moves the request between its queues, fails it when it can never fit, fills the plan. A waiting request swaps back in (CPU offload), or takes its cached prefix (unless a
running request is computing the next page of it: it waits to hit that page) and the pages its first chunk
needs, while the free share of pages stays above the safety margin and its media fit the embedding store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..invariants import check
from ..kv.offload import NoOffload, Offload
from ..kv.page_manager import PageManager
from ..requests import Request
from .media_budget import MediaBudget, block_cut
from .policies import AdmissionGate
from .recompute import RecomputeCounter, drop_kv


@dataclass(frozen=True)
class Admitted:
    """What `Admission.admit` decided for one waiting request.

    `started`: it starts (moved to the running list by the scheduler), with `num_tokens` this step, pages
    allocated (0: swapped back in before an image block this step's budget cannot hold: it runs later);
    `never_fits`: it can never fit (nothing runs and not one token fits): the scheduler fails it;
    `encodes`: its media are encoded this step (rows held in the embedding store)."""

    started: bool
    num_tokens: int = 0
    never_fits: bool = False
    encodes: bool = False


class Admission:
    """Starts waiting requests or refuses them; holds no queue and no plan."""

    def __init__(
        self,
        pages: PageManager,
        safety_margin: float,
        recomputed: RecomputeCounter,
        offload: Offload | None = None,
        media: MediaBudget | None = None,
    ) -> None:
        self.pages = pages
        self.safety_margin = safety_margin
        self.recomputed = recomputed
        self.offload: Offload = offload if offload is not None else NoOffload()
        self.media = media

    def admit(
        self,
        request: Request,
        wanted: Callable[[], int],
        gate: AdmissionGate,
        running: bool,
        weight_version: int,
    ) -> Admitted:
        """Whether `request` starts this step. `wanted()`: the tokens it would run (its budget, its fork
        point); `running`: whether any request runs; `weight_version`: the weights' version now, that of a
        KV computed from nothing. Refused, it keeps waiting holding nothing."""
        swapped_in = False
        if self.offload.is_swapped(request):
            swapped_in = self._swap_in(self.offload, request, gate.is_open, running)
            if not swapped_in and self.offload.is_swapped(request):  # it waits, and so do later ones
                gate.close()
                return Admitted(False)
        if not swapped_in:  # it starts from nothing: its KV is computed with the weights of now
            request.kv_version = weight_version
        # A swapped-in request has its own KV back: no prefix lookup, no waiting for pages.
        looks_up = gate.is_open and not swapped_in
        hit = looks_up and self._attach_prefix(request)
        if looks_up and self._waits_for_pages(request, hit):
            return Admitted(False)
        num_tokens = block_cut(request, self.pages.num_fitting_tokens(request, wanted()))
        # A swapped-in request holds its pages (and slot) again: it is admitted (at least one token fits).
        # Without a free state slot nothing fits (`PageManager.num_fitting_tokens`).
        # A request with placeholders still to compute waits for room in the embedding store; one swapped
        # back in mid-image is already admitted and takes its rows past the capacity (they go soon).
        if not (
            swapped_in
            or (gate.is_open and num_tokens > 0 and self._admits(running) and self._media_fits(request))
        ):
            gate.close()
            if hit:  # waiting requests hold no pages: the hit goes back to the cache
                self.pages.detach_prefix(request)
                num_tokens = block_cut(request, self.pages.num_fitting_tokens(request, wanted()))
            return Admitted(False, never_fits=not running and num_tokens == 0)
        allocated = self.pages.allocate(request, num_tokens)  # counted as fitting: failing is a bug
        check(allocated, f"{request.request_id}: {num_tokens} tokens were counted as fitting but did not")
        self.pages.promise(request)
        encodes = self.media is not None and self.media.needs(request)
        if encodes and self.media is not None:
            self.media.hold(request)
        return Admitted(True, num_tokens, encodes=encodes)

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

    def _admits(self, running: bool) -> bool:
        return not running or self.pages.free_fraction >= self.safety_margin

    def _swap_in(self, offload: Offload, request: Request, admitting: bool, running: bool) -> bool:
        """Take a swapped-out request back from the host tier if it may start now. With nothing running
        and no room (pages kept by other swapped-out requests), it recomputes instead of waiting forever."""
        if admitting and self._admits(running) and offload.can_swap_in(request):
            offload.swap_in(request)
            return True
        if not running:
            offload.discard(request)
            drop_kv(request, self.recomputed)
        return False
