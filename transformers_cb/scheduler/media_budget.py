"""The embedding store's rows as the scheduler plans them (torch-free; the rows themselves are
memory/media_store.py's, the encoder runner/media/media_runner.py's; docs/multimodal.md).

A request with media holds its rows (one per placeholder token) from the step it is admitted with
placeholders still to compute until the step that computes the last one, or until it stops running
(finished, failed, preempted). Admission waits while the store is full; a request whose rows exceed
the whole store is refused at submission (`MediaBudget.unfittable_reason`). A request that comes back
(recompute after preemption, a swap-in mid-image) is encoded again. A prefill chunk never ends inside
a block of tokens attending both ways (`block_cut`: Gemma 3's images).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..requests import Request


@dataclass
class MediaBudget:
    """`capacity`: embedding rows the store may hold at once; `max_chunk`: the most tokens one prefill chunk
    runs (`max_batch_tokens`), which a block attending both ways must fit whole (`block_cut`)."""

    capacity: int
    held: dict[str, int] = field(default_factory=dict)
    max_chunk: int | None = None

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def needs(self, request: Request) -> bool:
        """`request` has placeholders still to compute and holds no rows."""
        media = request.media
        return (
            media is not None
            and media.num_rows > 0
            and request.num_computed_tokens < media.end
            and request.request_id not in self.held
        )

    def fits(self, request: Request) -> bool:
        return request.media is None or self.used + request.media.num_rows <= self.capacity

    def hold(self, request: Request) -> None:
        self.held[request.request_id] = request.media.num_rows if request.media is not None else 0

    def computed(self, request: Request) -> None:
        """A step computed the request's tokens up to `num_computed_tokens`: its rows go once the last
        placeholder is among them (the runner drops them after that step's forward)."""
        media = request.media
        if media is not None and request.num_computed_tokens >= media.end:
            self.held.pop(request.request_id, None)

    def release(self, request: Request) -> None:
        """`request` stopped running (its rows go with the plan's `released`)."""
        self.held.pop(request.request_id, None)

    def unfittable_reason(self, num_rows: int, blocks: Sequence[tuple[int, int]] = ()) -> str | None:
        if num_rows > self.capacity:
            return (
                f"its media need {num_rows} embedding rows, more than the store holds ({self.capacity}, "
                "sized with the KV cache)"
            )
        longest = max((end - start for start, end in blocks), default=0)
        if self.max_chunk is not None and longest > self.max_chunk:
            return (
                f"an image block of {longest} tokens attends both ways and must run in one prefill chunk, "
                f"longer than max_batch_tokens ({self.max_chunk})"
            )
        return None


def block_cut(request: Request, num_tokens: int) -> int:
    """`num_tokens` of `request`'s next chunk, shortened so that the chunk does not end inside one of its
    media's blocks (tokens attending to each other both ways: they must run in one chunk, their keys all
    written when their queries attend): cut before the block, or 0 when the chunk starts at (or inside)
    it and cannot hold the rest of it."""
    media = request.media
    if media is None or not media.blocks:
        return num_tokens
    start = request.num_computed_tokens
    end = start + num_tokens
    for first, last in media.blocks:
        if first < end < last:
            return max(0, first - start)
    return num_tokens
