"""`PagePool`: the physical pages of the KV cache, as ids with refcounts and a prefix cache.

Glossary: a *page* holds the KV of `page_size` consecutive tokens of one
sequence in every layer of a layer group. "Block" is the old name of the same
thing (`block_size` is a deprecated alias of `page_size`); this package says
page everywhere.

The pool knows nothing about requests. A page's refcount counts the page lists
holding it; above 1 the page is shared (prefix sharing, forks) and read-only.
A page with refcount 0 is in exactly one of two free lists:

- *free*: holds nothing anyone can reuse;
- *cached*: a full page whose content key (`page_keys.page_key`) is
  registered, kept in least-recently-released order so that a later request
  with the same prefix can take it back (`acquire`) instead of recomputing it;
  or a page with only *partial* keys (its first tokens' content, `register_partial`),
  whose first rows a later request copies (`PrefixCache.attach`).

A page being copied from this step is *pinned* (`pin` / `unpin`): an idle pinned page sits in
neither list, so no allocation takes it before the copy has run.

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
        # Partial keys: the content of a page's first tokens (parent key, token ids) -> the page, and the
        # keys each page holds.
        self._partial: dict[bytes, tuple[int, bytes, tuple[int, ...]]] = {}
        self._partials_of: dict[int, list[bytes]] = {}
        # Idle pages pinned for a copy (refcount 0, in neither free list), and every page's pin count.
        self._pins: dict[int, int] = {}
        self._pinned_idle: set[int] = set()
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
            self._forget_partials(page_id)  # a free page's partial keys went with it; a cached one's too
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
                self._idle(page_id)

    def _idle(self, page_id: int) -> None:
        """A page nobody holds: pinned (for a copy this step), cached (keyed), or free."""
        if self._pins.get(page_id):
            self._pinned_idle.add(page_id)
        elif page_id in self._key_of or page_id in self._partials_of:
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
            if page_id in self._pinned_idle:
                self._pinned_idle.discard(page_id)
            else:
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

    def register_partial(self, page_id: int, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """Record that in-use page `page_id` holds, in its first `len(tokens)` rows, the tokens with partial
        key `key` (`page_keys.partial_key`). False when another page holds the key already."""
        if self._refcounts[page_id] <= 0:
            raise InvariantError(f"registering free page {page_id}")
        if key in self._partial:
            return False
        self._partial[key] = (page_id, parent, tokens)
        self._partials_of.setdefault(page_id, []).append(key)
        return True

    def lookup_partial(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> int | None:
        """The page whose first rows hold `tokens` under partial key `key`, verified like `lookup`."""
        entry = self._partial.get(key)
        if entry is None or entry[1:] != (parent, tokens):
            return None
        return entry[0]

    def pin(self, page_id: int) -> None:
        """Keep `page_id` (in use, or idle with keys) from being allocated until `unpin`: a copy reads it."""
        if self._refcounts[page_id] == 0:
            if page_id not in self._cached and page_id not in self._pinned_idle:
                raise InvariantError(f"pinning free page {page_id}")
            self._cached.pop(page_id, None)
            self._pinned_idle.add(page_id)
        self._pins[page_id] = self._pins.get(page_id, 0) + 1

    def unpin(self, page_id: int) -> None:
        count = self._pins.get(page_id, 0) - 1
        if count < 0:
            raise InvariantError(f"unpinning page {page_id} that is not pinned")
        if count:
            self._pins[page_id] = count
            return
        del self._pins[page_id]
        if page_id in self._pinned_idle:
            self._pinned_idle.discard(page_id)
            self._idle(page_id)

    def clear_cached(self) -> None:
        """Forget every cached page (they become free); pages in use keep their keys."""
        while self._cached:
            page_id, _ = self._cached.popitem(last=False)
            self._forget(page_id)
            self._forget_partials(page_id)
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
        self._partial.clear()
        self._partials_of.clear()
        return dropped

    def _forget(self, page_id: int) -> None:
        key = self._key_of.pop(page_id, None)
        if key is not None:
            del self._page_of[key]
            del self._content[page_id]

    def _forget_partials(self, page_id: int) -> None:
        for key in self._partials_of.pop(page_id, ()):
            del self._partial[key]

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
        cached, pinned = set(self._cached), self._pinned_idle
        if free & cached:
            raise InvariantError(f"pages both free and cached: {sorted(free & cached)}")
        if (free | cached) & pinned:
            raise InvariantError(f"pinned pages also free or cached: {sorted((free | cached) & pinned)}")
        if not all(0 <= p < self.num_pages for p in free | cached | pinned):
            raise InvariantError("a free list holds an unknown page id")
        for page_id, count in enumerate(self._refcounts):
            if count < 0:
                raise InvariantError(f"page {page_id} has refcount {count}")
            idle = page_id in free or page_id in cached or page_id in pinned
            if (count == 0) != idle:
                raise InvariantError(f"page {page_id}: refcount {count}, free={page_id in free}")
        if not pinned <= set(self._pins):
            raise InvariantError("an idle page is pinned without a pin count")
        keyed = set(self._key_of) | set(self._partials_of)
        if any(p in keyed for p in free) or not cached <= keyed:
            raise InvariantError("a free page has a key, or a cached page has none")
        if {k for keys in self._partials_of.values() for k in keys} != set(self._partial) or any(
            self._partial[k][0] != p for p, keys in self._partials_of.items() for k in keys
        ):
            raise InvariantError("partial keys and the pages holding them disagree")
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
