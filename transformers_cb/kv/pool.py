"""`PagePool`: the physical pages of the KV cache, as ids with refcounts and a prefix cache.

Glossary: a *page* holds the KV of `page_size` consecutive tokens of one
sequence in every layer of a layer group. "Block" is the old name of the same
thing (`block_size` is a deprecated alias of `page_size`); this package says
page everywhere.

The pool knows nothing about requests. A page's refcount counts the page lists
holding it; above 1 the page is shared (prefix sharing, forks) and read-only.
A page with refcount 0 is in exactly one of two free lists:

- *free*: holds nothing anyone can reuse;
- *cached*: a full page whose content key (`prefix_cache.page_key`) is
  registered, kept in least-recently-released order so that a later request
  with the same prefix can take it back (`acquire`) instead of recomputing it.

Allocation takes free pages first, then evicts the least recently used cached
ones (their keys are forgotten). Both lists count as available pages.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from ..invariants import InvariantError


class PagePool:
    """Free lists, refcounts and content keys of `num_pages` pages.

    Allocation is check-then-commit: `allocate(n)` returns `None` when fewer than
    `n` pages are available and changes nothing in that case.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise InvariantError(f"{num_pages=}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount-0 keyed pages, oldest first
        self._refcounts = [0] * num_pages
        # Content keys of full pages, and what a hit is verified against (parent key, token ids).
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._content: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self.num_evictions = 0

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages kept only for later prefix hits (refcount 0, evictable)."""
        return len(self._cached)

    @property
    def num_keyed_pages(self) -> int:
        """Pages with a registered content key, in use or cached."""
        return len(self._key_of)

    def refcount(self, page_id: int) -> int:
        return self._refcounts[page_id]

    def key_of(self, page_id: int) -> bytes | None:
        return self._key_of.get(page_id)

    def allocate(self, num: int) -> list[int] | None:
        """Take `num` pages (refcount 1 each): free ones first, then the least recently used cached
        ones, whose keys are dropped. `None` (nothing changed) when fewer are available."""
        if num < 0:
            raise InvariantError(f"{num=}")
        if num > self.num_free_pages:
            return None
        page_ids = []
        for _ in range(num):
            if self._free:
                page_id = self._free.popleft()
            else:
                page_id, _ = self._cached.popitem(last=False)
                self._forget(page_id)
                self.num_evictions += 1
            self._refcounts[page_id] = 1
            page_ids.append(page_id)
        return page_ids

    def share(self, page_ids: list[int]) -> None:
        """Add one reference to pages that are already in use."""
        for page_id in page_ids:
            if self._refcounts[page_id] <= 0:
                raise InvariantError(f"sharing free page {page_id}")
            self._refcounts[page_id] += 1

    def release(self, page_ids: list[int]) -> None:
        """Drop one reference to each page; at 0 a keyed page is cached (most recent last), others freed."""
        for page_id in page_ids:
            if self._refcounts[page_id] <= 0:
                raise InvariantError(f"double free of page {page_id}")
            self._refcounts[page_id] -= 1
            if self._refcounts[page_id] == 0:
                if page_id in self._key_of:
                    self._cached[page_id] = None
                else:
                    self._free.append(page_id)

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> int | None:
        """The page registered under `key`, if its recorded parent key and tokens match (a digest
        collision, however unlikely, then reads as a miss). Changes nothing."""
        page_id = self._page_of.get(key)
        if page_id is None or self._content[page_id] != (parent, tokens):
            return None
        return page_id

    def acquire(self, page_id: int) -> None:
        """Take one reference to a keyed page found by `lookup`, in use or cached."""
        if page_id not in self._key_of:
            raise InvariantError(f"acquiring unkeyed page {page_id}")
        if self._refcounts[page_id] == 0:
            del self._cached[page_id]
        self._refcounts[page_id] += 1

    def register(self, page_id: int, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """Record that in-use page `page_id` holds the full page with content `key`. False when
        the key is already held by another page (that copy stays the cached one) or the page
        already has a key."""
        if self._refcounts[page_id] <= 0:
            raise InvariantError(f"registering free page {page_id}")
        if key in self._page_of or page_id in self._key_of:
            return False
        self._key_of[page_id] = key
        self._page_of[key] = page_id
        self._content[page_id] = (parent, tokens)
        return True

    def clear_cached(self) -> None:
        """Forget every cached page (they become free); pages in use keep their keys."""
        while self._cached:
            page_id, _ = self._cached.popitem(last=False)
            self._forget(page_id)
            self._free.append(page_id)

    def forget_keys(self) -> int:
        """Forget every key (the weights changed: no page's KV is what its key promises any more): cached
        pages become free, pages in use lose their key (freed, not cached, when released). Returns how
        many keys were dropped."""
        dropped = len(self._key_of)
        self.clear_cached()
        self._key_of.clear()
        self._page_of.clear()
        self._content.clear()
        return dropped

    def _forget(self, page_id: int) -> None:
        key = self._key_of.pop(page_id)
        del self._page_of[key]
        del self._content[page_id]

    # -- checks ----------------------------------------------------------------------------------
    def check_integrity(self, page_tables: list[list[int]] | None = None) -> None:
        """Raise `InvariantError` (an `AssertionError`) if the pool's invariants do not hold.

        Checks that free, cached and used pages partition the pool, that refcounts are >= 0 and
        0 exactly for free and cached pages, that cached pages (and no free page) have keys and
        that keys and pages map one to one, and, given the page tables of every live request,
        that each page's refcount equals the number of tables holding it.
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise InvariantError("a page is twice in the free list")
        cached = set(self._cached)
        if free & cached:
            raise InvariantError(f"pages both free and cached: {sorted(free & cached)}")
        if not all(0 <= p < self.num_pages for p in free | cached):
            raise InvariantError("a free list holds an unknown page id")
        for page_id, count in enumerate(self._refcounts):
            if count < 0:
                raise InvariantError(f"page {page_id} has refcount {count}")
            idle = page_id in free or page_id in cached
            if (count == 0) != idle:
                raise InvariantError(f"page {page_id}: refcount {count}, free={page_id in free}")
        if any(p in self._key_of for p in free) or not cached <= set(self._key_of):
            raise InvariantError("a free page has a key, or a cached page has none")
        if len(self._page_of) != len(self._key_of) or any(
            self._page_of.get(key) != page_id for page_id, key in self._key_of.items()
        ):
            raise InvariantError("page keys and keyed pages do not map one to one")
        if set(self._content) != set(self._key_of):
            raise InvariantError("a keyed page lacks its recorded content, or the reverse")
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
