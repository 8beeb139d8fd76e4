"""`PagePool`: the physical pages of the KV cache, as ids with refcounts.

Glossary: a *page* holds the KV of `page_size` consecutive tokens of one
sequence in every layer of a layer group. "Block" is the old name of the same
thing (`block_size` is a deprecated alias of `page_size`); this package says
page everywhere.

The pool knows nothing about requests. A page is free exactly when its
refcount is 0; a refcount above 1 means the page is shared (prefix sharing).
"""

from __future__ import annotations

from collections import deque

from ..invariants import InvariantError


class PagePool:
    """Free list and refcounts of `num_pages` pages.

    Allocation is check-then-commit: `allocate(n)` returns `None` when fewer than
    `n` pages are free and changes nothing in that case.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise InvariantError(f"{num_pages=}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refcounts = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page_id: int) -> int:
        return self._refcounts[page_id]

    def allocate(self, num: int) -> list[int] | None:
        """Take `num` free pages (refcount 1 each), lowest-recently-freed first, or `None`."""
        if num < 0:
            raise InvariantError(f"{num=}")
        if num > len(self._free):
            return None
        page_ids = [self._free.popleft() for _ in range(num)]
        for page_id in page_ids:
            self._refcounts[page_id] = 1
        return page_ids

    def share(self, page_ids: list[int]) -> None:
        """Add one reference to pages that are already in use."""
        for page_id in page_ids:
            if self._refcounts[page_id] <= 0:
                raise InvariantError(f"sharing free page {page_id}")
            self._refcounts[page_id] += 1

    def release(self, page_ids: list[int]) -> None:
        """Drop one reference to each page; pages reaching 0 go back to the free list."""
        for page_id in page_ids:
            if self._refcounts[page_id] <= 0:
                raise InvariantError(f"double free of page {page_id}")
            self._refcounts[page_id] -= 1
            if self._refcounts[page_id] == 0:
                self._free.append(page_id)

    def check_integrity(self, page_tables: list[list[int]] | None = None) -> None:
        """Raise `InvariantError` (an `AssertionError`) if the pool's invariants do not hold.

        Checks that free and used pages partition the pool, that refcounts are
        >= 0 and 0 exactly for free pages, and, given the page tables of every
        live request, that each page's refcount equals the number of tables
        holding it (so no page is in two tables unless shared and refcounted).
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise InvariantError("a page is twice in the free list")
        if not all(0 <= p < self.num_pages for p in free):
            raise InvariantError("free list holds an unknown page id")
        for page_id, count in enumerate(self._refcounts):
            if count < 0:
                raise InvariantError(f"page {page_id} has refcount {count}")
            if (count == 0) != (page_id in free):
                raise InvariantError(f"page {page_id}: refcount {count}, free={page_id in free}")
        if page_tables is None:
            return
        holders = [0] * self.num_pages
        for table in page_tables:
            if len(set(table)) != len(table):
                raise InvariantError(f"a page table repeats a page: {table}")
            for page_id in table:
                holders[page_id] += 1
        for page_id, count in enumerate(self._refcounts):
            if holders[page_id] != count:
                raise InvariantError(
                    f"page {page_id}: refcount {count} but held by {holders[page_id]} tables"
                )
