"""Which requests a block of code preempted, by id: for tests that must know *which* request was evicted
(the engine itself counts preemptions: `Engine.snapshot().preemptions`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers_cb.scheduler.scheduler import Scheduler


@contextmanager
def count_preemptions() -> Iterator[list[str]]:
    """Records the request id of every preemption (`Scheduler.preempt` call) inside the block."""
    calls: list[str] = []
    original = Scheduler.preempt

    def preempt(self, request, batch):
        calls.append(request.request_id)
        return original(self, request, batch)

    Scheduler.preempt = preempt
    try:
        yield calls
    finally:
        Scheduler.preempt = original
