"""The step scheduler: which requests run how many tokens in the next forward pass.

The scheduler works on plain data (requests, page ids) and never touches a
tensor: `schedule()` returns a `StepPlan` holding every decision of the
step (entries, preemptions, fork copies, swaps, block-table rows to release;
plan.py; admission of waiting requests in admission.py), the runner executes it, and `update()` (step_results.py, the half that runs after the forward)
applies the sampled tokens. A change of the model's weights is applied between two steps by
`weights_changed` (weight_updates.py: a new weight version, the prefix keys dropped, the requests in flight
kept, recomputed or aborted). Every request that stops running, wherever it stops (preempted or failed in `schedule()`,
finished in `update()`, ended by `finish()` from any caller), joins one list, `ended`, which the next
plan carries as `released`: the runner gives its rows back and the draft model its shadow from there,
the one place. Policies (`fifo`, `prefill_first`, `decode_first`,
policies.py) change the order in which candidates get the step's token budget, and may bound the share of
it prompts take (`prefill_limits`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from ..invariants import check
from ..kv.offload import CpuOffload
from ..kv.page_manager import PageManager
from ..requests import FINISH_REASONS, Request, RequestStatus
from .admission import Admission
from .back_off import speculation_of
from .drafts import fit_draft
from .forks import Forks
from .media_budget import MediaBudget, block_cut
from .plan import ScheduledRequest, StepPlan, TakeBack
from .policies import AdmissionGate, SchedulingPolicy
from .recompute import RecomputeCounter
from .speculation_stats import SpeculationStats
from .step_results import StepResults
from .weight_updates import WeightUpdates


class Scheduler(Admission, StepResults, WeightUpdates):
    """Owns the waiting queue, the running list and the request <-> page bookkeeping.

    Args:
        pages: the device tier's pages, the scheduler's one facade over the KV groups' page
            policies, prefix sharing and (state layers) the per-request state slots
            (kv/page_manager.py): a running request holds one slot, admission needs a free one.
        max_batch_tokens: query tokens per step.
        max_requests_per_batch: requests per step.
        safety_margin: new requests are admitted only while the free fraction of
            pages is at least this (unless nothing runs).
        policy: candidate ordering.
        offload: the host tier's planner (CPU offload), given explicitly rather than behind the
            facade (see kv/page_manager.py): preempted requests swap out and back instead of
            recomputing while it has room (pages and state slot together); None: always recompute.
        speculation_max_batch: speculating requests draft only in steps where at most this many
            requests run (`speculates_now`; None: always).
        media: the embedding store's rows (media_budget.py): a request with media starts only while
            its rows fit; None: no request has media.
    """

    def __init__(
        self,
        pages: PageManager,
        max_batch_tokens: int,
        max_requests_per_batch: int,
        safety_margin: float,
        policy: SchedulingPolicy,
        offload: CpuOffload | None = None,
        speculation_max_batch: int | None = None,
        media: MediaBudget | None = None,
    ) -> None:
        self.pages = pages
        self.media = media
        self.speculation_max_batch = speculation_max_batch
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.safety_margin = safety_margin
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.offload = offload
        self.num_preemptions = 0
        self.weight_version = 0  # bumped by each change of the model's weights (`weights_changed`)
        self.recomputed = RecomputeCounter()  # tokens run again because preemption dropped their KV
        # Requests whose KV was recomputed at a LongRoPE switch (`_recompute_at_rope_switch`): never again.
        self.rope_switched: set[str] = set()
        self.forks = Forks(pages)  # siblings' forks, their copies for the next step's plan
        self.speculation = SpeculationStats()  # all requests' verification steps (speculation_stats.py)
        # Rejected draft tokens' pages given back by `update`: the next plan's `taken_back`.
        self.taken_back: list[TakeBack] = []
        # Requests that stopped running since the last plan (ended, preempted, failed): its `released`.
        self.ended: list[Request] = []

    # -- queue -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue `request`; its fork siblings ride with it (forks.py), or queue as requests of their own."""
        self.waiting.append(request)
        if request.fork_children and not self.forks.rides_along(request):
            self.waiting.extend(request.fork_children)
            request.fork_children = []

    def _wanted(self, request: Request, budget: int) -> int:
        """The tokens `request` would run with `budget` left, stopping at its siblings' fork point."""
        return self.forks.cap(request, min(request.num_remaining_tokens, budget))

    def speculates_now(self) -> bool:
        """Whether this step's speculating requests draft: not when more requests run than
        `speculation_max_batch` (a large batch's step is compute-bound: checking a draft token costs what
        decoding one does). The draft model asks before drafting, the schedule before proposing."""
        return self.speculation_max_batch is None or len(self.running) <= self.speculation_max_batch

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    # -- one step ------------------------------------------------------------------
    def schedule(self, drafts: Mapping[str, list[int]] | None = None) -> StepPlan:
        """Pick the next step. May preempt running requests (in `preempted`) and fail
        requests that can never fit the cache (in `failed`, already finished). `drafts`: the draft
        tokens proposed for speculating requests (`Drafts`, drafts.py), each cut to what the step fits."""
        # The algorithm: candidates come in the policy's order (fifo: running ones, then waiting ones)
        # while the step has token budget and request slots left. A running request keeps its place:
        # it runs the tokens that fit, else takes the pages of the newest unscheduled running requests
        # (preempting them), else is preempted (or, alone, failed) itself. A waiting request starts
        # only while the FIFO gate is open: it swaps back in (CPU offload), or takes its cached prefix
        # and the pages its first chunk needs while the free share stays above the safety margin. The
        # first waiting request that cannot start closes the gate for those behind it; one that can
        # never fit (nothing runs, not one token fits) fails instead and opens it again.
        budget = self.max_batch_tokens
        # The policy bounds the step's prompt tokens (decodes are not counted) and any one request's chunk.
        limits = self.policy.prefill_limits(budget, self.running, self.waiting)
        prefill_left = limits.budget
        scheduled: dict[int, ScheduledRequest] = {}
        plan = StepPlan(entries=[], taken_back=self._take_back_rows())
        self._recompute_at_rope_switch(plan)
        gate = AdmissionGate()
        speculating = self.speculates_now()
        for request in self.policy.candidates(self.running, self.waiting):
            if budget == 0 or len(scheduled) == self.max_requests_per_batch:
                break
            if request.is_finished:
                continue
            if request in plan.preempted:
                gate.close()  # it waits at the head of the queue: nobody overtakes it this step
                continue
            draft: list[int] = []
            prefills = request.status != RequestStatus.DECODING
            if prefills and prefill_left == 0:
                continue  # it waits for a later step (a waiting one does not close the gate: none fits now)
            if request.status in (RequestStatus.PENDING, RequestStatus.EVICTED):
                num_tokens = self._admit(request, min(budget, prefill_left, limits.chunk), gate, plan)
            elif prefills:
                num_tokens = self._keep_running(
                    request, min(budget, prefill_left, limits.chunk), scheduled, plan
                )
            else:
                if (
                    speculating
                    and request.speculation is not None
                    and request.num_remaining_tokens == 1
                    and request.generated_ids
                ):
                    # The budget counts draft tokens.
                    draft = fit_draft(request, budget, (drafts or {}).get(request.request_id, []))
                    draft = self._draft_before_rope_switch(request, draft)
                num_tokens = self._keep_running(request, budget, scheduled, plan, len(draft))
            if prefills and self._reserves(request, num_tokens or 0):
                gate.close()
            if num_tokens is None:
                continue
            request.set_status(
                RequestStatus.DECODING
                if request.generated_ids and request.num_remaining_tokens == 1
                else RequestStatus.PREFILLING
            )
            draft = draft[: max(0, num_tokens - request.num_remaining_tokens)]  # what fits of it
            scheduled[id(request)] = ScheduledRequest(
                request,
                request.num_computed_tokens,
                num_tokens,
                draft,
                state_slot=self.pages.state_slot(request),
            )
            budget -= num_tokens
            if prefills:
                prefill_left -= num_tokens
        # Entries follow the running list: stable admission order.
        plan.entries = [scheduled[id(r)] for r in self.running if id(r) in scheduled]
        plan.copies = self.forks.take()
        if self.offload is not None:
            plan.swaps = self.offload.take_plan()
        plan.released, self.ended = self.ended, []
        return plan

    def _recompute_at_rope_switch(self, plan: StepPlan) -> None:
        """Drop the KV of the running requests the model's `generate()` computes again from scratch at this
        length (Phi-3's LongRoPE switch, kv/rope_rule.py `RopeRule.must_recompute`): they go back to the
        head of the queue and recompute prompt + generated tokens with the long factors. Not a preemption
        (no page shortage): not counted as one, and never swapped to the host tier."""
        rope = self.pages.rope
        if rope is None or not rope.recomputes_at_switch:
            return
        for request in list(self.running):
            if request.is_finished or request.request_id in self.rope_switched:
                continue
            if not rope.must_recompute(
                request.num_prompt_tokens, request.num_computed_tokens, request.num_tokens
            ):
                continue
            self.rope_switched.add(request.request_id)
            self._drop_kv(request)
            self._free_pages(request)
            # Its keys were salted with the short factors' (empty) salt: they are keyed again.
            request.num_registered_pages = 0
            request.page_keys.clear()
            request.set_status(RequestStatus.EVICTED)
            self.running.remove(request)
            self.waiting.appendleft(request)
            plan.preempted.append(request)
            self._stopped(request)

    def _draft_before_rope_switch(self, request: Request, draft: list[int]) -> list[int]:
        """`draft` cut so that its verification stays before the request's LongRoPE switch (Phi-3's
        `generate()` recomputes there: `RopeRule.draft_room`)."""
        rope = self.pages.rope
        if rope is None or request.request_id in self.rope_switched:
            return draft
        room = rope.draft_room(request.num_prompt_tokens, request.num_tokens)
        return draft if room is None else draft[:room]

    def _reserves(self, request: Request, num_tokens: int) -> bool:
        """Whether a started prompt (one that runs `num_tokens` now, or waits holding its pages) keeps the
        waiting requests behind it out: the rest of its prompt does not fit in its pages plus the free ones.

        Why: admitted behind it, they would take the pages as they free up, step after step, and a prompt
        that needs most of the cache would wait (or be preempted and start again) for as long as requests
        keep arriving; kept out, the running ones finish and give it their pages."""
        if request not in self.running:
            return False
        remaining = request.num_remaining_tokens  # this step's tokens and the rest
        return remaining > num_tokens and self.pages.num_fitting_tokens(request, remaining) < remaining

    def _take_back_rows(self) -> list[TakeBack]:
        """The rollbacks since the last plan, for the runner: those of requests still live (an ended
        request's rows went back whole)."""
        taken_back, self.taken_back = self.taken_back, []
        return [item for item in taken_back if not item.request.is_finished]

    def _keep_running(
        self,
        request: Request,
        budget: int,
        scheduled: dict[int, ScheduledRequest],
        plan: StepPlan,
        num_draft: int = 0,
    ) -> int | None:
        """A running request's tokens this step (pages allocated), or None when it had to be preempted
        or failed itself. `num_draft` draft tokens run too where pages fit them; nobody is preempted for them."""
        wanted = block_cut(request, self._wanted(request, budget))
        if wanted == 0:  # the next image block does not fit this step's budget: it waits for a later step
            return None
        num_tokens = block_cut(
            request, self.pages.num_fitting_tokens(request, min(wanted + num_draft, budget))
        )
        if num_tokens > 0:
            self._allocate(request, num_tokens)
            return num_tokens
        if self._allocate_or_preempt(request, wanted, scheduled, plan):
            return wanted
        return None

    def _allocate(self, request: Request, num_tokens: int) -> None:
        """Allocate pages that `num_fitting_tokens` said fit; failing here is a bug, never skipped."""
        allocated = self.pages.allocate(request, num_tokens)
        check(allocated, f"{request.request_id}: {num_tokens} tokens were counted as fitting but did not")

    def _allocate_or_preempt(
        self,
        request: Request,
        num_tokens: int,
        scheduled: dict[int, ScheduledRequest],
        plan: StepPlan,
    ) -> bool:
        """Allocate for a running request, preempting the newest unscheduled ones newer than it as needed.

        Returns False if `request` runs nothing this step: preempted, failed, or (a prompt) waiting with
        its pages while others run. Only newer requests are victims, whatever order the policy hands out
        the budget in: under `decode_first` the decodes go first, and a newer decode taking an older
        prompt's pages would, while requests keep arriving, restart that prompt again and again. A prompt
        that finds nobody newer to preempt keeps its pages and waits for a later step while others run
        (they finish and free pages; `_reserves` keeps new arrivals from taking them); a decode preempts
        itself, so that the older ones keep going.
        """
        position = self.running.index(request)
        while not self.pages.allocate(request, num_tokens):
            victims = [r for r in self.running[position + 1 :] if id(r) not in scheduled]
            if victims:
                self.preempt(victims[-1], plan)
            elif scheduled and request.status != RequestStatus.DECODING:
                return False
            elif len(self.running) > 1:
                self.preempt(request, plan)
                return False
            else:
                self._fail_unfittable(request, plan)
                return False
        return True

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Take the pages (and state slot) of `request` away: swapped out to the host tier when there is one
        with room, else dropped (it recomputes prompt + generated tokens later)."""
        if self.offload is None or not self.offload.try_swap_out(request):
            self._drop_kv(request)
        self._free_pages(request)
        # Its pages (fresh ones after a swap-in) are no longer the keyed ones: `register` keys them again.
        request.num_registered_pages = 0
        request.num_preemptions += 1
        request.set_status(RequestStatus.EVICTED)
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        plan.preempted.append(request)
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

    def _drop_kv(self, request: Request) -> None:
        self.recomputed.dropped(request.request_id, request.num_computed_tokens)
        request.num_computed_tokens = 0

    def _free_pages(self, request: Request) -> None:
        self.pages.free(request)  # with its state slot and its promises of pages not computed yet

    def _fail_unfittable(self, request: Request, plan: StepPlan) -> None:
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
        self.rope_switched.discard(request.request_id)
        if self.offload is not None:
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
        kept = self.offload.device_tables() if self.offload is not None else None
        self.pages.check_integrity(self.live_requests(), self.running, kept)
        if self.offload is not None:
            self.offload.check_integrity({request.request_id for request in self.waiting})
        for request in self.running:
            check(
                request.status in (RequestStatus.PREFILLING, RequestStatus.DECODING),
                f"running {request.request_id} has status {request.status.name}",
            )
        for request in self.waiting:
            check(not request.holds_pages, f"waiting {request.request_id} holds pages")
            swapped = self.offload is not None and self.offload.is_swapped(request)
            check(
                swapped == (request.num_computed_tokens > 0),
                f"waiting {request.request_id}: {request.num_computed_tokens=} but swapped out={swapped}",
            )
