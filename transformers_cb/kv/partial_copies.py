"""The copies of partial-page hits (kv/prefix_cache.py) from admission until the plan carrying them has run.

A request whose next page starts with a cached page's first tokens gets a page of its own holding a copy of
that page (`PageCopy`, run before the next forward). The source page is pinned in its pool (`PagePool.pin`)
from the hit, so that no allocation hands it to another request before the copy has read it, until the step
running the plan ends (`ran`: `Scheduler.plan_ran`, however the step ends): an idle engine holds no page for a
copy.
"""

from __future__ import annotations

from .page_keys import PageCopy
from .pool import PagePool


class PartialCopies:
    """The copies waiting for the next plan (one per request) and the sources of those handed out last."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._waiting: dict[str, PageCopy] = {}  # request id -> its partial hit's copy, for the next plan
        self._pinned: list[int] = []  # sources of the copies handed out last, unpinned once their plan ran

    def add(self, request_id: str, copy: PageCopy) -> None:
        """The copy of `request_id`'s hit, its source (`copy[1]`) already pinned by the caller."""
        self._waiting[request_id] = copy

    def drop(self, request_id: str) -> None:
        """The request will not run the copy (not admitted after all, preempted, ended): its source unpinned."""
        copy = self._waiting.pop(request_id, None)
        if copy is not None:
            self.pool.unpin(copy[1])

    def take(self) -> list[PageCopy]:
        """The copies for the next plan; their sources stay pinned until that plan has run (`ran`; here too,
        for a plan that was not followed by it)."""
        self.ran()
        copies = list(self._waiting.values())
        self._waiting.clear()
        self._pinned = [source for _, source, _ in copies]
        return copies

    def ran(self) -> None:
        """The plan carrying the copies handed out last has run: their sources are unpinned."""
        for page_id in self._pinned:
            self.pool.unpin(page_id)
        self._pinned = []
