"""What rank 0 tells the other tensor-parallel ranks about each step, behind one small interface.

`Engine.step()` calls the same hooks in every setting, so the step has no tensor-parallel branch:
`StepPublisher` (a single process, or a follower: nobody to tell) does nothing, and
`TensorParallelPublisher` (rank 0 of a tensor-parallel group) sends each step's plan, its sampled
tokens and the requests that ended to the other ranks through the coordinator
(distributed/coordinator.py).

Why a strategy object and not a rank-0 subclass of the engine: rank 0 runs exactly the single-process
step, plus these messages, so the messages are all that differs and a subclass would have to copy the
step to slot them in. The follower (follower.py) is a subclass, because its step is another algorithm:
it replays rank 0's plan and decides nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..distributed.coordinator import Kind

if TYPE_CHECKING:
    from ..distributed import TensorParallelCoordinator
    from ..requests import Request
    from ..sampling.sampled_token import SampledToken
    from ..scheduler.step_plan import StepPlan


class StepPublisher:
    """Nobody to tell: every hook is a no-op (a single process, or a tensor-parallel follower)."""

    def step_planned(self, batch: StepPlan) -> None:
        """The scheduler decided this step (before it runs)."""

    def step_failed(self, error: Exception) -> None:
        """The step's forward raised. Returning lets the engine fail only the step's requests."""

    def tokens_sampled(self, requests: list[Request], tokens: list[list[SampledToken]]) -> None:
        """`requests[i]` got `tokens[i]` this step (the runner's `StepOutput.sampled`)."""

    def requests_finished(self, requests: list[Request]) -> None:
        """`requests` ended (any final status), in a step or through `Engine.finish`."""

    def step_ended(self, finished: list[Request], has_work: Callable[[], bool]) -> None:
        """The step is over: `finished` ended in it; `has_work()` tells whether the run goes on."""

    def idle(self) -> None:
        """A manager loop with nothing to run (or paused) ticked."""

    def run_ended(self) -> None:
        """A run ended without a step that drained it (a warmup that did not run)."""

    def session_ended(self) -> None:
        """The manager's session (its thread) ended."""


class TensorParallelPublisher(StepPublisher):
    """Rank 0 of a tensor-parallel group: what happened reaches the followers in the next message.

    Args: tp: rank 0's coordinator (`tp.is_driver`)."""

    def __init__(self, tp: TensorParallelCoordinator) -> None:
        self.tp = tp

    def step_planned(self, batch: StepPlan) -> None:
        self.tp.publish(batch)

    def step_failed(self, error: Exception) -> None:
        # The ranks ran the same forward; one failed, so they cannot be known to agree any more.
        raise self.tp.fatal(error) from error

    def tokens_sampled(self, requests: list[Request], tokens: list[list[SampledToken]]) -> None:
        self.tp.record_tokens(requests, tokens)

    def requests_finished(self, requests: list[Request]) -> None:
        self.tp.record_finished(requests)

    def step_ended(self, finished: list[Request], has_work: Callable[[], bool]) -> None:
        self.tp.record_finished(finished)
        if not has_work():
            self.tp.send(Kind.END)  # the followers' `has_work()` turns False with rank 0's

    def idle(self) -> None:
        self.tp.send(Kind.IDLE)  # the followers wait in a collective bounded by a timeout

    def run_ended(self) -> None:
        self.tp.send(Kind.END)

    def session_ended(self) -> None:
        self.tp.try_stop()  # the followers' sessions end with this one (skipped if the group broke)
