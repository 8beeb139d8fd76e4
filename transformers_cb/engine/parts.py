"""What an engine is made of and what its step returns: `EngineParts` (the parts `build.py` wires from an
`EngineSettings`, each built once) and `StepResult` (one step's outcome for the loop around it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedModel

from ..kv.offload import CpuOffload
from ..kv.page_manager import PageManager
from ..memory.kv_cache import PagedKVCache
from ..requests import Request
from ..runner.drafter import Drafter
from ..runner.model_runner import ModelRunner
from ..runner.packing import BatchPacker
from ..sampling.request_state import SamplingSetup
from ..scheduler.scheduler import Scheduler
from ..scheduler.speculation.shadow_planner import ShadowPlanner
from .intake.submission import RequestBuilder
from .publisher import StepPublisher
from .speculation.draft_setup import EngineSpeculation


@dataclass
class StepResult:
    finished: list[Request] = field(default_factory=list)  # ended this step (any final status)
    progressed: list[Request] = field(default_factory=list)  # got a new token this step, still running
    num_tokens: int = 0


@dataclass
class EngineParts:
    """What `build.py` wires from an `EngineSettings`, each part built once.

    `pages` is the device tier's page manager (the page pools and their policies, kv/), which the
    scheduler plans with; `offload` the host tier's planner (None: no CPU offload); `publisher` what
    rank 0 tells the other tensor-parallel ranks (a no-op otherwise); `drafter` the draft model as a
    draft source: the planner of its shadows on its own pages (scheduler/speculation/shadow_planner.py) over the
    drafter running its forwards (runner/drafter.py; None: no `assistant_model`); `speculation` whether
    the engine can speculate, every request's defaults and the draft sources; `build_request` a submission
    made a `Request` (submission.py)."""

    model: PreTrainedModel
    pages: PageManager
    scheduler: Scheduler
    cache: PagedKVCache
    packer: BatchPacker
    runner: ModelRunner
    sampling: SamplingSetup
    speculation: EngineSpeculation
    build_request: RequestBuilder
    offload: CpuOffload | None = None
    publisher: StepPublisher = field(default_factory=StepPublisher)
    drafter: ShadowPlanner[Drafter] | None = None
