"""Who gives way when a running request's pages run out: `allocate_or_preempt`, the scheduler's victim rule.

Only requests newer than the one that needs pages are victims, whatever order the policy hands out the
step's budget in: under `decode_first` the decodes go first, and a newer decode taking an older prompt's
pages would, while requests keep arriving, restart that prompt again and again. A prompt that finds nobody
newer to preempt keeps its pages and waits for a later step while others run (they finish and free pages;
the scheduler's `_reserves` keeps new arrivals from taking them); a decode preempts itself, so that the
older ones keep going.
"""

from __future__ import annotations

from ..kv.page_manager import PageManager
from ..requests import Request, RequestStatus
from .queues import RequestQueues
from .step_plan import ScheduledRequest, StepPlan


def allocate_or_preempt(
    pages: PageManager,
    queues: RequestQueues,
    request: Request,
    num_tokens: int,
    scheduled: dict[int, ScheduledRequest],
    plan: StepPlan,
) -> bool:
    """Allocate `num_tokens` for a running request, preempting the newest unscheduled running requests newer
    than it as needed (into `plan`). Returns False if `request` runs nothing this step: preempted, failed, or
    (a prompt) waiting with its pages while others run."""
    position = queues.running.index(request)
    while not pages.allocate(request, num_tokens):
        victims = [r for r in queues.running[position + 1 :] if id(r) not in scheduled]
        if victims:
            queues.preempt(victims[-1], plan)
        elif scheduled and request.status != RequestStatus.DECODING:
            return False
        elif len(queues.running) > 1:
            queues.preempt(request, plan)
            return False
        else:
            queues.fail_unfittable(request, plan)
            return False
    return True
