"""Tensor parallelism in one process: two coordinators (rank 0, rank 1) joined by an in-memory channel that
stands for the gloo CPU group, so that rank 0's engine and a follower engine can be driven side by side
(in one thread, or the follower in a manager thread). Rank 0's messages are pickled, as over gloo."""

from __future__ import annotations

import pickle
import queue
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.distributed import TensorParallelCoordinator, TensorParallelError
from transformers_cb.distributed.coordinator import Kind, StepMessage
from transformers_cb.engine.build import wire
from transformers_cb.engine.engine import Engine
from transformers_cb.engine.settings import resolve_settings


class ChannelGroup:
    """The CPU group of one rank: rank 0's exchanges go into the channel, rank 1's come out of it (waiting
    up to the tests' timeout, as a collective waits for `cpu_group_timeout`)."""

    def __init__(self, rank: int, channel: queue.Queue) -> None:
        self.rank = rank
        self.channel = channel
        self.broken: str | None = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def exchange(self, message: Any = None) -> Any:
        if self.rank == 0:
            self.channel.put(pickle.dumps(message))
            return message
        try:
            return pickle.loads(self.channel.get(timeout=TIMEOUT))
        except queue.Empty as error:
            raise self.fail("waiting for rank 0's message", error) from error

    def fail(self, what: str, error: BaseException) -> TensorParallelError:
        self.broken = f"{what}: {type(error).__name__}: {error}"
        return TensorParallelError(self.broken)


def coordinator(rank: int, channel: queue.Queue) -> TensorParallelCoordinator:
    """A coordinator of `rank` on the channel: what `TensorParallelCoordinator.__init__` sets up, on a
    `ChannelGroup` instead of a process group."""
    tp = TensorParallelCoordinator.__new__(TensorParallelCoordinator)
    tp.tp_size, tp.cpu = 2, ChannelGroup(rank, channel)
    tp.is_driver, tp.rank = tp.cpu.is_root, rank
    tp._pending, tp._known = StepMessage(Kind.STEP), set()
    tp.requests, tp.run_ended, tp.stopped = {}, True, False
    return tp


def engine_pair(
    model: PreTrainedModel, generation_config: GenerationConfig, config: ContinuousBatchingConfig
) -> tuple[Engine, Engine, queue.Queue]:
    """Rank 0's engine and rank 1's (a `FollowerEngine`) from one `EngineSettings`, on one model, and their channel."""
    settings, _ = resolve_settings(model, generation_config, config)
    channel: queue.Queue = queue.Queue()
    driver, follower = (wire(model, settings, coordinator(rank, channel)) for rank in (0, 1))
    return driver, follower, channel
