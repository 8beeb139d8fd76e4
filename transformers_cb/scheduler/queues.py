"""`RequestQueues`, composed into `Scheduler`: the waiting queue, the running list and every way a request
leaves running: `preempt` (to the host tier, or its KV dropped), a recompute (`drop_all_kv`, a change of the
model's weights: `weights_changed`), a request that can never fit failed (`fail_unfittable`) and the single
`finish()` exit. Wherever a request stops running it joins one list, `ended`, which the next plan carries as
`released` (`take_ended`); `check_integrity` checks the queues against the pages.
"""

from __future__ import annotations

import time
from collections import deque

from ..invariants import check
from ..kv.offload import Offload
from ..kv.page_manager import PageManager
from ..requests import FINISH_REASONS, Request, RequestStatus
from .media_budget import MediaBudget
from .recompute import RecomputeCounter, drop_kv
from .rope_switch import RopeSwitches
from .speculation.back_off import speculation_of
from .step_plan import StepPlan
from .weight_updates import UpdateMode, aborted_error, in_flight, too_stale


class RequestQueues:
    """The scheduler's queues (`waiting`, `running`) and their exits, into `ended`.

    Args:
        pages: the device tier's pages (kv/page_manager.py), freed when a request leaves running.
        offload: the host tier's planner (or the null one): a preempted request swaps out while it has room.
        recomputed: the tokens run again because a request's KV was dropped.
        rope_switches: the LongRoPE switches (rope_switch.py), forgotten when a request ends.
        media: the embedding store's rows (media_budget.py), released when a request stops; None: no media.
    """

    def __init__(
        self,
        pages: PageManager,
        offload: Offload,
        recomputed: RecomputeCounter,
        rope_switches: RopeSwitches,
        media: MediaBudget | None,
    ) -> None:
        self.pages = pages
        self.offload = offload
        self.recomputed = recomputed
        self.rope_switches = rope_switches
        self.media = media
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests that stopped running since the last plan (ended, preempted, failed): its `released`.
        self.ended: list[Request] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    def take_ended(self) -> list[Request]:
        """The requests that stopped running since the last plan (the next plan's `released`), emptied."""
        ended, self.ended = self.ended, []
        return ended

    # -- weight updates ------------------------------------------------------------------------------
    def weights_changed(self, mode: UpdateMode, version: int) -> list[Request]:
        """The model's weights changed (call between two steps) to `version`: no page from before kept for
        later hits, the requests in flight treated by `mode` (weight_updates.py). Returns the requests it
        ended (`abort`), already finished."""
        self.pages.weights_changed(version, self.running)
        ended: list[Request] = []
        recomputed: list[Request] = []
        for request in self._in_flight():
            if mode == "abort":
                self.finish(request, RequestStatus.ABORTED, aborted_error(version))
                ended.append(request)
            elif (mode == "recompute" or too_stale(request, version)) and self._recompute(request):
                recomputed.append(request)
        # Back at the head of the queue, in their order: they were running (or waiting) before the others.
        for request in reversed(recomputed):
            self.waiting.appendleft(request)
        return ended

    def drop_all_kv(self) -> None:
        """Every request in flight drops its KV (device pages, host pages, state slot) and runs prompt +
        tokens so far again from its next admission, at the head of the queue in its order; the weight
        version stays. The manager's `release_cache()`: no request may hold KV in tensors about to be freed."""
        recomputed = [request for request in self._in_flight() if self._recompute(request)]
        for request in reversed(recomputed):
            self.waiting.appendleft(request)

    def _in_flight(self) -> list[Request]:
        """The running requests in order, then the waiting ones that hold KV in the host tier or have tokens."""
        swapped = self.offload.is_swapped
        return [*self.running, *(r for r in self.waiting if in_flight(r, swapped(r)))]

    def _recompute(self, request: Request) -> bool:
        """Drop the request's KV (device pages, host pages, state slot): it runs prompt + tokens so far
        again from its next admission. Returns whether it was running (it left the running list)."""
        if self.offload.is_swapped(request):
            self.offload.discard(request)
        drop_kv(request, self.recomputed)
        if request not in self.running:
            return False
        self.leave_running(request)  # its rows go with the next plan's `released`, its draft shadow too
        return True

    # -- leaving the running list, ending ------------------------------------------------------------
    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Take the pages (and state slot) of `request` away: swapped out to the host tier when there is one
        with room, else dropped (it recomputes prompt + generated tokens later)."""
        if not self.offload.try_swap_out(request):
            drop_kv(request, self.recomputed)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.leave_running(request)
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    def recompute_at_rope_switch(self, plan: StepPlan) -> None:
        """Drop the KV of the running requests the model's `generate()` computes again from scratch at this
        length (Phi-3's LongRoPE switch, rope_switch.py): they go back to the head of the queue and recompute
        prompt + generated tokens with the long factors. Not a preemption (no page shortage): not counted as
        one, and never swapped to the host tier."""
        for request in self.rope_switches.due(self.running):
            drop_kv(request, self.recomputed)
            request.page_keys.clear()  # keyed with the short factors' (empty) salt: keyed again
            self.leave_running(request)
            self.waiting.appendleft(request)
            plan.preempted.append(request)

    def leave_running(self, request: Request) -> None:
        """`request` stops running without ending (preempted, recomputed): its pages and state slot freed, its
        pages keyed again when it is back (`register`), EVICTED, out of the running list, into `ended`."""
        self._free_pages(request)
        request.num_registered_pages = 0
        request.set_status(RequestStatus.EVICTED)
        self.running.remove(request)
        self._stopped(request)

    def _stopped(self, request: Request) -> None:
        """`request` stopped running: into `ended` (its rows go with the next plan's `released`), and its
        draft source lets go of what it holds for it (the draft model's shadow)."""
        self.ended.append(request)
        if self.media is not None:
            self.media.release(request)
        state = speculation_of(request)
        if state is not None:
            state.source.stopped(request)

    def _free_pages(self, request: Request) -> None:
        self.pages.free(request)  # with its state slot and its promises of pages not computed yet

    def fail_unfittable(self, request: Request, plan: StepPlan) -> None:
        """`request` needs more pages than the cache has: it fails (in the plan's `failed`)."""
        self.finish(
            request,
            RequestStatus.FAILED,
            error=(
                f"request {request.request_id!r} needs more KV pages than the cache has "
                f"({self.pages.describe_need(request.num_tokens)})"
            ),
        )
        plan.failed.append(request)

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """The single exit of a request (finished, failed, cancelled, from any caller): frees its pages (and
        its host pages), stamps the time, removes it from the queues, and adds it to `ended` (its block-table
        rows and shadow go with the next plan's `released`)."""
        if request.is_finished:
            return
        parent = request.fork_parent
        if parent is not None and request in parent.fork_children:  # not forked yet
            parent.fork_children.remove(request)
        if request.fork_children:  # ended before its prompt was computed: the siblings go on alone
            self.waiting.extend(request.fork_children)
            request.fork_children = []
        self._free_pages(request)
        self.recomputed.forget(request.request_id)
        self.rope_switches.forget(request.request_id)
        self.offload.discard(request)
        request.error = error
        if status != RequestStatus.FINISHED and request.finish_reason is None:
            request.finish_reason = FINISH_REASONS.get(status, status.name.lower())
        request.set_status(status)
        request.finish_time = time.perf_counter()
        self._stopped(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def check_integrity(self) -> None:
        """Raise `InvariantError` if pages, statuses or queues are inconsistent (holds under `python -O`)."""
        self.pages.check_integrity(self.live_requests(), self.running, self.offload.device_tables())
        self.offload.check_integrity({request.request_id for request in self.waiting})
        for request in self.running:
            check(
                request.status in (RequestStatus.PREFILLING, RequestStatus.DECODING),
                f"running {request.request_id} has status {request.status.name}",
            )
        for request in self.waiting:
            check(not request.holds_pages, f"waiting {request.request_id} holds pages")
            swapped = self.offload.is_swapped(request)
            check(
                swapped == (request.num_computed_tokens > 0),
                f"waiting {request.request_id}: {request.num_computed_tokens=} but swapped out={swapped}",
            )
