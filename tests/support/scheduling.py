"""The scheduler's settings for the tests that build a `Scheduler` by hand (no engine)."""

from __future__ import annotations

from transformers_cb.scheduler.scheduler_plan import SchedulerPlan


def scheduler_plan(scheduler_type: str = "fifo", safety_margin: float = 0.0) -> SchedulerPlan:
    """A `SchedulerPlan` as `resolve_scheduler_plan` makes one: no queue bound, speculation at any batch size."""
    return SchedulerPlan(scheduler_type, safety_margin, max_queue_size=0, speculation_max_batch=None)
