"""`CountingList`: a list that counts the items read out of it, to check that a streamed step reads its
new items only (O(N) for a stream of N tokens), never a copy of the whole list."""

from __future__ import annotations

from typing import Any


class CountingList(list):
    """Counts items read by slicing, indexing and iteration (class-wide: `CountingList.read`)."""

    read = 0

    def __getitem__(self, index: Any) -> Any:
        items = super().__getitem__(index)
        CountingList.read += len(items) if isinstance(index, slice) else 1
        return items

    def __iter__(self) -> Any:
        CountingList.read += len(self)
        return super().__iter__()


def count_request_reads(request: Any) -> None:
    """Swap `request`'s per-token lists (empty, before any token) for counting ones; reset the count."""
    request.generated_ids, request.logprobs = CountingList(), CountingList()
    request.top_logprobs, request.timestamps = CountingList(), CountingList()
    CountingList.read = 0
