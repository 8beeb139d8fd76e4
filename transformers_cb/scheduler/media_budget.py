"""The embedding store's rows as the scheduler plans them (torch-free; the rows themselves are
memory/media_store.py's, the encoder runner/media.py's; docs/multimodal.md).

A request with media holds its rows (one per placeholder token) from the step it is admitted with
placeholders still to compute until the step that computes the last one, or until it stops running
(finished, failed, preempted). Admission waits while the store is full; a request whose rows exceed
the whole store is refused at submission (`MediaBudget.unfittable_reason`). A request that comes back
(recompute after preemption, a swap-in mid-image) is encoded again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..requests import Request


@dataclass
class MediaBudget:
    """`capacity`: embedding rows the store may hold at once."""

    capacity: int
    held: dict[str, int] = field(default_factory=dict)

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

    def unfittable_reason(self, num_rows: int) -> str | None:
        if num_rows > self.capacity:
            return (
                f"its media need {num_rows} embedding rows, more than the store holds ({self.capacity}, "
                "sized with the KV cache)"
            )
        return None
