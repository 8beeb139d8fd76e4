"""`FollowerEngine`: a tensor-parallel rank other than 0, which replays rank 0's steps.

Rank 0 is a plain `Engine` whose publisher sends every step's plan and outcome (publisher.py); a
follower decides nothing: its scheduler stays empty, its requests are mirrors kept by its coordinator
(distributed/coordinator.py), and each of its steps applies rank 0's next message and runs the same
forward over the same pages of its own KV shard, so the model's collectives line up. See
docs/parallelism.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..requests import Request
from .engine import WARMUP_PROMPT_TOKENS, Engine
from .parts import EngineParts, StepResult
from .snapshot import EngineCounters

if TYPE_CHECKING:
    from ..distributed import TensorParallelCoordinator
    from .settings import EngineSettings


class FollowerEngine(Engine):
    """Args: settings, parts: as `Engine`'s (the same settings as rank 0's: sizes are agreed at start);
    tp: this rank's coordinator (not the driver)."""

    def __init__(self, settings: EngineSettings, parts: EngineParts, tp: TensorParallelCoordinator) -> None:
        super().__init__(settings, parts)
        self.tp = tp

    @property
    def is_follower(self) -> bool:
        return True

    @property
    def rank(self) -> int:
        return self.tp.rank

    def add(self, request: Request) -> None:
        """A follower's own submission (`generate_batch` runs on every rank with the same inputs): its
        mirror, checked against rank 0's when that one arrives."""
        for member in request.family:
            self.tp.add(member)

    def has_work(self) -> bool:
        return not self.tp.run_ended  # until rank 0 says its run drained

    def step(self) -> StepResult:
        """Apply rank 0's next message and run the same forward (sampling is rank 0's)."""
        message, batch, finished, progressed = self.tp.receive()
        self.counters.steps += bool(batch.entries)
        try:
            self.runner.forward(batch)  # rank 0's plan (copies, swaps, released rows), then its forward
        except Exception as error:
            raise self.tp.fatal(error) from error
        self.counters.generated_tokens += len(message.tokens)
        return StepResult(finished=finished, progressed=progressed, num_tokens=batch.num_tokens)

    def warmup(self, num_prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> bool:
        """Replay rank 0's warmup until its end of run (`num_prompt_tokens` is rank 0's to choose)."""
        self.tp.run_ended = False
        steps = self.counters.steps
        while not self.tp.run_ended:
            self.step()
        self.warmed_up = self.counters.steps > steps
        self.counters = EngineCounters()
        return self.warmed_up

    def replay_session(self) -> None:
        """A manager session on this rank: replay rank 0's steps until its manager stops."""
        self.tp.stopped = False
        while not self.tp.stopped:
            self.step()
