"""Where a speculating request's drafts come from (torch-free): the `DraftSource` protocol and `Drafts`, the
data a step's drafts travel as. Its own module so that the request's state (back_off.py) can name its source
and the sources (prompt_lookup.py, shadow_planner.py) can read that state without a cycle between them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ...requests import Request

# Request id -> the draft tokens proposed for it this step.
Drafts = dict[str, list[int]]


class DraftSource(Protocol):
    """Where a speculating request's drafts come from (its `SpeculationState.source`)."""

    def propose(self, requests: Sequence[Request]) -> Drafts:
        """Drafts for the requests of `requests` this source serves and that may draft now
        (`back_off.draft_room`); a request left out drafts nothing this step."""
        ...

    def after_verify(self, request: Request, drafted: int, accepted: int) -> None:
        """`request` verified `drafted` draft tokens of this source and accepted `accepted` of them."""
        ...

    def stopped(self, request: Request) -> None:
        """`request` stopped running (ended, failed, cancelled, preempted: `Scheduler.ended`): what this
        source holds for it goes (the draft model's shadow and its pages)."""
        ...
