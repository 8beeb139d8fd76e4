"""Scheduling policies: the order in which the step's candidates get its token budget, and how much of it
prefill may take.

A policy orders candidates and may bound the step's prompt tokens and any one request's chunk
(`prefill_limits`); admission, chunking and preemption stay the scheduler's
(scheduler.py), which admits behind `AdmissionGate` (FIFO: no overtaking within a schedule).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..requests import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class PrefillLimits:
    """How much prompt one step may run: `budget` tokens in all (decode tokens are not counted), `chunk`
    tokens at most for any one request."""

    budget: int
    chunk: int


class SchedulingPolicy:
    """FIFO: requests already running first (in admission order), then waiting ones; prefill may take the
    whole step."""

    name = "fifo"

    def candidates(self, running: list[Request], waiting: Iterable[Request]) -> Iterator[Request]:
        yield from list(running)
        yield from list(waiting)

    def prefill_limits(
        self, max_batch_tokens: int, running: list[Request], waiting: Iterable[Request]
    ) -> PrefillLimits:
        """This step's bounds on prompt tokens (called once per `Scheduler.schedule`)."""
        return PrefillLimits(max_batch_tokens, max_batch_tokens)


class PrefillFirstPolicy(SchedulingPolicy):
    """Prefill chunks first (running, then newly admitted), decodes get what is left."""

    name = "prefill_first"

    def candidates(self, running: list[Request], waiting: Iterable[Request]) -> Iterator[Request]:
        decoding = [r for r in running if r.status == RequestStatus.DECODING]
        yield from [r for r in running if r.status != RequestStatus.DECODING]
        yield from list(waiting)
        yield from decoding


class DecodeFirstPolicy(SchedulingPolicy):
    """For a server under bursts: decodes first, then prompts (the tails of those already started, then the
    waiting ones in order) within a prefill budget that grows with the queue, each chunk at most half of it.

    Why (measured on the real model, docs/benchmarks.md, "The server under a burst"): a step costs a fixed
    part (reading the weights) plus a part per token. A burst prefilled in one step gives every request its
    first token when the whole step ends; prefilled in `SPLIT` steps, the first requests get theirs after a
    `SPLIT`th of it, and the median request after about half, for `SPLIT - 1` more fixed parts. So the budget
    is a `SPLIT`th of the most prompt tokens queued since the queue was last empty (never below
    `MIN_PREFILL_BUDGET`, so that a few short prompts run whole; never above the step), and a request alone in
    the queue runs whole (nothing waits behind it). Decodes come first so that running streams keep their
    pace while a burst is prefilled. A chunk takes at most half of the budget, so that a long prompt's tail
    never holds the short prompts behind it back for a whole step: they get the other half. Started prompts
    go before waiting ones, as in `fifo`, so that they keep the pages they need (admitting first would let
    new arrivals take the pages a started prompt needs, preempting it again and again).
    """

    name = "decode_first"
    SPLIT = 6
    MIN_PREFILL_BUDGET = 256

    def __init__(self) -> None:
        # The largest share of the queue seen since it was last empty: the budget grows with the queue and
        # keeps its size while the queue drains, so a burst takes `SPLIT` steps (a share of what is left
        # would shrink step by step, and a large burst would take many more).
        self._share = 0

    def candidates(self, running: list[Request], waiting: Iterable[Request]) -> Iterator[Request]:
        yield from [r for r in running if r.status == RequestStatus.DECODING]
        yield from [r for r in running if r.status != RequestStatus.DECODING]
        yield from list(waiting)

    def prefill_limits(
        self, max_batch_tokens: int, running: list[Request], waiting: Iterable[Request]
    ) -> PrefillLimits:
        queued = [r for r in running if r.status != RequestStatus.DECODING] + list(waiting)
        if len(queued) <= 1:
            self._share = 0
            return PrefillLimits(max_batch_tokens, max_batch_tokens)
        tokens = sum(r.num_remaining_tokens for r in queued)
        self._share = max(self._share, -(-tokens // self.SPLIT))
        budget = min(max_batch_tokens, max(self.MIN_PREFILL_BUDGET, self._share))
        return PrefillLimits(budget, max(1, budget // 2))


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fifo": SchedulingPolicy,
    "prefill_first": PrefillFirstPolicy,
    "decode_first": DecodeFirstPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduler_type {name!r}: supported {sorted(POLICIES)}")
    return POLICIES[name]()


@dataclass(slots=True)
class AdmissionGate:
    """FIFO admission within one `schedule()`: once a waiting request cannot start, those behind it
    wait too (no overtaking). Closed by a request that must wait; opened again only after one that
    can never fit has failed."""

    is_open: bool = True

    def open(self) -> None:
        self.is_open = True

    def close(self) -> None:
        self.is_open = False
