"""The scheduler's settings for the tests that build a `Scheduler` by hand (no engine)."""

from __future__ import annotations

from transformers_cb.scheduler.scheduler_settings import SchedulerSettings


def scheduler_settings(scheduler_type: str = "fifo", safety_margin: float = 0.0) -> SchedulerSettings:
    """A `SchedulerSettings` as `resolve_scheduler_settings` makes one: no queue bound, speculation at any batch size."""
    return SchedulerSettings(scheduler_type, safety_margin, max_queue_size=0, speculation_max_batch=None)
