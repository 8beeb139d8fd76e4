"""The scheduler's half that runs after the forward: a step's sampled tokens applied to its requests.

`StepResults.update` advances every scheduled request (computed tokens, prompt logprobs, page keys, forks
at their point, sliding pages trimmed), appends each sampled token or a speculating request's verified run,
and finishes the requests that stop. `Scheduler` (scheduler.py) is the other half, deciding the step; it
owns the state both read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..requests import Request, RequestStatus
from ..sampling.sampled_token import SampledToken
from .drafts import append_verified
from .plan import ScheduledRequest, StepPlan, TakeBack
from .scheduler_state import SchedulerState


class StepResults(SchedulerState):
    """Mixed into `Scheduler`."""

    def update(
        self,
        plan: StepPlan,
        sampled: Sequence[Sequence[SampledToken]],
        prompt_logprobs: Mapping[str, list[float]] | None = None,
        prompt_top_logprobs: Mapping[str, list[dict[int, float]]] | None = None,
    ) -> list[Request]:
        """Advance every scheduled request; `sampled[i]` holds the tokens of the i-th sampling entry (one,
        or a speculating entry's verified run), `prompt_logprobs` the prompt-token logprobs the step
        scored, by request id (the runner's `StepOutput`), `prompt_top_logprobs` their best alternatives
        where asked for.

        Returns the requests that finished in this step.
        """
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
            scored = prompt_logprobs.get(request.request_id) if prompt_logprobs else None
            if scored:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = []
                request.prompt_logprobs.extend(scored)
                tops = prompt_top_logprobs.get(request.request_id) if prompt_top_logprobs else None
                if tops:
                    request.prompt_top_logprobs = [*(request.prompt_top_logprobs or ()), *tops]
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
            reason = request.stop_reason()
            if reason is not None:
                request.finish_reason = reason
                self.finish(request, RequestStatus.FINISHED)
                finished.append(request)
            else:
                request.set_status(RequestStatus.DECODING)
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
        if reason is not None:
            request.finish_reason = reason
            self.finish(request, RequestStatus.FINISHED)
            return True
        request.set_status(RequestStatus.DECODING)
        return False
