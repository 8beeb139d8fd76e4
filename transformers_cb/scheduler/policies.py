"""Scheduling policies: the order in which the step's candidates get its token budget.

A policy only orders; admission, chunking and preemption stay the scheduler's (scheduler.py), which
admits behind `AdmissionGate` (FIFO: no overtaking within a schedule).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..requests import Request, RequestStatus


class SchedulingPolicy:
    """FIFO: requests already running first (in admission order), then waiting ones."""

    name = "fifo"

    def candidates(self, running: list[Request], waiting: Iterable[Request]) -> Iterator[Request]:
        yield from list(running)
        yield from list(waiting)


class PrefillFirstPolicy(SchedulingPolicy):
    """Prefill chunks first (running, then newly admitted), decodes get what is left."""

    name = "prefill_first"

    def candidates(self, running: list[Request], waiting: Iterable[Request]) -> Iterator[Request]:
        decoding = [r for r in running if r.status == RequestStatus.DECODING]
        yield from [r for r in running if r.status != RequestStatus.DECODING]
        yield from list(waiting)
        yield from decoding


POLICIES: dict[str, type[SchedulingPolicy]] = {"fifo": SchedulingPolicy, "prefill_first": PrefillFirstPolicy}


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
