"""Per-attention-type page policies: which pages a request must hold.

An allocator maps a request's token positions to pages of one `PagePool`.
Full attention keeps every page: a request with `n` tokens of KV holds
ceil(n / page_size) pages. Other policies (sliding window, prefix sharing)
override the small methods below, not the shared bookkeeping.
"""

from __future__ import annotations

from ..requests import Request
from .pool import PagePool


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class FullAttentionAllocator:
    """Pages for full-attention layers: one page per `page_size` tokens, never recycled early."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size

    def num_new_pages(self, request: Request, num_new_tokens: int) -> int:
        """Pages to add so that `request` can hold KV for `num_new_tokens` more tokens. Pure."""
        needed = num_pages_for(request.num_computed_tokens + num_new_tokens, self.page_size)
        return max(0, needed - len(request.page_ids))

    def num_fitting_tokens(self, request: Request, wanted: int) -> int:
        """How many of `wanted` new tokens fit in the request's pages plus the free pages. Pure."""
        capacity = (len(request.page_ids) + self.pool.num_free_pages) * self.page_size
        return max(0, min(wanted, capacity - request.num_computed_tokens))

    def max_pages(self, num_tokens: int) -> int:
        """Pages a request with `num_tokens` tokens of KV holds at its largest."""
        return num_pages_for(num_tokens, self.page_size)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request.page_ids` for `num_new_tokens` more tokens; False (nothing changed) if full."""
        new_page_ids = self.pool.allocate(self.num_new_pages(request, num_new_tokens))
        if new_page_ids is None:
            return False
        request.page_ids.extend(new_page_ids)
        return True

    def free(self, request: Request) -> None:
        """Release every page of `request` (preemption or end)."""
        self.pool.release(request.page_ids)
        request.page_ids = []
