"""Which requests a block of code preempted, by id: for tests that must know *which* request was evicted
(the engine itself counts preemptions: `Engine.snapshot().preemptions`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers_cb.scheduler.queues import RequestQueues


@contextmanager
def count_preemptions() -> Iterator[list[str]]:
    """Records the request id of every preemption (`RequestQueues.preempt` call: the scheduler's queues) inside the block."""
    calls: list[str] = []
    original = RequestQueues.preempt

    def preempt(self, request, batch):
        calls.append(request.request_id)
        return original(self, request, batch)

    RequestQueues.preempt = preempt
    try:
        yield calls
    finally:
        RequestQueues.preempt = original
