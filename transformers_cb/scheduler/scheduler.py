"""The step scheduler: which requests run how many tokens in the next forward pass.

The scheduler works on plain data (requests, page ids) and never touches a tensor: `schedule()` returns a
`StepPlan` holding every decision of the step (entries, preemptions, fork copies, swaps, block-table rows
to release; step_plan.py; whether a waiting request starts: `Admission`, admission.py), the runner executes
it, and `update()`, the other half, applies the sampled tokens. The queues and every exit from the running
list (preemption, recompute, a LongRoPE switch, `finish()`; a change of the model's weights between two
steps, `weights_changed`) are `RequestQueues`' (queues.py), composed into the scheduler, which hands them
on. Every request that stops running, wherever it stops, joins one list, `ended`, which the next plan
carries as `released`: the runner gives its rows back and the draft model its shadow from there, the one
place. Policies (`fifo`, `prefill_first`, `decode_first`, policies.py) change the order in which candidates
get the step's token budget, and may bound the share of it prompts take (`prefill_limits`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from ..invariants import check
from ..kv.offload import CpuOffload, offload_or_none
from ..kv.page_manager import PageManager
from ..requests import Request, RequestStatus
from ..sampling.sampled_token import SampledToken
from .admission import Admission
from .forks import Forks
from .media_budget import MediaBudget, block_cut
from .policies import AdmissionGate, SchedulingPolicy, make_policy
from .preemption import allocate_or_preempt
from .queues import RequestQueues
from .recompute import RecomputeCounter
from .rope_switch import RopeSwitches
from .scheduler_settings import SchedulerSettings
from .speculation.drafts import append_verified, fit_draft
from .speculation.speculation_stats import SpeculationStats
from .step_plan import ScheduledRequest, StepPlan, TakeBack
from .weight_updates import UpdateMode


class Scheduler:
    """Decides each step over its queues (`queues`: a `RequestQueues`, the waiting queue, the running list
    and their exits) and the request <-> page bookkeeping.

    Args:
        pages: the device tier's pages, the scheduler's one facade over the KV groups' page
            policies, prefix sharing and (state layers) the per-request state slots
            (kv/page_manager.py): a running request holds one slot, admission needs a free one.
        settings: its resolved settings (`SchedulerSettings`, scheduler_settings.py): the candidate ordering
            (`scheduler_type`: `policy`), the safety margin (new requests are admitted only while the free
            fraction of pages is at least this, unless nothing runs) and `speculation_max_batch`
            (speculating requests draft only in steps where at most this many requests run:
            `speculates_now`; None: always).
        max_batch_tokens: query tokens per step (the engine's agreed `Sizing`).
        max_requests_per_batch: requests per step (the agreed `Sizing`).
        offload: the host tier's planner (CPU offload), given explicitly rather than behind the
            facade (see kv/page_manager.py): preempted requests swap out and back instead of
            recomputing while it has room (pages and state slot together); None: always recompute (the null
            planner, `NoOffload`, stands in: no call site asks whether offload is on).
        media: the embedding store's rows (media_budget.py): a request with media starts only while
            its rows fit; None: no request has media.
    """

    def __init__(
        self,
        pages: PageManager,
        settings: SchedulerSettings,
        max_batch_tokens: int,
        max_requests_per_batch: int,
        offload: CpuOffload | None = None,
        media: MediaBudget | None = None,
    ) -> None:
        self.pages = pages
        self.media = media
        self.offload = offload_or_none(offload)  # the null planner without a host tier
        self.weight_version = 0  # bumped by each change of the model's weights (`weights_changed`)
        self.recomputed = RecomputeCounter()  # tokens run again because preemption dropped their KV
        # Requests whose KV is recomputed at a LongRoPE switch (`Scheduler.schedule`), once each.
        self.rope_switches = RopeSwitches(pages.rope)
        # The waiting queue, the running list, `ended` and every exit from running.
        self.queues = RequestQueues(pages, self.offload, self.recomputed, self.rope_switches, media)
        self.speculation_max_batch = settings.speculation_max_batch
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.policy: SchedulingPolicy = make_policy(settings.scheduler_type)
        self.admission = Admission(pages, settings.safety_margin, self.recomputed, self.offload, media)
        self.forks = Forks(pages)  # siblings' forks, their copies for the next step's plan
        self.speculation = SpeculationStats()  # all requests' verification steps (speculation_stats.py)
        # Rejected draft tokens' pages given back by `update`: the next plan's `taken_back`.
        self.taken_back: list[TakeBack] = []

    @property
    def safety_margin(self) -> float:
        """The free share of pages a new request needs to start while others run (admission's)."""
        return self.admission.safety_margin

    @safety_margin.setter
    def safety_margin(self, value: float) -> None:
        self.admission.safety_margin = value

    @property
    def waiting(self) -> deque[Request]:
        """The waiting queue (`RequestQueues.waiting`)."""
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        """The running list, in admission order (`RequestQueues.running`)."""
        return self.queues.running

    @property
    def ended(self) -> list[Request]:
        """The requests that stopped running since the last plan: its `released` (`RequestQueues.ended`)."""
        return self.queues.ended

    @property
    def num_preemptions(self) -> int:
        return self.queues.num_preemptions

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

    # -- one step ------------------------------------------------------------------
    def schedule(self, drafts: Mapping[str, list[int]] | None = None) -> StepPlan:
        """Pick the next step. May preempt running requests (in `preempted`) and fail
        requests that can never fit the cache (in `failed`, already finished). `drafts`: the draft
        tokens proposed for speculating requests (`Drafts`, drafts.py), each cut to what the step fits.

        Candidates come in the policy's order (fifo: running ones, then waiting ones) while the step has
        token budget and request slots left. A running request keeps its place: it runs the tokens that
        fit, else takes the pages of the newest unscheduled running requests (preempting them), else is
        preempted (or, alone, failed) itself. A waiting request starts only while the FIFO gate is open
        (`Admission.admit`); the first that cannot start closes the gate for those behind it; one that can
        never fit (nothing runs, not one token fits) fails instead and opens it again."""
        budget = self.max_batch_tokens
        # The policy bounds the step's prompt tokens (decodes are not counted) and any one request's chunk.
        limits = self.policy.prefill_limits(budget, self.running, self.waiting)
        prefill_left = limits.budget
        scheduled: dict[int, ScheduledRequest] = {}
        plan = StepPlan(entries=[], taken_back=self._take_back_rows())
        self.queues.recompute_at_rope_switch(plan)
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
                proposed = (drafts or {}).get(request.request_id, [])
                draft = self.rope_switches.cut_draft(
                    request, fit_draft(request, budget, proposed, speculating)
                )
                num_tokens = self._keep_running(request, budget, scheduled, plan, len(draft))
            if prefills and self._reserves(request, num_tokens or 0):
                gate.close()
            if num_tokens is None:
                continue
            scheduled[id(request)] = self._entry(request, num_tokens, draft)
            budget -= num_tokens
            if prefills:
                prefill_left -= num_tokens
        # Entries follow the running list: stable admission order.
        plan.entries = [scheduled[id(r)] for r in self.running if id(r) in scheduled]
        plan.copies = self.forks.take() + self.pages.take_prefix_copies()
        plan.swaps = self.offload.take_plan()
        plan.released = self.queues.take_ended()
        return plan

    def plan_ran(self) -> None:
        """The last plan has run or failed (`Engine.step`, however it ends): its copies' sources let go."""
        self.pages.prefix_copies_ran()

    def _entry(self, request: Request, num_tokens: int, draft: list[int]) -> ScheduledRequest:
        """`request`'s entry in the plan: `num_tokens` from its computed ones, what fits of `draft`."""
        request.set_status(
            RequestStatus.DECODING
            if request.generated_ids and request.num_remaining_tokens == 1
            else RequestStatus.PREFILLING
        )
        draft = draft[: max(0, num_tokens - request.num_remaining_tokens)]
        state_slot = self.pages.state_slot(request)
        return ScheduledRequest(
            request, request.num_computed_tokens, num_tokens, draft, state_slot=state_slot
        )

    def update(
        self,
        plan: StepPlan,
        sampled: Sequence[Sequence[SampledToken]],
        prompt_logprobs: Mapping[str, list[float]] | None = None,
        prompt_top_logprobs: Mapping[str, list[dict[int, float]]] | None = None,
    ) -> list[Request]:
        """The other half of a step, after the forward: advance every scheduled request. `sampled[i]` holds
        the tokens of the i-th sampling entry (one, or a speculating entry's verified run),
        `prompt_logprobs` the prompt-token logprobs the step scored, by request id (the runner's
        `StepOutput`), `prompt_top_logprobs` their best alternatives where asked for. Returns the requests
        that finished in this step."""
        finished: list[Request] = []
        samples = iter(sampled)
        for entry in plan.entries:
            request = entry.request
            if entry.draft:
                if self._apply_verified(entry, list(next(samples))):
                    finished.append(request)
                continue
            request.num_computed_tokens = entry.end
            if self.media is not None:
                self.media.computed(request)
            request.add_prompt_logprobs(prompt_logprobs, prompt_top_logprobs)
            if self.recomputed.pending:
                self.recomputed.ran(request.request_id, entry.start, entry.end)
            self.pages.register(request)  # before a sliding group drops pages
            if request.fork_children and entry.end == self.forks.fork_point(request):
                self.forks.fork(request, self.running, self.waiting)
            # Step boundary: sliding-window groups return the pages that fell out of the window.
            self.pages.trim(request)
            if not entry.samples:
                continue
            (token,) = next(samples)
            request.record_weight_version(self.weight_version)
            request.append_token(token.token_id, token.logprob, token.top_logprobs)
            if self._stops(request, request.stop_reason()):
                finished.append(request)
        return finished

    def _apply_verified(self, entry: ScheduledRequest, run: list[SampledToken]) -> bool:
        """A speculating request's verified run (drafts.py `append_verified`), its KV kept for the
        accepted tokens only (the pages past them go back). Returns whether it finished."""
        request = entry.request
        request.record_weight_version(self.weight_version)
        reason = append_verified(request, len(entry.draft), run, self.speculation)
        # The KV of every appended token but the last is in the cache (the draft's, verified this step).
        request.num_computed_tokens = request.num_tokens - 1
        if self.recomputed.pending:
            self.recomputed.ran(request.request_id, entry.start, entry.end - len(entry.draft))
        self.pages.register(request)  # keys for full pages of accepted tokens only
        if self.pages.release_surplus(request):  # the block-table side runs from the next plan
            groups = range(len(self.pages.policies))
            self.taken_back.append(TakeBack(request, tuple(request.group_pages(g).end_page for g in groups)))
        self.pages.trim(request)
        return self._stops(request, reason)

    def _stops(self, request: Request, reason: str | None) -> bool:
        """Finish `request` if its last token ended it (`reason`: why), else it decodes on. Returns whether
        it finished."""
        if reason is None:
            request.set_status(RequestStatus.DECODING)
            return False
        request.finish_reason = reason
        self.queues.finish(request, RequestStatus.FINISHED)
        return True

    def _admit(self, request: Request, budget: int, gate: AdmissionGate, plan: StepPlan) -> int | None:
        """A waiting request's first tokens if it starts this step (`Admission.admit`: pages allocated; moved
        to the running list here), else None: it keeps waiting (holding nothing), or failed because it can
        never fit."""
        wanted = lambda: self._wanted(request, budget)  # noqa: E731
        admitted = self.admission.admit(request, wanted, gate, bool(self.running), self.weight_version)
        if admitted.never_fits:
            self.queues.fail_unfittable(request, plan)
            gate.open()  # it blocked nobody: the next waiting request may start
        if not admitted.started:
            return None
        self.waiting.remove(request)
        self.running.append(request)
        if admitted.encodes:
            plan.encode.append(request)
        return admitted.num_tokens or None  # swapped back in before an image block: it runs later

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
        if allocate_or_preempt(self.pages, self.queues, request, wanted, scheduled, plan):
            return wanted
        return None

    def _allocate(self, request: Request, num_tokens: int) -> None:
        """Allocate pages that `num_fitting_tokens` said fit; failing here is a bug, never skipped."""
        allocated = self.pages.allocate(request, num_tokens)
        check(allocated, f"{request.request_id}: {num_tokens} tokens were counted as fitting but did not")

    # -- the queues' exits, handed on (queues.py) ------------------------------------------------------
    def has_work(self) -> bool:
        return self.queues.has_work()

    def live_requests(self) -> list[Request]:
        return self.queues.live_requests()

    def weights_changed(self, mode: UpdateMode) -> list[Request]:
        """The model's weights changed (call between two steps): a new version, no page from before kept
        for later hits, the requests in flight treated by `mode` (weight_updates.py). Returns the requests
        it ended (`abort`), already finished."""
        self.weight_version += 1
        return self.queues.weights_changed(mode, self.weight_version)

    def drop_all_kv(self) -> None:
        """Every request in flight drops its KV and recomputes (`RequestQueues.drop_all_kv`)."""
        self.queues.drop_all_kv()

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """`request`'s pages taken away, swapped out or dropped (`RequestQueues.preempt`)."""
        self.queues.preempt(request, plan)

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """The single exit of a request, from any caller (`RequestQueues.finish`)."""
        self.queues.finish(request, status, error)

    def check_integrity(self) -> None:
        """Raise `InvariantError` if pages, statuses or queues are inconsistent (holds under `python -O`)."""
        self.queues.check_integrity()
