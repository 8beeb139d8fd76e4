"""`RecomputeCounter`: the tokens preemption made the scheduler run a second time; `drop_kv`: a request's KV
dropped (it runs prompt + generated tokens again), counted."""

from __future__ import annotations

from ..requests import Request


class RecomputeCounter:
    """Tokens a preempted request runs again because its KV was dropped (recompute, not CPU offload).

    Counted when they run, so that pages a returning request finds in the prefix cache do not count.
    """

    def __init__(self) -> None:
        self.total = 0
        self.pending: dict[str, int] = {}  # request id -> end of what it had computed when last dropped

    def dropped(self, request_id: str, num_computed_tokens: int) -> None:
        until = max(num_computed_tokens, self.pending.get(request_id, 0))
        if until:
            self.pending[request_id] = until

    def ran(self, request_id: str, start: int, end: int) -> None:
        """The request computed tokens [start, end) in a step."""
        until = self.pending.get(request_id)
        if until is None:
            return
        self.total += max(0, min(end, until) - start)
        if end >= until:
            del self.pending[request_id]

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)


def drop_kv(request: Request, counter: RecomputeCounter) -> None:
    """`request` loses its KV: it computes prompt + generated tokens again from its next admission."""
    counter.dropped(request.request_id, request.num_computed_tokens)
    request.num_computed_tokens = 0
