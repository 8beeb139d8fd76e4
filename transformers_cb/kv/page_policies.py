"""Per-attention-type page policies: which pages a request must hold in one KV layer group.

A page policy maps a request's token positions to pages of its group's `PagePool`
and keeps the request's `PageList` for that group (`request.pages[group]`). The bookkeeping
is shared (`PagePolicy`); each attention type only answers two hooks: which page a step
starting at a token first reads, and how many pages a request must hold at once.
Full attention (`FullAttentionPolicy`) keeps every page: a request with `n` tokens of KV
holds ceil(n / page_size) pages. Sliding windows (`SlidingWindowPolicy`) keep only the
pages of the window, chunked attention (`ChunkedAttentionPolicy`) only those of the current
chunk. `PageManager` (page_manager.py) combines one policy per group into
what the scheduler sees.
"""

from __future__ import annotations

from ..invariants import check
from ..requests import PageList, Request
from .layer_groups import KVGroupSpec
from .pool import PagePool


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagePolicy:
    """The page bookkeeping every attention type shares; subclasses answer the two hooks."""

    sliding_window: int | None = None
    # Whether the pages before some point go back at step boundaries (`trim`): every kind but full
    # attention. A policy that keeps every page is read from page 0 on (prefix sharing relies on it).
    trims: bool = True

    def __init__(self, pool: PagePool, page_size: int, group: int = 0) -> None:
        self.pool = pool
        self.page_size = page_size
        self.group = group

    def pages(self, request: Request) -> PageList:
        return request.group_pages(self.group)

    # -- hooks of a page policy -----------------------------------------------------------------
    def first_needed_page(self, start: int) -> int:
        """First logical page that a step whose queries start at token `start` reads."""
        raise NotImplementedError

    def max_pages(self, num_tokens: int) -> int:
        """Pages a request with `num_tokens` tokens of KV must hold at once to make progress."""
        raise NotImplementedError

    # -- shared bookkeeping ----------------------------------------------------------------------
    def num_new_pages(self, request: Request, num_new_tokens: int) -> int:
        """Pages to add so that `request` can hold KV for `num_new_tokens` more tokens. Pure."""
        needed_end = num_pages_for(request.num_computed_tokens + num_new_tokens, self.page_size)
        return max(0, needed_end - self.pages(request).end_page)

    def num_fitting_tokens(self, request: Request, wanted: int) -> int:
        """How many of `wanted` new tokens fit in the request's pages plus the free pages. Pure."""
        capacity = (self.pages(request).end_page + self.pool.num_free_pages) * self.page_size
        return max(0, min(wanted, capacity - request.num_computed_tokens))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_pages(request, num_new_tokens) <= self.pool.num_free_pages

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's page list for `num_new_tokens` more tokens; False (nothing changed) if full."""
        new_page_ids = self.pool.allocate(self.num_new_pages(request, num_new_tokens))
        if new_page_ids is None:
            return False
        self.pages(request).page_ids.extend(new_page_ids)
        return True

    def trim(self, request: Request, computed: int | None = None) -> int:
        """Return the pages the request's next step no longer reads (none for full attention): the
        step starting at `computed` (None: at the request's computed tokens; a draft model's shadow
        keeps the window of the earliest token its rollback can return to).

        Returns the number of pages released.
        """
        pages = self.pages(request)
        keep_from = self.first_needed_page(request.num_computed_tokens if computed is None else computed)
        if keep_from <= pages.first_page:
            return 0
        num_dropped = min(keep_from - pages.first_page, len(pages.page_ids))
        self.pool.release(pages.page_ids[:num_dropped])
        del pages.page_ids[:num_dropped]
        pages.first_page = keep_from
        return num_dropped

    def release_surplus(self, request: Request) -> int:
        """Return the pages past the request's computed KV (the rejected draft tokens of speculation), so
        that it holds what plain decoding would. Returns how many."""
        pages = self.pages(request)
        keep_end = max(pages.first_page, num_pages_for(request.num_computed_tokens, self.page_size))
        surplus = pages.end_page - keep_end
        if surplus <= 0:
            return 0
        self.pool.release(pages.page_ids[-surplus:])
        del pages.page_ids[-surplus:]
        return surplus

    def free(self, request: Request) -> None:
        """Release every page of `request` in this group (preemption or end)."""
        pages = self.pages(request)
        self.pool.release(pages.page_ids)
        pages.page_ids = []
        pages.first_page = 0

    def check_request(self, request: Request, computed: int | None = None) -> None:
        """Raise `InvariantError` unless the running `request` holds what its KV needs, its window read
        from `computed` (None: the request's computed tokens; as `trim`)."""
        pages = self.pages(request)
        computed = request.num_computed_tokens if computed is None else computed
        check(
            pages.end_page >= num_pages_for(computed, self.page_size),
            f"{request.request_id}: group {self.group} ends at page {pages.end_page}, {computed=}",
        )
        check(
            pages.first_page <= self.first_needed_page(computed),
            f"{request.request_id}: group {self.group} dropped pages still in use ({pages.first_page=})",
        )
        first_needed = self.first_needed_page(computed)
        check(
            not self.trims or not pages.page_ids or pages.first_page >= first_needed,
            f"{request.request_id}: group {self.group} still holds pages before its window or chunk "
            f"({pages.first_page=} < {first_needed})",
        )


class FullAttentionPolicy(PagePolicy):
    """Pages for full-attention layers: one page per `page_size` tokens, never recycled early."""

    trims = False

    def first_needed_page(self, start: int) -> int:
        return 0

    def max_pages(self, num_tokens: int) -> int:
        return num_pages_for(num_tokens, self.page_size)


class SlidingWindowPolicy(PagePolicy):
    """Pages for sliding-window layers: only the pages covering the last `sliding_window` tokens.

    A query at position `q` reads keys `(q - sliding_window, q]`. After each step (`trim`, called
    by the scheduler at the step boundary) the pages wholly before the next query's window go back
    to the pool, so a decoding request holds at most `window_pages()` pages, plus the chunk while
    it prefills.
    """

    sliding_window: int  # never None here

    def __init__(self, pool: PagePool, page_size: int, sliding_window: int, group: int = 0) -> None:
        super().__init__(pool, page_size, group)
        check(sliding_window >= 1, f"{sliding_window=}")
        self.sliding_window = sliding_window

    def first_needed_page(self, start: int) -> int:
        return max(0, start - self.sliding_window + 1) // self.page_size

    def window_pages(self) -> int:
        """Pages a window of `sliding_window` tokens can straddle: the decode-time bound per request."""
        return num_pages_for(self.sliding_window - 1, self.page_size) + 1

    def max_pages(self, num_tokens: int) -> int:
        # Chunks shrink to what fits, so one token at a time is enough to make progress.
        return min(num_pages_for(num_tokens, self.page_size), self.window_pages())


class ChunkedAttentionPolicy(PagePolicy):
    """Pages for chunked-attention layers (Llama 4's `attention_chunk_size`): only the current chunk's.

    A query at position `q` reads keys `[q // C * C, q]` (transformers' `chunked_overlay`): the tokens
    of its own chunk up to itself. At a step boundary (`trim`) the pages wholly before the next query's
    chunk go back to the pool, as a sliding group's before its window: a chunk of `C` tokens straddles
    at most the pages a window of `C` does, so a decoding request holds at most `chunk_pages()`.
    """

    def __init__(self, pool: PagePool, page_size: int, chunk_size: int, group: int = 0) -> None:
        super().__init__(pool, page_size, group)
        check(chunk_size >= 1, f"{chunk_size=}")
        self.chunk_size = chunk_size

    def first_needed_page(self, start: int) -> int:
        return start // self.chunk_size * self.chunk_size // self.page_size

    def chunk_pages(self) -> int:
        """Pages one chunk's first `C` - 1 keys and the query can straddle: the decode-time bound."""
        return num_pages_for(self.chunk_size - 1, self.page_size) + 1

    def max_pages(self, num_tokens: int) -> int:
        # Chunks of a prompt shrink to what fits, so one token at a time is enough to make progress.
        return min(num_pages_for(num_tokens, self.page_size), self.chunk_pages())


def make_page_policy(spec: KVGroupSpec, pool: PagePool, page_size: int, group: int) -> PagePolicy:
    """The page policy of one KV layer group."""
    if spec.attention_chunk_size is not None:
        return ChunkedAttentionPolicy(pool, page_size, spec.attention_chunk_size, group)
    if spec.sliding_window is None:
        return FullAttentionPolicy(pool, page_size, group)
    return SlidingWindowPolicy(pool, page_size, spec.sliding_window, group)
