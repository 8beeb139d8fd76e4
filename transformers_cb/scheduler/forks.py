"""Forks: when a request's siblings (`num_return_sequences`) join the running list, and what they copy.

A request's siblings ride with it (`fork_children`) until its prompt is computed, then continue from
its last prompt token, each sampling its own tokens. Two ways, one per kind of model:

- prefix sharing on: right after the parent computed its whole prompt, each sibling shares its full
  pages and copies the one holding the last prompt token (`PageManager.fork`); the sibling runs that
  token again, from the same K/V;
- a model with state layers (no sharing: a state is not in the pages): the parent's prefill stops
  before its last prompt token; then each sibling gets copies of its pages and of its state slot
  (`PageManager.copy_for_fork`: the slot's copy is one of the slot group), so that every sibling runs
  that token from the same state.

Otherwise (no sharing, or a one-token prompt of a state model) the siblings queue as requests of their
own. A sibling that finds no page (or slot) for its copies queues on its own too.
"""

from __future__ import annotations

from collections import deque

from ..kv.page_keys import PageCopy
from ..kv.page_manager import PageManager
from ..requests import Request, RequestStatus


class Forks:
    """Plans forks and keeps their copies until the next step's plan (`take`)."""

    def __init__(self, pages: PageManager) -> None:
        self.pages = pages
        self._copies: list[PageCopy] = []

    def rides_along(self, request: Request) -> bool:
        """Whether `request`'s siblings wait for it (else they queue as requests of their own)."""
        if self.pages.slots is not None:
            return request.num_prompt_tokens >= 2
        return self.pages.sharing

    def fork_point(self, request: Request) -> int:
        """The computed-token count at which `request`'s siblings fork."""
        last = request.num_prompt_tokens - 1
        return last if self.pages.slots is not None else request.num_prompt_tokens

    def cap(self, request: Request, wanted: int) -> int:
        """`wanted` tokens of `request` this step, stopping at its fork point while it has siblings."""
        if not request.fork_children:
            return wanted
        before = self.fork_point(request) - request.num_computed_tokens
        return min(wanted, before) if before > 0 else wanted

    def fork(self, parent: Request, running: list[Request], waiting: deque[Request]) -> None:
        """`parent` just reached its fork point: its siblings join `running` right after it, with their
        copies planned; those without room go to the front of `waiting`."""
        children, parent.fork_children = parent.fork_children, []
        position = running.index(parent) + 1
        unforked = []
        for child in children:
            copies = self._copy(parent, child)
            if copies is None:
                unforked.append(child)
                continue
            self._copies.extend(copies)
            child.kv_version = parent.kv_version  # it shares (or copies) the parent's KV
            child.set_status(RequestStatus.PREFILLING)
            running.insert(position, child)
            position += 1
        waiting.extendleft(reversed(unforked))

    def _copy(self, parent: Request, child: Request) -> list[PageCopy] | None:
        if self.pages.slots is None:
            return self.pages.fork(parent, child)
        return self.pages.copy_for_fork(parent, child)

    def take(self) -> list[PageCopy]:
        """The copies planned since the last call (the next step's): pages, and state slots in the slot
        group."""
        copies, self._copies = self._copies, []
        return copies
