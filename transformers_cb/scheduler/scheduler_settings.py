"""`SchedulerSettings`: the scheduler's settings of one engine, resolved once at start (part of the
`EngineSettings`, engine/settings.py); the step sizes it schedules within are the agreed `Sizing`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.continuous_batching import ContinuousBatchingConfig


@dataclass(frozen=True)
class SchedulerSettings:
    """`scheduler_type`: the candidate ordering (policies.py); `safety_margin`: the share of pages kept
    free at admission; `max_queue_size`: requests waiting at most (0: unbounded); `speculation_max_batch`:
    the most running requests a step speculates with (None: no limit)."""

    scheduler_type: str
    safety_margin: float
    max_queue_size: int
    speculation_max_batch: int | None


def resolve_scheduler_settings(
    config: ContinuousBatchingConfig, speculation_max_batch: int | None
) -> SchedulerSettings:
    """The scheduler's settings from `config`; `speculation_max_batch` as the config resolves it for the
    device (`config.continuous_batching.resolve_speculation_max_batch`)."""
    return SchedulerSettings(
        scheduler_type=config.scheduler_type,
        safety_margin=config.resolved_safety_margin,
        max_queue_size=config.max_queue_size,
        speculation_max_batch=speculation_max_batch,
    )
