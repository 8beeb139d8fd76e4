"""The scheduler's state as its halves see it: `SchedulerState` declares what `Scheduler` (scheduler.py)
sets in its `__init__` and the few of its methods the halves call, so that admission (admission.py) and
applying a step's results (step_results.py) type-check in modules of their own."""

from __future__ import annotations

from collections import deque

from ..kv.offload import CpuOffload
from ..kv.page_manager import PageManager
from ..requests import Request, RequestStatus
from .forks import Forks
from .media_budget import MediaBudget
from .plan import StepPlan, TakeBack
from .recompute import RecomputeCounter
from .speculation_stats import SpeculationStats


class SchedulerState:
    pages: PageManager
    media: MediaBudget | None
    offload: CpuOffload | None
    forks: Forks
    running: list[Request]
    waiting: deque[Request]
    safety_margin: float
    recomputed: RecomputeCounter
    speculation: SpeculationStats
    taken_back: list[TakeBack]
    weight_version: int

    # Defined by `Scheduler`.
    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        raise NotImplementedError

    def _wanted(self, request: Request, budget: int) -> int:
        raise NotImplementedError

    def _allocate(self, request: Request, num_tokens: int) -> None:
        raise NotImplementedError

    def _fail_unfittable(self, request: Request, plan: StepPlan) -> None:
        raise NotImplementedError

    def _drop_kv(self, request: Request) -> None:
        raise NotImplementedError

    def _free_pages(self, request: Request) -> None:
        raise NotImplementedError

    def _stopped(self, request: Request) -> None:
        raise NotImplementedError
